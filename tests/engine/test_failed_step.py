"""A step that fails leaves every partition bit-identical to before it, and training
goes on as if it never failed: a full disk (a real, loop-mounted ext4 file system),
corrupted bytes on disk, an exception in the user's backward or forward."""

import copy
import os
import uuid

import pytest
import torch
from torch import nn

import offload
from offload.engine.step import StepFailedError
from offload.io import CorruptionError, SwapFullError
from offload.store import Tier

from ..conftest import flip_byte
from .models import TiedTwice, lm_batches, lm_loss


def snapshot(engine) -> dict:
    """Every byte of training state: each group's parameter partition, its optimizer
    state (master, moments, step), and the engine's step counters."""
    out = {"global_step": engine.global_step, "loss_scale": engine.loss_scale}
    for g in engine.groups:
        out[("p", g.gid)] = engine.store.fetch(("p", g.gid), to=Tier.HOST).wait().cpu().clone()
        if g.requires_grad:
            for k, v in engine.optimizer.partition_state(g.gid).items():
                out[(k, g.gid)] = v.clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            assert a[k] == b[k], k


def train_step(engine, batch) -> bool:
    x, y = batch
    engine.backward(lm_loss(engine(x), y))
    return engine.step()


def with_reference(model: nn.Module, cfg: dict):
    """An engine on a copy of `model` and the run that never fails: a second engine on
    another copy, with swap files of its own."""
    engine = offload.initialize(copy.deepcopy(model), cfg)
    ref = offload.initialize(copy.deepcopy(model), {**cfg, "io": {
        **cfg["io"], "paths": [cfg["io"]["paths"][0] + "-ref"]}})
    return engine, ref


def trains_on_as(engine, ref, batches) -> None:
    """Both train on `batches`; the engine ends bit-identical to the reference."""
    for b in batches:
        assert train_step(engine, b) and train_step(ref, b)
    assert_same(snapshot(engine), snapshot(ref))


PLACEMENTS = [  # params, grads, optimizer, dtype, optim.state_dtype (the moments' form)
    ("nvme", "host", "nvme", "fp32", "fp32"),  # the parameter is the master, from NVMe state
    ("host", "host", "nvme", "bf16", "fp32"),
    ("nvme", "nvme", "nvme", "bf16", "fp32"),
    ("nvme", "host", "nvme", "fp32", "bf16"),
    ("host", "host", "nvme", "bf16", "int8"),
]


@pytest.mark.parametrize("params,grads,optimizer,dtype,state_dtype", PLACEMENTS)
def test_corrupted_optimizer_chunk_fails_the_step_and_changes_nothing(
        engine_cfg, params, grads, optimizer, dtype, state_dtype):
    """The group updated last (group 0: backward reaches it last) has a corrupted
    chunk: every other group's update already ran. All of them are undone; with the
    byte flipped back the step runs again and matches a run that never failed."""
    torch.manual_seed(0)
    ref_model = TiedTwice()
    batches = lm_batches(4)
    cfg = engine_cfg(params, grads, optimizer, dtype=dtype)
    cfg["optim"]["state_dtype"] = state_dtype
    engine, ref = with_reference(ref_model, cfg)
    try:
        for b in batches[:2]:
            train_step(engine, b)
            train_step(ref, b)
        before = snapshot(engine)
        opt = engine.optimizer
        part = opt.partition(0)
        path = opt._pipeline.swap.paths[0]
        where = part.extents[part.layout.n_chunks - 1].offset + 8
        flip_byte(path, where)
        x, y = batches[2]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError) as err:
            engine.step()
        assert isinstance(err.value.__cause__.__cause__, CorruptionError)
        assert 0 in err.value.groups and len(err.value.groups) > 1  # others had run
        assert "rolled back: every group is at its state before the step" in str(err.value)
        flip_byte(path, where)  # the cause removed (and the state readable again)
        assert_same(snapshot(engine), before)
        trains_on_as(engine, ref, batches[2:])
    finally:
        engine.close()
        ref.close()


def test_a_failure_half_way_through_an_update_in_place_changes_nothing(tmp_path):
    """[Note: the update in the old copy's memory]: with fp32 parameters streaming from
    NVMe, an update overwrites the copy it read this step in place, chunk by chunk. A
    corrupted chunk late in one group's optimizer state fails the update after its
    first chunks were written over: the NVMe copy still holds the old values, and the
    step's failure leaves every byte as before; training then matches a run that
    never failed."""
    from .test_prefetch import Stack

    def cfg(name):
        return {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme",
                           "group_size": 1},
                "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
                "io": {"paths": [str(tmp_path / name)], "buffer_budget": "8MiB"},
                "store": {"host_budget": "2560KiB", "device_budget": "2304KiB",
                          "device": "cpu"}}

    torch.manual_seed(0)
    model = Stack(dim=512, layers=6)
    data = [(torch.randn(8, 512), torch.randn(8, 512)) for _ in range(4)]

    def step(e, b):
        e.backward((e(b[0]) - b[1]).square().mean())
        return e.step()

    with offload.initialize(copy.deepcopy(model), cfg("a")) as engine, \
            offload.initialize(copy.deepcopy(model), cfg("ref")) as ref:
        for b in data[:2]:
            assert step(engine, b) and step(ref, b)
        before = snapshot(engine)
        part = engine.optimizer.partition(3)  # updated third, read from NVMe this step
        assert part.layout.n_chunks > 8
        path = engine.optimizer._pipeline.swap.paths[0]
        where = part.extents[part.layout.n_chunks - 1].offset + 8
        flip_byte(path, where)
        engine.backward((engine(data[2][0]) - data[2][1]).square().mean())
        with pytest.raises(StepFailedError) as err:
            engine.step()
        assert 3 in err.value.groups
        flip_byte(path, where)
        assert_same(snapshot(engine), before)
        for b in data[2:]:
            assert step(engine, b) and step(ref, b)
        assert_same(snapshot(engine), snapshot(ref))


class RaisesInBackward(nn.Module):
    """Wraps a block; its backward raises while `armed`."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.armed = False

    def forward(self, x):
        y = self.block(x)
        if self.armed and y.requires_grad:
            def boom(grad):
                raise ValueError("the user's backward failed")
            y.register_hook(boom)
        return y


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    layers = [nn.Linear(16, 32), nn.Tanh(), RaisesInBackward(nn.Linear(32, 32)), nn.Tanh()]
    layers += [nn.Linear(32, 32) for _ in range(3)] + [nn.Linear(32, 1)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("optimizer,state_dtype", [("nvme", "fp32"), ("host", "fp32"),
                                                   ("nvme", "int8"), ("host", "int8")])
def test_exception_in_backward_after_early_updates_changes_nothing(engine_cfg, optimizer,
                                                                   state_dtype):
    model = _mlp()
    ref_model = copy.deepcopy(model)
    cfg = engine_cfg("nvme", "host", optimizer, group_size=600)
    cfg["optim"]["state_dtype"] = state_dtype
    engine = offload.initialize(model, cfg)
    ref = offload.initialize(ref_model, {**cfg, "io": {
        **cfg["io"], "paths": [cfg["io"]["paths"][0] + "-ref"]}})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]

    def step(e, x, y):
        e.backward(nn.functional.mse_loss(e(x), y))
        return e.step()
    try:
        step(engine, *data[0])
        step(ref, *data[0])
        before = snapshot(engine)
        model[2].armed = True
        loss = nn.functional.mse_loss(engine(*data[1][:1]), data[1][1])
        with pytest.raises(ValueError, match="user's backward"):
            engine.backward(loss)
        if optimizer == "nvme":  # the layers after the failing one were updated early
            assert engine.optimizer.round == []
        assert_same(snapshot(engine), before)
        assert engine.step() is False  # nothing left to apply
        assert_same(snapshot(engine), before)
        model[2].armed = False
        for x, y in data[1:]:
            assert step(engine, x, y) and step(ref, x, y)
        assert_same(snapshot(engine), snapshot(ref))
    finally:
        engine.close()
        ref.close()


def test_training_loop_semantics_match_torch(engine_cfg):
    """zero_grad() at any point, step() with nothing to apply, two backwards before
    one step with grad_accum_steps=1: as torch, or refused before anything changes."""
    torch.manual_seed(4)
    model = TiedTwice()
    ref = copy.deepcopy(model)
    engine = offload.initialize(model, engine_cfg("host", "host", "nvme"))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = lm_batches(5, seed=4)
    try:
        before = snapshot(engine)
        assert engine.step() is False           # before any backward: nothing happens
        engine.zero_grad()                      # nothing to drop
        assert_same(snapshot(engine), before)
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))  # early updates ran in the background...
        engine.zero_grad()                      # ...and are undone, as torch drops .grad
        assert engine.step() is False
        assert_same(snapshot(engine), before)
        with pytest.raises(RuntimeError, match="call engine.step"):
            engine.backward(lm_loss(engine(x), y))
            engine.backward(lm_loss(engine(x), y))
        assert_same(snapshot(engine), before)   # refused before anything changed
        engine.zero_grad()
        for x, y in batches[1:]:
            engine.backward(lm_loss(engine(x), y))
            assert engine.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            opt.step()
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=2e-6, rtol=0)
    finally:
        engine.close()


def test_a_forward_that_raises_between_micro_batches_starts_the_step_over(engine_cfg,
                                                                         caplog):
    """grad_accum_steps=2: the second micro-batch's forward raises (a token outside the
    vocabulary) after the first one's backward. The step's micro-batches run again from
    the first give the run that never failed (the first one's gradient was dropped, not
    counted twice); an evaluation forward that raises there keeps the window's
    gradients."""
    torch.manual_seed(0)
    model = TiedTwice()
    batches = lm_batches(6)
    cfg = engine_cfg("nvme", "host", "nvme", group_size=600, grad_accum_steps=2)
    engine, ref = with_reference(model, cfg)
    bad = torch.full_like(batches[0][0], 10_000)
    try:
        for b in batches[:2]:
            train_step(engine, b), train_step(ref, b)
        before = snapshot(engine)
        assert train_step(engine, batches[2]) is False
        with pytest.raises(IndexError):
            engine(bad)
        assert "gradients are dropped" in caplog.text
        assert engine.step() is False
        assert_same(snapshot(engine), before)
        assert [train_step(engine, b) for b in batches[2:4]] == [False, True]
        assert train_step(engine, batches[4]) is False
        with torch.no_grad(), pytest.raises(IndexError):
            engine(bad)
        assert train_step(engine, batches[5]) is True
        assert [train_step(ref, b) for b in batches[2:]] == [False, True, False, True]
        assert_same(snapshot(engine), snapshot(ref))
    finally:
        engine.close()
        ref.close()


def _fill(directory: str) -> str:
    """Takes every free block of the file system of `directory` (fallocate until the
    disk says ENOSPC, halving the request each time)."""
    path = os.path.join(directory, f"ballast-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        size, step = 0, os.statvfs(directory).f_bfree * os.statvfs(directory).f_frsize
        while step >= 4096:
            try:
                os.posix_fallocate(f.fileno(), size, step)
                size += step
            except OSError:
                step //= 2
    return path


@pytest.mark.parametrize("params,dtype,state_dtype", [("nvme", "fp32", "fp32"),
                                                      ("host", "bf16", "fp32"),
                                                      ("host", "bf16", "int8")])
def test_disk_full_during_the_step_changes_nothing(engine_cfg, small_fs, params, dtype,
                                                   state_dtype):
    """A real file system fills up while the step writes the new optimizer state:
    the step fails with the disk's error, every partition is as before, and once
    space is freed the same step gives the uninterrupted run's state."""
    torch.manual_seed(5)
    model = TiedTwice()
    ref_model = copy.deepcopy(model)
    batches = lm_batches(3, seed=5)
    cfg = engine_cfg(params, "host", "nvme", dtype=dtype)
    cfg["io"].update(paths=[small_fs(32)], grow_step="64KiB", stripe_size="64KiB")
    ref_cfg = engine_cfg(params, "host", "nvme", dtype=dtype)
    cfg["optim"]["state_dtype"] = ref_cfg["optim"]["state_dtype"] = state_dtype
    engine = offload.initialize(model, cfg)
    ref = offload.initialize(ref_model, ref_cfg)
    try:  # the first step needs room for the state's new version beside the old one
        before = snapshot(engine)
        ballast = _fill(cfg["io"]["paths"][0])
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError) as err:
            engine.step()
        cause = err.value.__cause__
        assert isinstance(cause.__cause__ if cause.__cause__ else cause, SwapFullError), cause
        assert_same(snapshot(engine), before)
        os.unlink(ballast)
        for b in batches:
            assert train_step(engine, b) and train_step(ref, b)
        assert_same(snapshot(engine), snapshot(ref))
    finally:
        engine.close()
        ref.close()


def test_state_that_fits_the_disk_trains_where_every_file_s_growth_step_would_not(
        engine_cfg, small_fs):
    """[Note: growth on a nearly full disk] in io/swap.py: 8 MiB of parameters, 8 of
    gradients and 16 of moments on a 64 MiB file system, swap files growing by 32 MiB:
    the first files to grow took a whole step each and the moments' file found no
    room; now a step that would take more than half the free space is not taken, and
    training matches the same run on a roomy disk."""
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    ref_model = copy.deepcopy(model)
    cfg = engine_cfg("nvme", "nvme", "nvme", group_size=1 << 18)
    cfg["io"].update(paths=[small_fs(64)], grow_step="32MiB")
    cfg["optim"]["chunk_elems"] = 1 << 16
    ref_cfg = engine_cfg("nvme", "nvme", "nvme", group_size=1 << 18)
    ref_cfg["optim"]["chunk_elems"] = 1 << 16
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 512, generator=g) for _ in range(3)]
    engine = offload.initialize(model, cfg)
    ref = offload.initialize(ref_model, ref_cfg)
    try:
        for x in batches:
            for e in (engine, ref):
                e.backward(e(x).square().mean())
                assert e.step()
        assert_same(snapshot(engine), snapshot(ref))
    finally:
        engine.close()
        ref.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_corrupted_parameter_on_nvme_is_reported_and_the_forward_can_run_again(
        engine_cfg, dtype):
    """A parameter partition read from NVMe with a flipped byte fails the forward with
    the CorruptionError that names it (nothing else is held on its behalf: no pin of a
    fetch that never landed); with the byte restored, training goes on and matches a
    run that never failed."""
    torch.manual_seed(0)
    model = TiedTwice()
    batches = lm_batches(4)
    cfg = engine_cfg("nvme", "host", "host", dtype=dtype, group_size=600)
    engine, ref = with_reference(model, cfg)
    try:
        assert train_step(engine, batches[0]) and train_step(ref, batches[0])
        before = snapshot(engine)
        key = ("p", engine.groups[-1].gid)
        engine.store.evict(key, Tier.NVME).wait()
        assert engine.store.info(key).valid == {Tier.NVME}
        path = engine.store.swap_paths("param")[0]
        where = engine.store.info(key).extent[0] + 8
        flip_byte(path, where)
        x, y = batches[1]
        for _ in range(2):  # and again: the failed read left nothing behind
            with pytest.raises(CorruptionError, match="checksum mismatch"):
                engine(x)
        flip_byte(path, where)
        assert_same(snapshot(engine), before)
        trains_on_as(engine, ref, batches[1:])
    finally:
        engine.close()
        ref.close()


def test_a_read_that_fails_while_the_step_pins_in_place_leaves_nothing_pinned(engine_cfg,
                                                                             monkeypatch):
    """Host optimizer state updates in place once every partition of the step is
    pinned in memory; a read that fails part way (a disk error on the second) fails
    the step whole and unpins the ones pinned before it: training goes on as a run
    that never failed (a partition left pinned failed the rollback, and every later
    backward was refused)."""
    from offload.engine.step import StepFailedError

    torch.manual_seed(0)
    batches = lm_batches(3)
    engine, ref = with_reference(TiedTwice(), engine_cfg("nvme", "nvme", "host",
                                                         group_size=600))
    try:
        assert train_step(engine, batches[0]) and train_step(ref, batches[0])
        before = snapshot(engine)
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        fetch, pinned = engine.store.fetch, []

        def failing(key, *args, **kwargs):
            if kwargs.get("pin"):
                pinned.append(key)
                if len(pinned) == 2:
                    raise OSError(5, "Input/output error")
            return fetch(key, *args, **kwargs)
        monkeypatch.setattr(engine.store, "fetch", failing)
        with pytest.raises(StepFailedError):
            engine.step()
        monkeypatch.undo()
        assert len(pinned) == 2  # the step's gradients are dropped, its partitions kept
        assert all(engine.store.info(k).pins == 0 for k in pinned if k in engine.store)
        assert_same(snapshot(engine), before)
        trains_on_as(engine, ref, batches[1:])
    finally:
        engine.close()
        ref.close()


def test_every_signal_held_past_the_point_of_no_return_is_delivered(engine_cfg):
    """Two signals with the program's own handlers (a stats dump, a preemption notice)
    that come between the optimizer's commit and the parameters' switch each reach
    their handler once the step completed, in the order they came."""
    import signal

    got = []
    handlers = {s: signal.signal(s, lambda signum, frame: got.append(signum))
                for s in (signal.SIGUSR1, signal.SIGTERM)}
    engine = offload.initialize(TiedTwice(), engine_cfg("host", "host", "nvme",
                                                        group_size=600))
    switch = engine.staged.switch

    def signalled():
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGTERM)
        assert got == []  # held until the step is whole
        return switch()
    try:
        engine.staged.switch = signalled
        x, y = lm_batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        assert engine.step()
        assert got == [signal.SIGUSR1, signal.SIGTERM]
    finally:
        engine.close()
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGALRM"])
@pytest.mark.parametrize("optimizer,at", [("host", "update"), ("nvme", "switch"),
                                          ("host", "switch")])
def test_ctrl_c_past_the_point_of_no_return_completes_the_step_first(engine_cfg, optimizer,
                                                                      at, sig):
    """[Note: no interrupt mid-commit]: a SIGINT that arrives after the first update in
    place (`update`: host state, pinned in memory, no previous version), or between
    the optimizer's commit and the parameters' switch (`switch`), is delivered once
    the step completed: KeyboardInterrupt, with every partition at the step's new
    state, and training goes on as in a run that was never interrupted. So is a
    signal whose handler (the program's own) raises: a SIGALRM timeout, which is
    not reported as a step that failed and changed nothing."""
    import signal

    torch.manual_seed(0)
    model = TiedTwice()
    batches = lm_batches(4)
    cfg = engine_cfg("host", "host", optimizer, group_size=600)
    engine, ref = with_reference(model, cfg)
    hit = []
    expected = KeyboardInterrupt if sig == "SIGINT" else TimeoutError

    def alarm(signum, frame):
        raise TimeoutError("the program's own timeout")
    before = signal.signal(signal.SIGALRM, alarm) if sig == "SIGALRM" else None

    def interrupting(fn):
        def call(*args, **kwargs):
            if not hit:
                hit.append(kwargs.get("final"))
                signal.raise_signal(getattr(signal, sig))
            return fn(*args, **kwargs)
        return call
    try:
        assert train_step(engine, batches[0]) and train_step(ref, batches[0])
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        if at == "update":
            engine.optimizer.update = interrupting(engine.optimizer.update)
        else:
            engine.staged.switch = interrupting(engine.staged.switch)
        with pytest.raises(expected):
            engine.step()
        assert hit == [True if at == "update" else None]  # "update": it ran in place
        assert train_step(ref, batches[1])
        assert_same(snapshot(engine), snapshot(ref))
        trains_on_as(engine, ref, batches[2:])
    finally:
        if before is not None:
            signal.signal(signal.SIGALRM, before)
        engine.close()
        ref.close()


def test_a_partition_held_at_the_commit_fails_the_step_before_anything_commits(engine_cfg):
    """A group's parameter partition pinned when the step commits (here by hand; a
    forward left running on another thread would) cannot be switched to its new
    version: the step fails before the optimizer commits, and changes nothing."""
    torch.manual_seed(0)
    batches = lm_batches(3)
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "nvme",
                                                    group_size=600)) as engine:
        assert train_step(engine, batches[0])
        before = snapshot(engine)
        key = ("p", engine.groups[0].gid)
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        engine.store.pin(key)
        with pytest.raises(StepFailedError, match="pinned 1 time"):
            engine.step()
        engine.store.unpin(key)
        assert_same(snapshot(engine), before)
        assert train_step(engine, batches[1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_non_finite_gradient_norm_skips_the_step_with_a_warning(engine_cfg, dtype, caplog):
    """With clipping on, an inf in the batch makes the norm inf: the step is skipped (not
    only in fp16), the state is exactly as before, a warning says so, and the next
    batch trains."""
    import logging
    torch.manual_seed(0)
    cfg = engine_cfg("device", "host", "host", dtype=dtype)
    cfg["optim"]["max_grad_norm"] = 1.0
    with offload.initialize(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
                            cfg) as engine:
        before = snapshot(engine)
        kind = torch.float32 if dtype == "fp32" else torch.bfloat16
        x, y = torch.randn(4, 8, dtype=kind), torch.randn(4, 1, dtype=kind)
        x[0, 0] = float("inf")
        engine.backward(nn.functional.mse_loss(engine(x), y))
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert engine.step() is False
        assert "step 1 skipped: the gradients' norm is not finite" in caplog.text
        assert_same(snapshot(engine), before)
        x[0, 0] = 0.0
        engine.backward(nn.functional.mse_loss(engine(x), y))
        assert engine.step() and engine.global_step == 1
