"""[Note: new weights all or nothing]: `load_state_dict` and a writable `full_weights`
block write every group's new weights or none. A corrupted chunk of a later group's
optimizer state fails them half way: before, the groups before it kept the new
weights and those after it the old."""

import contextlib

import pytest
import torch
from torch import nn

import offload
from offload.io import CorruptionError

from ..conftest import flip_byte
from .ranks import gloo_group, spawn
from .test_failed_step import assert_same, snapshot


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # a group each


def _engine(engine_cfg, params):
    cfg = engine_cfg(params, "host", "nvme", dtype="bf16", group_size=5000)
    engine = offload.initialize(_model(), cfg)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    assert engine.step()
    return engine


def _corrupt_last_group(engine):
    """Flips a byte of the last group's optimizer state on NVMe (flip again to undo)."""
    opt = engine.optimizer
    part = opt.partition(len(engine.groups) - 1)
    assert len(engine.groups) == 4 and part.extents
    return opt._pipeline.swap.paths[0], part.extents[0].offset + 8


@pytest.mark.parametrize("params", ["nvme", "host"])
def test_load_state_dict_that_fails_half_way_changes_nothing(engine_cfg, params):
    engine = _engine(engine_cfg, params)
    try:
        before, weights = snapshot(engine), engine.state_dict()
        swap = engine.optimizer._pipeline.swap
        used = swap.used_bytes
        new = {k: torch.full_like(v, 0.5) for k, v in weights.items()}
        path, where = _corrupt_last_group(engine)
        flip_byte(path, where)
        with pytest.raises(Exception) as err:
            engine.load_state_dict(new)
        assert isinstance(err.value, CorruptionError) or isinstance(
            err.value.__cause__, CorruptionError), err.value
        flip_byte(path, where)
        assert_same(snapshot(engine), before)
        assert swap.used_bytes == used  # the staged masters' extents are freed
        engine.load_state_dict(new)  # the cause removed: every group loads
        for k, v in engine.state_dict().items():
            assert torch.equal(v, new[k]), k
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        ref = _model()
        ref.load_state_dict(new)
        with torch.no_grad():  # the forward computes with what was loaded
            torch.testing.assert_close(engine(x), ref.to(torch.bfloat16)(x), rtol=1e-2,
                                       atol=0)
        engine.backward(engine(x).float().square().mean())
        assert engine.step()
    finally:
        engine.close()


def test_a_writable_block_whose_write_back_fails_changes_nothing(engine_cfg):
    engine = _engine(engine_cfg, "nvme")
    try:
        before = snapshot(engine)
        path, where = _corrupt_last_group(engine)
        with pytest.raises(Exception):
            with engine.full_weights(writable=True) as w:
                flip_byte(path, where)  # read: the write-back meets it
                for t in w.values():
                    t.data.fill_(0.25)
        flip_byte(path, where)
        assert_same(snapshot(engine), before)
    finally:
        engine.close()


def test_host_masters_are_put_back_when_a_later_write_fails(engine_cfg, failing_disk):
    """Parameters on NVMe, optimizer state in host memory: each group's master is
    written in place as it goes, the old one kept; the disk dying under the staged
    parameters puts every master back."""
    mnt, fail = failing_disk
    cfg = engine_cfg("nvme", "host", "host", dtype="bf16", group_size=5000)
    cfg["io"]["paths"] = [mnt]
    cfg["store"].update(host_budget="48KiB", device_budget="48KiB")  # the least it takes
    engine = offload.initialize(_model(), cfg)
    try:
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        assert engine.step()
        opt = engine.optimizer
        masters = [opt.partition_state(g.gid)["master"].clone() for g in engine.groups]
        new = {k: torch.full_like(v, 0.5) for k, v in engine.state_dict().items()}
        fail()
        with pytest.raises(Exception, match="Input/output error"):
            engine.load_state_dict(new)
        for g, m in zip(engine.groups, masters):
            assert torch.equal(opt.partition_state(g.gid)["master"], m), g.gid
    finally:
        with contextlib.suppress(OSError):  # its swap file is on the dead disk
            engine.close()


def _two_ranks(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    """[Note: a read that fails on one rank]: rank 1's last group is corrupted, first
    under a load (its read fails), then inside a writable block (its write-back
    fails after the last collective); both ranks raise and keep their shards."""
    with gloo_group(rank, world, init_file):
        engine = offload.initialize(_model(), cfg)
        torch.manual_seed(1)
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        assert engine.step()
        before = snapshot(engine)
        new = {k: torch.full_like(v, 0.5)
               for k, v in engine.state_dict(rank0_only=False).items()}
        path, where = _corrupt_last_group(engine)
        res = {}

        def edit() -> None:
            with engine.full_weights(writable=True) as w:
                if rank == 1:
                    flip_byte(path, where)  # read: the write-back meets it
                for t in w.values():
                    t.data.fill_(0.25)
        for what, call, corrupt in (("load", lambda: engine.load_state_dict(new), True),
                                    ("block", edit, False)):
            if rank == 1 and corrupt:
                flip_byte(path, where)
            try:
                call()
                res[what] = "done"
            except Exception as e:
                res[what] = f"{type(e).__name__}: {e}"
            if rank == 1:
                flip_byte(path, where)
            now = snapshot(engine)
            res[what + "_kept"] = all(not isinstance(v, torch.Tensor) and v == now[k]
                                      or torch.equal(v, now[k]) for k, v in before.items())
        engine.load_state_dict(new)  # the cause removed: every group loads on both
        res["loaded"] = all(torch.equal(v, new[k])
                            for k, v in engine.state_dict(rank0_only=False).items())
        engine.backward(engine(x).float().square().mean())
        res["stepped"] = engine.step()
        res["after"] = engine.state_dict(rank0_only=False)
        engine.close()
        torch.save(res, f"{out}.{rank}")


@pytest.mark.distributed
def test_a_load_that_fails_on_one_rank_changes_nothing_on_any(tmp_path, engine_cfg):
    """Before: rank 1's failed read left rank 0 in that group's all-gather, and its
    failed write-back (after the last collective) left rank 0 with the new weights
    and itself with the old, with no error on rank 0."""
    cfg = engine_cfg("host", "host", "nvme", dtype="bf16", group_size=5000)
    out = str(tmp_path / "res")
    spawn(_two_ranks, str(tmp_path / "init"), out, cfg, timeout_s=120)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert r1["load"].startswith("CorruptionError"), r1["load"]
    assert r0["load"].startswith("RankFailedError: reading group 3's full weights: 1 other "
                                 "rank(s) of 2 failed"), r0["load"]
    assert "CorruptionError" in r1["block"], r1["block"]
    assert r0["block"].startswith("RankFailedError: full_weights(writable=True)'s "
                                  "write-back: 1 other rank(s)"), r0["block"]
    for r in (r0, r1):
        assert r["load_kept"] and r["block_kept"] and r["loaded"] and r["stepped"]
    for k, v in r0["after"].items():  # trained on together
        assert torch.equal(v, r1["after"][k]), k
