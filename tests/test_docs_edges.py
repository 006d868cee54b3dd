"""What the user documentation says happens, checked where a walk through it found
the code doing something else (README.md, docs/*.md)."""

import pytest
import torch
from torch import nn

import offload


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _config(tmp_path, **engine) -> dict:
    return {"engine": {"params": "nvme", "optimizer": "nvme", **engine},
            "io": {"paths": [str(tmp_path / "swap")]}}


def _train(engine, steps: int) -> None:
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()


def test_save_refuses_extra_with_keys_that_are_not_strings(tmp_path):
    """docs/checkpoints.md: "an `extra` whose keys are not all strings, is refused
    before anything is written" (JSON would turn 1 into "1", and `resumed_extra`
    would not be what was saved)."""
    with offload.initialize(_model(), _config(tmp_path)) as engine:
        _train(engine, 1)
        for extra in ({1: "a"}, {None: "a"}, {"data": {2: "b"}}, {"data": [{(1, 2): 3}]}):
            with pytest.raises(offload.CheckpointError, match="keys"):
                engine.save_checkpoint(tmp_path / "ckpt", extra=extra)
            assert not (tmp_path / "ckpt").exists()
        engine.save_checkpoint(tmp_path / "ckpt", extra={"batch": 3, "seen": {"a": [1, 2]}})
    with offload.initialize(_model, _config(tmp_path), resume=tmp_path / "ckpt") as engine:
        assert engine.resumed_extra == {"batch": 3, "seen": {"a": [1, 2]}}
