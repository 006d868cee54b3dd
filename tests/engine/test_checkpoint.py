"""Checkpoints of the whole training state: save, resume, layout, checks on load."""

import copy
import errno
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import torch
from torch import nn

import offload
from offload.engine.checkpoint_chunks import ChunkFiles
from offload.engine.checkpoint_layout import flat_boxes
from offload.engine.training_checkpoint import RECORD
from offload.trace import TraceRecorder

from .models import TiedTwice, lm_batches, lm_loss, lm_train


class Dropped(TiedTwice):
    """TiedTwice with dropout: its masks come from torch's global RNG."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for _ in range(2):
            h = h + self.l2(nn.functional.dropout(torch.relu(self.l1(h)), 0.1))
        return self.head(self.norm(h) * self.scale)


def schedule(k: int) -> float:
    return 1.0 / (1.0 + 0.5 * k)


def _cfg(engine_cfg, tmp_path, name, params, grads, optimizer, dtype, **engine):
    cfg = engine_cfg(params, grads, optimizer, dtype=dtype, **engine)
    cfg["optim"]["max_grad_norm"] = 0.05  # small enough that clipping acts
    cfg["io"]["paths"] = [str(tmp_path / name)]
    return cfg


def _optim_state(engine):
    return {g.gid: {k: v.clone() for k, v in engine.optimizer.partition_state(g.gid).items()}
            for g in engine.groups if g.requires_grad}


def _assert_identical(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], dict):
            _assert_identical(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


PLACEMENTS = [("device", "host", "host"), ("host", "host", "host"), ("nvme", "nvme", "nvme")]


@pytest.mark.parametrize("dtype,state_dtype", [("fp32", "fp32"), ("bf16", "fp32"),
                                               ("bf16", "int8"), ("fp32", "bf16")])
@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS)
def test_resume_continues_bit_identical(tmp_path, engine_cfg, params, grads, optimizer, dtype,
                                        state_dtype):
    """3 steps + save + resume + 3 steps == 6 uninterrupted steps, bit for bit (with a
    schedule, clipping and dropout drawing from the restored RNG), with the moments
    in each stored form (compressed ones saved decoded and encoded again on load)."""
    batches = lm_batches(6)
    torch.manual_seed(0)
    cfg = _cfg(engine_cfg, tmp_path, "a", params, grads, optimizer, dtype)
    cfg["optim"]["state_dtype"] = state_dtype
    ck = tmp_path / "ckpt" / "step-3"
    with offload.initialize(Dropped(), cfg, lr_lambda=schedule) as a:
        lm_train(a, batches[:3])
        a.save_checkpoint(ck, extra={"batch": 3})
        want_losses = lm_train(a, batches[3:])
        want, want_opt = a.state_dict(), _optim_state(a)
    torch.manual_seed(1234)  # resume restores the RNG: this seed must not matter
    cfg = _cfg(engine_cfg, tmp_path, "b", params, grads, optimizer, dtype)
    cfg["optim"]["state_dtype"] = state_dtype
    with offload.initialize(Dropped, cfg, lr_lambda=schedule, resume=ck) as b:
        assert b.global_step == 3 and b.optimizer.steps == 3  # committed rounds
        got_losses = lm_train(b, batches[3:])
        assert got_losses == want_losses
        _assert_identical(b.state_dict(), want)
        _assert_identical(_optim_state(b), want_opt)
        assert b.global_step == 6
    rec = json.loads((ck / RECORD).read_text())
    assert rec["extra"] == {"batch": 3} and rec["global_step"] == 3 and rec["world"] == 1


class Sometimes(nn.Module):
    """Two layers in one group; `skip` leaves the second without a gradient, so its
    own update count (Adam's bias correction) falls behind the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.skip = False

    def forward(self, x):
        h = self.a(x)
        return h if self.skip else self.b(h)


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_resume_keeps_each_parameters_own_update_count(tmp_path, engine_cfg, optimizer):
    """A parameter that had no gradient in some steps resumes at its own count, so the
    continuation equals the uninterrupted run bit for bit."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(6)]

    def run(engine, steps, skips):
        for k in steps:
            engine.module.skip = k in skips
            x, y = data[k]
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    torch.manual_seed(0)
    ref = Sometimes()
    cfg = _cfg(engine_cfg, tmp_path, "a", "host", "host", optimizer, "fp32", group_size=1000)
    ck = tmp_path / "ck"
    with offload.initialize(ref, cfg) as a:
        run(a, range(3), skips={0, 1})
        steps = list(a.optimizer.partition(0).seg_steps)
        assert min(steps) < max(steps)  # the two layers' counts differ
        a.save_checkpoint(ck)
        run(a, range(3, 6), skips=set())
        want = a.state_dict()
    torch.manual_seed(0)
    cfg = _cfg(engine_cfg, tmp_path, "b", "host", "host", optimizer, "fp32", group_size=1000)
    with offload.initialize(Sometimes(), cfg, resume=ck) as b:
        assert b.optimizer.partition(0).seg_steps == steps
        run(b, range(3, 6), skips=set())
        _assert_identical(b.state_dict(), want)


def test_layout_is_plain_zarr3_in_logical_shapes(tmp_path, engine_cfg):
    """One array per tensor and kind, full logical shape, readable by a zarr v3 reader."""
    torch.manual_seed(0)
    cfg = _cfg(engine_cfg, tmp_path, "a", "host", "host", "host", "bf16")
    ck = tmp_path / "ck"
    with offload.initialize(TiedTwice(), cfg) as e:
        lm_train(e, lm_batches(1))
        e.save_checkpoint(ck)
        sd = e.state_dict()
        moments = e.optimizer.partition_state(e.groups[0].gid)
        first = e.groups[0].slots[0]
    for name, value in sd.items():
        if name == "head.weight":  # tied to emb.weight: one array, both names recorded
            continue
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            arr = ts.open({"driver": "zarr3", "kvstore": f"file://{ck}/{kind}/{name}"}).result()
            assert tuple(arr.shape) == tuple(value.shape), (kind, name)
        master = ts.open({"driver": "zarr3", "kvstore": f"file://{ck}/master/{name}"}
                         ).result().read().result()
        assert np.array_equal(master, value.numpy()), name
        param = ts.open({"driver": "zarr3", "kvstore": f"file://{ck}/param/{name}"}).result()
        assert param.dtype.name == "bfloat16"
    rec = json.loads((ck / RECORD).read_text())
    assert rec["tensors"]["emb.weight"]["aliases"] == ["emb.weight", "head.weight"]
    avg = ts.open({"driver": "zarr3", "kvstore": f"file://{ck}/exp_avg/{first.fqn}"}
                  ).result().read().result()
    assert np.array_equal(avg.reshape(-1), moments["exp_avg"][first.offset:first.offset
                                                             + first.numel].numpy())


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 5)])
def test_flat_boxes_cover_exactly_the_range(shape):
    n = int(np.prod(shape))
    ref = np.arange(n).reshape(shape)
    for lo in range(0, n, 3):
        for hi in range(lo, n + 1, 5):
            got = [ref[idx].reshape(-1) for idx, _a, _b in flat_boxes(shape, lo, hi)]
            flat = np.concatenate(got) if got else np.empty(0, dtype=ref.dtype)
            assert np.array_equal(flat, np.arange(lo, hi)), (lo, hi)


def test_save_refused_while_a_step_is_open(tmp_path, engine_cfg):
    cfg = _cfg(engine_cfg, tmp_path, "a", "host", "host", "host", "fp32")
    with offload.initialize(TiedTwice(), cfg) as e:
        x, y = lm_batches(1)[0]
        e.backward(lm_loss(e(x), y))
        with pytest.raises(offload.CheckpointError, match="a step is open"):
            e.save_checkpoint(tmp_path / "ck")
        assert not (tmp_path / "ck").exists()
        e.step()
        e.save_checkpoint(tmp_path / "ck")
        with pytest.raises(offload.CheckpointError, match="exists"):
            e.save_checkpoint(tmp_path / "ck")


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(64, 32), nn.Dropout(0.3), nn.Linear(32, 64)

    def forward(self, x):
        return self.head(self.drop(self.emb(x)))


def test_save_refused_while_a_training_forward_awaits_its_backward(tmp_path, engine_cfg):
    """[Note: a forward awaiting its backward] in hooks.py: a save between a training
    forward and its backward held the RNG states after the forward's dropout and lost
    its activations; resumed, the same micro-batch drew other masks (l1.weight 0.035 off
    the uninterrupted run after three steps). It is refused; a forward whose outputs
    were dropped, that raised, or ran in evaluation or under no_grad holds nothing back,
    and a save after the backward resumes as the run goes on."""
    batches = lm_batches(4)
    torch.manual_seed(0)
    model = _Dropped()
    ref = copy.deepcopy(model)
    cfg = _cfg(engine_cfg, tmp_path, "a", "host", "host", "host", "fp32", group_size=300)
    torch.manual_seed(7)
    with offload.initialize(ref, cfg) as r:
        want = lm_train(r, batches)
    cfg["io"]["paths"] = [str(tmp_path / "b")]
    torch.manual_seed(7)
    with offload.initialize(model, cfg) as e:
        lm_train(e, batches[:2])
        x, y = batches[2]
        rng = torch.get_rng_state()
        out = e(x)
        with pytest.raises(offload.CheckpointError, match="a forward in training mode awaits "
                                                          "its backward"):
            e.save_checkpoint(tmp_path / "ck")
        assert not (tmp_path / "ck").exists()
        del out
        e(x)  # a graph dropped at once
        with torch.no_grad():
            e(x)
        e.eval()
        kept = e(x)
        e.train()
        with pytest.raises(RuntimeError, match="raised by the model") as failed:
            e.head.register_forward_pre_hook(_raise)
            e(x)  # its traceback (kept, as a notebook keeps the last) holds the graph
        e.head._forward_pre_hooks.clear()
        torch.set_rng_state(rng)  # the draws of the forwards above undone
        e.save_checkpoint(tmp_path / "ck")
        assert kept.requires_grad and failed.tb is not None
    cfg["io"]["paths"] = [str(tmp_path / "c")]
    with offload.initialize(_Dropped(), cfg, resume=tmp_path / "ck") as e:
        got = lm_train(e, batches[2:])
        loss = lm_loss(e(x), y)
        e.backward(loss)  # its graph still held after the backward: the forward's done
        e.step()
        e.save_checkpoint(tmp_path / "ck2")
    assert got == want[2:]


def _raise(*_):
    raise RuntimeError("raised by the model")

@pytest.mark.parametrize("params,grads,optimizer,dtype", [
    ("host", "host", "host", "fp32"), ("nvme", "nvme", "nvme", "bf16")])
def test_background_save_holds_the_state_of_the_call(tmp_path, engine_cfg, params, grads,
                                                     optimizer, dtype):
    """A non-blocking save returns at once; the steps that follow (early updates in
    their backward included) do not leak into it; the next step waits for it."""
    batches = lm_batches(6)
    torch.manual_seed(0)
    cfg = engine_cfg(params, grads, optimizer, dtype=dtype)  # no clipping: early updates
    cfg["io"]["paths"] = [str(tmp_path / "a")]
    rec = TraceRecorder(enabled=True)
    ck = tmp_path / "ck"
    start = ChunkFiles._start_chunk

    def slow_start(self, *args):  # a slow disk: the save outlasts the next forward and backward
        time.sleep(0.02)
        return start(self, *args)
    ChunkFiles._start_chunk = slow_start
    try:
        with offload.initialize(Dropped(), cfg, lr_lambda=schedule, recorder=rec) as a:
            lm_train(a, batches[:3])
            want, want_opt = a.state_dict(), _optim_state(a)
            handle = a.save_checkpoint(ck, blocking=False)
            assert not handle.done()
            lm_train(a, batches[3:])
            assert handle.done() and handle.wait() == ck
            assert 0 < handle.stalled < handle.seconds
            after = a.state_dict()
    finally:
        ChunkFiles._start_chunk = start
    assert not torch.equal(after["l1.weight"], want["l1.weight"])
    names = {e.name for e in rec.events()}
    cfg["io"]["paths"] = [str(tmp_path / "b")]
    with offload.initialize(Dropped, cfg, lr_lambda=schedule, resume=ck) as b:
        assert b.global_step == 3 and b.optimizer.steps == 3  # committed rounds
        _assert_identical(b.state_dict(), want)
        _assert_identical(_optim_state(b), want_opt)
    assert {"checkpoint save", "checkpoint wait"} <= names  # the trace shows the save


@pytest.mark.parametrize("change", ["load_state_dict", "full_weights"])
def test_a_weight_change_waits_for_a_background_save(tmp_path, engine_cfg, change):
    """`load_state_dict` and `full_weights(writable=True)` change committed weights, as
    `step()` does: a save in the background is let finish first, so it holds the
    weights as of its call, not the new ones (nor a mix, nor a chunk changed under its
    write)."""
    cfg = engine_cfg("host", "host", "host")
    cfg["io"]["paths"] = [str(tmp_path / "a")]
    ck = tmp_path / "ck"
    start = ChunkFiles._start_chunk

    def slow_start(self, *args):  # a slow disk: the save outlasts the call that follows
        time.sleep(0.02)
        return start(self, *args)
    torch.manual_seed(0)
    with offload.initialize(Dropped(), cfg) as a:
        lm_train(a, lm_batches(1))
        want = a.state_dict()
        ChunkFiles._start_chunk = slow_start
        try:
            handle = a.save_checkpoint(ck, blocking=False)
            assert not handle.done()
            if change == "load_state_dict":
                a.load_state_dict({k: torch.zeros_like(v) for k, v in want.items()})
            else:
                with a.full_weights(writable=True) as w, torch.no_grad():
                    for t in w.values():
                        t.zero_()
            assert handle.done() and handle.stalled > 0
        finally:
            ChunkFiles._start_chunk = start
        assert not a.state_dict()["l1.weight"].any()
    cfg["io"]["paths"] = [str(tmp_path / "b")]
    with offload.initialize(Dropped, cfg, resume=ck) as b:
        _assert_identical(b.state_dict(), want)


def test_failed_background_save_does_not_fail_training(tmp_path, engine_cfg, small_fs):
    """A save onto a disk too full for it (a real file system) fails on its own handle
    while training goes on, naming the path and the fix, and removes what it wrote;
    the next save, with room, succeeds."""
    cfg = _cfg(engine_cfg, tmp_path, "a", "host", "host", "host", "fp32")
    disk = Path(small_fs(24))
    ballast = disk / "ballast"
    with open(ballast, "wb") as f:  # leaves about 8 MiB: 13 MB of state does not fit
        os.posix_fallocate(f.fileno(), 0, 14 << 20)

    def train(e):
        e.backward(e(torch.randn(4, 1024)).square().mean())
        e.step()
    with offload.initialize(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 32)), cfg) as e:
        train(e)
        saving = e.save_checkpoint(disk / "ck" / "a", blocking=False)
        train(e)  # the step goes on; the save's error stays with its handle
        assert e.global_step == 2
        with pytest.raises(offload.CheckpointError, match=r"writing .*/ck/a failed .*No space "
                                                          r"left.* free disk space") as err:
            saving.wait()
        assert err.value.__cause__.errno == errno.ENOSPC
        assert sorted(p.name for p in (disk / "ck").iterdir()) == []  # the space is back
        ballast.unlink()
        e.save_checkpoint(disk / "ck" / "b")
    assert sorted(p.name for p in (disk / "ck").iterdir()) == ["b"]


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))


def test_module_buffers_are_saved_and_restored(tmp_path, engine_cfg):
    """BatchNorm's running statistics and batch count are part of the training state:
    a resumed model evaluates as the saved one (a background save holds them as of
    its call, though the next forward changes them)."""
    cfg = engine_cfg("host", "host", "host")
    cfg["io"]["paths"] = [str(tmp_path / "a")]
    torch.manual_seed(0)
    data = [torch.randn(16, 32) * 3 + 1 for _ in range(4)]
    probe = torch.randn(4, 32)
    with offload.initialize(_bn_model(), cfg) as a:
        for x in data[:2]:
            a.backward(a(x).square().mean())
            a.step()
        want = {k: v.clone() for k, v in a.state_dict().items()}
        saving = a.save_checkpoint(tmp_path / "ck", blocking=False)
        a.backward(a(data[2]).square().mean())  # running statistics change now
        a.step()
        saving.wait()
    assert int(want["1.num_batches_tracked"]) == 2
    cfg["io"]["paths"] = [str(tmp_path / "b")]
    # built on meta, as a resume is documented (buffers included): all values come from it
    with offload.initialize(_bn_model, cfg, resume=tmp_path / "ck") as b:
        _assert_identical(b.state_dict(), want)
        b.eval()
        got = b(probe).detach()
    ref = _bn_model()
    ref.load_state_dict(want)
    assert torch.equal(got, ref.eval()(probe).detach())


def test_buffers_that_do_not_match_are_refused_before_any_state_is_read(tmp_path,
                                                                         engine_cfg):
    cfg = engine_cfg("host", "host", "host")
    cfg["io"]["paths"] = [str(tmp_path / "a")]
    with offload.initialize(_bn_model(), cfg) as a:
        a.backward(a(torch.randn(8, 32)).square().mean())
        a.step()
        a.save_checkpoint(tmp_path / "ck")
    other = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    other[1].register_buffer("scale", torch.ones(32))
    cfg["io"]["paths"] = [str(tmp_path / "b")]
    with pytest.raises(offload.CheckpointError, match=r"the model's buffers differ from the "
                                                      r"checkpoint's .*\['1\.scale'\]"):
        offload.initialize(other, cfg, resume=tmp_path / "ck")
    # the same, not "no _init_weights to fill" its new buffer
    on_meta = copy.deepcopy(other).to("meta")
    with pytest.raises(offload.CheckpointError, match=r"the model's buffers differ from the "
                                                      r"checkpoint's .*\['1\.scale'\]"):
        offload.initialize(on_meta, cfg, resume=tmp_path / "ck")
    record = tmp_path / "ck" / "buffers.json"
    edited = json.loads(record.read_text())
    edited["1.running_mean"]["shape"] = [31]
    record.write_text(json.dumps(edited))
    with pytest.raises(offload.CheckpointCorruptError, match=r"buffers\.json does not match "
                                                             r"its sha256"):
        offload.initialize(_bn_model(), cfg, resume=tmp_path / "ck")
    from offload.engine import CheckpointReader
    assert any("buffers.json" in p for p in CheckpointReader(tmp_path / "ck").verify())
