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
