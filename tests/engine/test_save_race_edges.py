"""Checkpoints saved in the background while training goes on, under budgets tight
enough that partitions move all the time: the save holds exactly the state of its
call (early updates on the update thread split, stage and rewrite partitions the
save is reading), training after it is bit-identical to a run that never saved,
and closing, saving again, a failed step and a full disk while a save is in
flight neither hang nor change a number. Real swap files, real threads; the save
is slowed (each chunk it starts) so that it overlaps the next forward and backward."""

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from offload.engine.checkpoint_chunks import ChunkFiles

from .disks import fill

WAIT = 60.0  # seconds: a save not done by then is hung


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # a group per layer


def _cfg(path: Path, params: str, grads: str, optimizer: str, dtype: str, host: str,
         device: str) -> dict:
    return {"engine": {"params": params, "grads": grads, "optimizer": optimizer,
                       "dtype": dtype, "group_size": 4000},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
            "io": {"paths": [str(path)], "buffer_budget": "32MiB", "grow_step": "4MiB"},
            # a deadlock between the save and training raises instead of hanging
            "store": {"host_budget": host, "device_budget": device, "device": "cpu",
                      "wait_timeout": 30.0}}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=g) for _ in range(n)]


def _loss(engine, x: torch.Tensor) -> torch.Tensor:
    if engine.cfg.engine.dtype == "bf16":
        x = x.to(torch.bfloat16)
    return engine(x).float().square().mean()


def _train(engine, xs) -> list[float]:
    losses = []
    for x in xs:
        loss = _loss(engine, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine) -> dict:
    """The whole tensor state, copied: weights and each partition's optimizer state."""
    return {"weights": {k: v.clone() for k, v in engine.state_dict().items()},
            "optim": {g.gid: {k: v.clone()
                              for k, v in engine.optimizer.partition_state(g.gid).items()}
                      for g in engine.groups if g.requires_grad}}


def _assert_identical(a: dict, b: dict, where: str = "") -> None:
    assert set(a) == set(b), where
    for k in a:
        if isinstance(a[k], dict):
            _assert_identical(a[k], b[k], f"{where}/{k}")
        else:
            assert torch.equal(a[k], b[k]), f"{where}/{k}"


def _done(handle) -> Path:
    assert handle._done.wait(WAIT), "the background save hung"
    return handle.wait()


@pytest.fixture
def slow_save(monkeypatch):
    """slow(seconds): each chunk the save starts waits that long first (a slow disk)."""
    start = ChunkFiles._start_chunk

    def slow(seconds: float) -> None:
        def slowed(self, *args):
            time.sleep(seconds)
            return start(self, *args)
        monkeypatch.setattr(ChunkFiles, "_start_chunk", slowed)
    return slow


def _resumed(tmp_path: Path, ck: Path, placement: tuple) -> dict:
    cfg = _cfg(tmp_path / f"resume-{ck.name}", *placement)
    with offload.initialize(_model, cfg, resume=ck) as r:
        return _state(r)


def _saves_while_training(tmp_path, slow_save, placement, delays):
    """One background save before each step, each slowed by its delay (0: the save
    races the forward, the backward and the early updates from their start); every
    checkpoint resumes to the state taken at its call, and the run ends as one that
    never saved."""
    xs = _batches(len(delays) + 2)
    cfg = _cfg(tmp_path / "a", *placement)
    taken, handles = [], []
    with offload.initialize(_model(), cfg) as a:
        got = _train(a, xs[:2])
        for i, delay in enumerate(delays):
            slow_save(delay)
            taken.append(_state(a))
            handles.append(a.save_checkpoint(tmp_path / f"ck{i}", blocking=False))
            got += _train(a, xs[2 + i:3 + i])
        _done(handles[-1])
        end = _state(a)
    with offload.initialize(_model(), _cfg(tmp_path / "b", *placement)) as b:
        want = _train(b, xs)
        _assert_identical(end, _state(b), "end")
    assert got == want
    assert any(h.stalled > 0 for h in handles)  # a save outlasted a forward and backward
    for i, h in enumerate(handles):
        _assert_identical(_resumed(tmp_path, _done(h), placement), taken[i], f"ck{i}")


# (params, grads, optimizer, dtype, host budget, device budget): at or near the
# minimum working set, so every step moves partitions between the tiers
TIGHT = [("nvme", "nvme", "nvme", "fp32", "64KiB", "24KiB"),
         ("host", "nvme", "nvme", "bf16", "40KiB", "24KiB"),
         ("device", "host", "nvme", "fp32", "64KiB", "48KiB")]
MORE = [("nvme", "host", "host", "fp32", "100KiB", "24KiB"),
        ("nvme", "nvme", "host", "bf16", "64KiB", "24KiB"),
        ("host", "host", "host", "fp32", "100KiB", "24KiB"),
        ("device", "nvme", "nvme", "bf16", "64KiB", "48KiB"),
        ("nvme", "host", "nvme", "bf16", "40KiB", "48KiB"),
        ("nvme", "nvme", "nvme", "bf16", "40KiB", "24KiB")]


@pytest.mark.parametrize("placement", TIGHT, ids=lambda p: "-".join(p))
def test_background_saves_hold_the_state_of_their_call_under_tight_budgets(
        tmp_path, slow_save, placement):
    _saves_while_training(tmp_path, slow_save, placement, delays=[0.0, 0.01])


@pytest.mark.slow
@pytest.mark.parametrize("placement", TIGHT + MORE, ids=lambda p: "-".join(p))
def test_many_background_saves_hold_their_state_in_every_placement(tmp_path, slow_save,
                                                                   placement):
    _saves_while_training(tmp_path, slow_save, placement,
                          delays=[0.0, 0.0005, 0.001, 0.002, 0.004, 0.0])


PLACE = ("nvme", "nvme", "nvme", "fp32", "64KiB", "24KiB")


def test_a_second_save_while_one_is_in_flight_waits_and_both_hold_their_state(
        tmp_path, slow_save):
    """Two saves at one point (nothing trained between them), then one after a step
    whose forward and backward overlap the second: each holds its call's state."""
    xs = _batches(4)
    slow_save(0.01)
    with offload.initialize(_model(), _cfg(tmp_path / "a", *PLACE)) as a:
        _train(a, xs[:2])
        first = _state(a)
        h1 = a.save_checkpoint(tmp_path / "ck1", blocking=False)
        assert not h1.done()
        h2 = a.save_checkpoint(tmp_path / "ck2", blocking=False)
        assert h1.done()  # the second waited for the first
        _train(a, xs[2:3])
        second = _state(a)
        h3 = a.save_checkpoint(tmp_path / "ck3", blocking=False)
        _train(a, xs[3:])
        end = _state(a)
    for h, want in ((h1, first), (h2, first), (h3, second)):
        _assert_identical(_resumed(tmp_path, _done(h), PLACE), want, h.path.name)
    with offload.initialize(_model(), _cfg(tmp_path / "b", *PLACE)) as b:
        _train(b, xs)
        _assert_identical(end, _state(b))


def test_the_optimizer_s_load_waits_for_a_save_in_flight(tmp_path, slow_save):
    """engine.optimizer.load_state_dict() right after a background save: the save holds
    the state of its call, and the load happens after it. Before, the load ran beside
    the save, whose checkpoint mixed the two states (it passed its integrity check and
    failed to resume, or resumed with the loaded moments)."""
    xs = _batches(3)
    slow_save(0.01)
    with offload.initialize(_model(), _cfg(tmp_path / "a", *PLACE)) as a:
        _train(a, xs[:1])
        earlier = a.optimizer.state_dict()
        _train(a, xs[1:])
        at_call = _state(a)
        h = a.save_checkpoint(tmp_path / "ck", blocking=False)
        assert not h.done()
        a.optimizer.load_state_dict(earlier)
        assert h.done()
        loaded = _state(a)["optim"]
    _assert_identical(_resumed(tmp_path, _done(h), PLACE), at_call)
    assert not all(torch.equal(loaded[g]["exp_avg"], at_call["optim"][g]["exp_avg"])
                   for g in loaded)  # the load happened


def test_close_while_a_save_is_in_flight_publishes_it_first(tmp_path, slow_save):
    xs = _batches(2)
    slow_save(0.01)
    a = offload.initialize(_model(), _cfg(tmp_path / "a", *PLACE))
    _train(a, xs)
    want = _state(a)
    h = a.save_checkpoint(tmp_path / "ck", blocking=False)
    assert not h.done()
    a.close()
    assert h.done() and h.stalled > 0
    _assert_identical(_resumed(tmp_path, _done(h), PLACE), want)
    assert not list((tmp_path / "a").iterdir())  # the swap files are gone


def test_an_interrupted_wait_leaves_the_save_for_close_to_wait_for(tmp_path, slow_save):
    """Ctrl-C while waiting for a save (`wait_for_checkpoint`) stops the wait, not the
    save: close() still waits for it, so the save never reads a closed store or
    optimizer, and it is published whole."""
    xs = _batches(2)
    slow_save(0.02)
    a = offload.initialize(_model(), _cfg(tmp_path / "a", *PLACE))
    try:
        _train(a, xs)
        want = _state(a)
        h = a.save_checkpoint(tmp_path / "ck", blocking=False)
        timer = threading.Timer(0.05, signal.pthread_kill,
                                (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            a.wait_for_checkpoint()
        timer.join()
        assert not h.done()
    finally:
        a.close()
    assert h.done()
    _assert_identical(_resumed(tmp_path, _done(h), PLACE), want)


class _Failing(nn.Sequential):
    """Raises in the forward of layer 5 while `fail` is set (after the forwards of
    the layers before it moved their partitions)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(*[nn.Linear(64, 64) for _ in range(8)])
        self.fail = False

    def forward(self, x):
        for i, layer in enumerate(self):
            if i == 5 and self.fail:
                raise RuntimeError("a failing forward")
            x = layer(x)
        return x


@pytest.mark.parametrize("where", ["forward", "after backward"])
def test_a_step_abandoned_while_a_save_is_in_flight_changes_neither(tmp_path, slow_save,
                                                                    where):
    """A forward that fails, or a backward whose early updates ran (staged parameters,
    new optimizer extents) then dropped by `zero_grad`, while the save reads: the
    checkpoint holds the state of its call and training goes on as if the abandoned
    micro-batch never was."""
    xs = _batches(4)
    slow_save(0.005)
    with offload.initialize(_Failing(), _cfg(tmp_path / "a", *PLACE)) as a:
        _train(a, xs[:2])
        want = _state(a)
        h = a.save_checkpoint(tmp_path / "ck", blocking=False)
        if where == "forward":
            a.module.fail = True
            with pytest.raises(RuntimeError, match="a failing forward"):
                a(xs[2])
            a.module.fail = False
        else:
            a.backward(_loss(a, xs[2]))
        a.zero_grad()
        _train(a, xs[2:])
        assert h.done()
        end = _state(a)
    with offload.initialize(_Failing(), _cfg(tmp_path / "b", *PLACE)) as b:
        _train(b, xs)
        _assert_identical(end, _state(b))
    cfg = _cfg(tmp_path / "c", *PLACE)
    with offload.initialize(_Failing, cfg, resume=_done(h)) as r:
        _assert_identical(_state(r), want)


def _save_onto_a_filling_disk(tmp_path, small_fs, free_blocks: list[int]):
    """A background save onto a disk with `free` blocks left, for each amount: it is
    published whole or fails on its handle (ENOSPC, its partial directory gone);
    training goes on identically either way. The state is on NVMe (swap files on
    another disk) with tight budgets."""
    disk = Path(small_fs(8))
    xs = _batches(2 + len(free_blocks))
    outcomes = set()
    with offload.initialize(_model(), _cfg(tmp_path / "a", *PLACE)) as a:
        _train(a, xs[:2])
        for i, free in enumerate(free_blocks):
            fill(disk, free)
            want = _state(a)
            ck = disk / "ck" / f"s{i}"
            h = a.save_checkpoint(ck, blocking=False)
            _train(a, xs[2 + i:3 + i])
            assert h._done.wait(WAIT), "the background save hung"
            try:
                h.wait()
            except offload.CheckpointError as e:  # the disk filled: it says so, and the fix
                assert e.__cause__ is not None, e
                assert f"writing {ck} failed" in str(e) and "free disk space" in str(e), e
                assert not ck.exists()
                outcomes.add("failed")
            else:
                outcomes.add("saved")
                (disk / "fill").unlink(missing_ok=True)
                _assert_identical(_resumed(tmp_path, ck, PLACE), want, ck.name)
                shutil.rmtree(ck)
            assert not [p for p in ck.parent.glob(".*") if p.name != ".lost+found"]
        end = _state(a)
    with offload.initialize(_model(), _cfg(tmp_path / "b", *PLACE)) as b:
        _train(b, xs)
        _assert_identical(end, _state(b))
    return outcomes


def test_a_background_save_that_fills_the_disk_fails_alone(tmp_path, small_fs):
    assert _save_onto_a_filling_disk(tmp_path, small_fs, [40, 100000]) == {"failed", "saved"}


@pytest.mark.slow
def test_background_saves_onto_a_disk_filled_to_every_amount(tmp_path, small_fs):
    assert _save_onto_a_filling_disk(tmp_path, small_fs, list(range(0, 140, 7)) + [100000]
                                     ) == {"failed", "saved"}
