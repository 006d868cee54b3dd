"""A checkpoint is checked against the model on load; a mismatch names the tensor."""

import json

import pytest
import torch
from torch import nn

import offload
from offload.engine.training_checkpoint import RECORD, _read_json, _write_json

from .models import TiedTwice, lm_batches, lm_loss


@pytest.fixture
def saved(tmp_path, engine_cfg):
    def save(dtype="fp32", model=TiedTwice, steps=1, **engine):
        cfg = engine_cfg("host", "host", "host", dtype=dtype, **engine)
        cfg["io"]["paths"] = [str(tmp_path / "swap-a")]
        ck = tmp_path / "ck"
        torch.manual_seed(0)
        with offload.initialize(model(), cfg) as e:
            for x, y in lm_batches(steps):
                e.backward(lm_loss(e(x), y))
                e.step()
            e.save_checkpoint(ck)
            state = {"loss_scale": e.loss_scale, "good": e._good_steps, "step": e.global_step}
        cfg["io"]["paths"] = [str(tmp_path / "swap-b")]
        return ck, cfg, state
    return save


def test_other_shapes_with_the_same_padded_size_are_refused(saved):
    ck, cfg, _ = saved()
    # hidden 47 instead of 48: every group pads to the same size, the shapes differ
    with pytest.raises(offload.CheckpointError,
                       match=r"tensor 'l1.weight' has shape \(48, 32\), the model's "
                             r"'l1.weight' \(47, 32\)"):
        offload.initialize(lambda: TiedTwice(hidden=47), cfg, resume=ck)


def test_missing_and_extra_tensors_are_named(saved):
    ck, cfg, _ = saved()

    class More(TiedTwice):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(4, 4)

    with pytest.raises(offload.CheckpointError, match="has no tensor 'extra.weight'"):
        offload.initialize(More, cfg, resume=ck)

    class Less(TiedTwice):
        def __init__(self):
            super().__init__()
            del self.scale

        def forward(self, x):
            return self.head(self.norm(self.emb(x)))

    with pytest.raises(offload.CheckpointError, match=r"tensors \['scale'\] are not in the model"):
        offload.initialize(Less, cfg, resume=ck)


def test_dtype_and_frozen_mismatch_are_named(saved):
    ck, cfg, _ = saved()
    bf16 = {**cfg, "engine": {**cfg["engine"], "dtype": "bf16"}}
    with pytest.raises(offload.CheckpointError,
                       match=r"tensor '\S+' was saved in float32, this engine computes in "
                             r"bfloat16; resume with engine.dtype='fp32'"):
        offload.initialize(TiedTwice, bf16, resume=ck)

    def frozen_norm():
        m = TiedTwice()
        m.norm.requires_grad_(False)
        return m
    with pytest.raises(offload.CheckpointError,
                       match="tensor 'norm.weight' was saved trainable, the model's "
                             "'norm.weight' is frozen"):
        offload.initialize(frozen_norm, cfg, resume=ck)


def test_ranks_must_cover_every_group(saved):
    ck, cfg, _ = saved()
    rec = _read_json(ck / RECORD)
    rec["world"] = 2  # claims two writers, holds the ranges of one
    _write_json(ck / RECORD, rec)
    with pytest.raises(offload.CheckpointError, match=r"written by 2 ranks but holds the "
                                                      r"records of ranks \[0\]"):
        offload.initialize(TiedTwice, cfg, resume=ck)


def test_fp16_loss_scale_is_restored(saved):
    ck, cfg, state = saved(dtype="fp16", steps=5, loss_scale_window=2, initial_loss_scale=256.0)
    assert state["loss_scale"] != 256.0  # the scale moved during the 5 steps
    with offload.initialize(TiedTwice, cfg, resume=ck) as e:
        assert (e.loss_scale, e._good_steps, e.global_step) == (
            state["loss_scale"], state["good"], state["step"])
    assert json.loads((ck / RECORD).read_text())["loss_scale"] == state["loss_scale"]
