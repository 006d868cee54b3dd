"""bf16/fp16 training against what torch does: bf16/fp16 parameters for forward and
backward, fp32 master weights and torch.optim.AdamW, and for fp16 dynamic loss scaling
as torch.amp.GradScaler does it (scale the loss; unscale the fp32 gradients; skip the
step on inf/NaN and halve the scale; double it after `window` good steps)."""

import copy
import logging

import pytest
import torch
from torch import nn

import offload

from .models import TiedTwice, lm_batches, lm_loss


class MixedPrecisionReference:
    """Plain torch: the model in `dtype`, fp32 masters with AdamW, gradients summed in
    fp32 over micro-batches (GradScaler's gradients are fp32 under autocast), and
    GradScaler's update rule for fp16 (`fixed`: the scale never moves)."""

    def __init__(self, model, dtype, *, scale=65536.0, window=1000, fixed=False, clip=0.0,
                 accum=1, lr=1e-2, wd=0.1):
        self.model = model
        self.masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
        model.to(dtype)
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=wd)
        self.fp16 = dtype == torch.float16
        self.scale = scale if self.fp16 else 1.0
        self.window, self.fixed, self.clip, self.accum = window, fixed, clip, accum
        self.good, self.micro, self.sums, self.norm = 0, 0, None, None

    def backward(self, loss):
        (loss * self.scale).backward()
        self.micro += 1
        grads = [p.grad.float() for p in self.model.parameters()]
        self.sums = grads if self.sums is None else [a + b for a, b in zip(self.sums, grads)]
        self.model.zero_grad(set_to_none=True)

    def step(self) -> bool:
        if self.micro % self.accum:
            return False
        for m, g in zip(self.masters, self.sums):
            m.grad = g / (self.scale * self.accum)  # GradScaler.unscale_, then the mean
        self.sums = None
        found_inf = not all(torch.isfinite(m.grad).all() for m in self.masters)
        if self.fp16 and found_inf:
            if not self.fixed:
                self.scale, self.good = max(self.scale / 2, 1.0), 0
            return False
        norm = nn.utils.clip_grad_norm_(self.masters, self.clip if self.clip else float("inf"))
        self.norm = norm.item()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)
        if self.fp16 and not self.fixed:
            self.good += 1
            if self.good == self.window:
                self.scale, self.good = self.scale * 2, 0
        return True

    def weights(self):
        return {n: m.detach() for (n, _), m in zip(self.model.named_parameters(), self.masters)}


def _assert_weights(engine, ref, atol=1e-6):
    sd = engine.state_dict()
    for k, v in ref.weights().items():
        torch.testing.assert_close(sd[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("placement", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.5, 2)])
def test_fp16_dynamic_scaling_follows_gradscaler(engine_cfg, placement, clip, accum):
    """A first scale of 2^17 overflows for three steps, a window of 2 grows it back, and
    it overflows again: the same steps skipped, the same scales, the same unscaled
    gradient norm (before clipping) and the same weights as torch."""
    torch.manual_seed(0)
    model = TiedTwice()
    ref = MixedPrecisionReference(copy.deepcopy(model), torch.float16, scale=2.0 ** 17,
                                  window=2, clip=clip, accum=accum)
    cfg = engine_cfg(*placement, dtype="fp16", initial_loss_scale=2.0 ** 17,
                     loss_scale_window=2, grad_accum_steps=accum)
    cfg["optim"]["max_grad_norm"] = clip
    engine = offload.initialize(model, cfg)
    try:
        got, want = [], []
        for i, (x, y) in enumerate(lm_batches(8 * accum, seed=1)):
            engine.backward(lm_loss(engine(x), y))
            ref.backward(lm_loss(ref.model(x), y))
            done, ref_done = engine.step(), ref.step()
            if (i + 1) % accum == 0:
                got.append((done, engine.loss_scale))
                want.append((ref_done, ref.scale))
                if done:
                    assert engine.grad_norm == pytest.approx(ref.norm, rel=1e-5)
        assert got == want
        assert [d for d, _ in got].count(False) >= 3
        _assert_weights(engine, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("scaling", [{"loss_scale": 1.0}, {"initial_loss_scale": 1.0}])
def test_fp16_overflow_at_loss_scale_one_is_skipped_with_nvme_optimizer(engine_cfg, scaling):
    """fp16 whose loss scale is 1 (fixed at 1, or dynamic scaling down at its floor
    engine.min_loss_scale = 1) with optimizer state on NVMe. Before the fix
    `_early_allowed` read `loss_scale == 1` as "no fp16", so each group was updated
    during backward: the overflow check then saw no gradient, `step()` returned True
    with `grad_norm` 0.0, and every weight became NaN. torch (GradScaler at any scale)
    skips the step."""
    torch.manual_seed(0)
    model = TiedTwice()
    engine = offload.initialize(model, engine_cfg("nvme", "host", "nvme", dtype="fp16",
                                                  **scaling))
    try:
        before = engine.state_dict()
        x, y = lm_batches(1)[0]
        engine.backward(lm_loss(engine(x), y) * 1e6)  # fp16 gradients overflow
        assert engine.step() is False
        assert engine.global_step == 0 and engine.grad_norm is None
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.backward(lm_loss(engine(x), y))  # a finite step still commits, with its norm
        assert engine.step() is True and engine.grad_norm > 0
    finally:
        engine.close()


def test_resume_keeps_the_configured_fixed_loss_scale(engine_cfg, tmp_path):
    """A checkpoint of a dynamic-scaling run resumed with a fixed `engine.loss_scale`:
    the config's scale is used (before the fix the checkpoint's dynamic scale, 16384
    here, silently replaced the configured 1024 for the rest of the run)."""
    torch.manual_seed(0)
    batches = lm_batches(3, seed=1)
    engine = offload.initialize(TiedTwice(), engine_cfg("host", dtype="fp16",
                                                        initial_loss_scale=2.0 ** 17))
    try:
        for x, y in batches:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        assert engine.loss_scale == 16384.0  # three overflows from 2^17
        engine.save_checkpoint(tmp_path / "ck")
    finally:
        engine.close()
    cfg = engine_cfg("host", dtype="fp16", loss_scale=1024.0)
    cfg["io"]["paths"] = [str(tmp_path / "swap2")]
    resumed = offload.initialize(TiedTwice(), cfg, resume=tmp_path / "ck")
    try:
        assert resumed.loss_scale == 1024.0
        x, y = batches[0]
        resumed.backward(lm_loss(resumed(x), y))
        assert resumed.step() is True and resumed.loss_scale == 1024.0
    finally:
        resumed.close()
    # dynamic again, with a floor above the saved scale: the floor holds from the start
    # (the first overflow's max(floor, scale / 2) raised the scale 2x before)
    cfg = engine_cfg("host", dtype="fp16", min_loss_scale=2.0 ** 15)
    cfg["io"]["paths"] = [str(tmp_path / "swap3")]
    with offload.initialize(TiedTwice(), cfg, resume=tmp_path / "ck") as resumed:
        assert resumed.loss_scale == 2.0 ** 15


def test_loss_scaling_keys_outside_fp16_are_said_to_be_unused(engine_cfg, caplog):
    """engine.loss_scale (and dynamic scaling's keys) apply to fp16 only: with bf16 a
    set one was ignored without a word."""
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.initialize(TiedTwice(), engine_cfg("host", dtype="bf16")).close()
        assert "loss scaling" not in caplog.text
        offload.initialize(TiedTwice(), engine_cfg("host", dtype="bf16",
                                                   loss_scale=1024.0)).close()
    assert "engine.loss_scale: loss scaling is for engine.dtype 'fp16'" in caplog.text


def test_fixed_loss_scale_overflow_is_not_silent(engine_cfg, caplog):
    """A fixed engine.loss_scale that overflows skips every step; before, nothing was
    logged (dynamic scaling logs at INFO and moves on), so a run could make no
    progress without a word."""
    torch.manual_seed(0)
    engine = offload.initialize(TiedTwice(), engine_cfg("host", dtype="fp16",
                                                        loss_scale=2.0 ** 20))
    try:
        x, y = lm_batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert engine.step() is False
        assert engine.loss_scale == 2.0 ** 20
        assert any("engine.loss_scale" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


@pytest.mark.parametrize("placement", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_bf16_matches_bf16_torch_with_fp32_masters(engine_cfg, placement):
    """bf16 against torch in bf16 with fp32 masters (not fp32 training, as
    test_parity's tolerance test): equal to fp32 rounding, losses bit for bit."""
    torch.manual_seed(0)
    model = TiedTwice()
    ref = MixedPrecisionReference(copy.deepcopy(model), torch.bfloat16)
    engine = offload.initialize(model, engine_cfg(*placement, dtype="bf16"))
    try:
        for x, y in lm_batches(6, seed=1):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            want = lm_loss(ref.model(x), y)
            ref.backward(want)
            assert engine.step() and ref.step()
            assert loss.item() == want.item()
        _assert_weights(engine, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_batchnorm_with_running_stats_under_half_compute_is_refused_naming_it(tmp_path, dtype):
    """torch's batch_norm refuses bf16/fp16 weights with the fp32 running statistics the
    engine keeps (buffers keep their dtype): the first forward raised torch's
    "expected scalar type BFloat16 but found Float". initialize refuses it, naming the
    module and the fix, before anything is made; a BatchNorm without running
    statistics trains."""
    cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "host", "dtype": dtype},
           "io": {"paths": [str(tmp_path / "swap")]},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with pytest.raises(offload.ConfigError, match=r"1 is a BatchNorm1d .*engine\.dtype 'fp32'"):
        offload.initialize(model, cfg)
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())
    model[1] = nn.BatchNorm1d(4, track_running_stats=False)
    with offload.initialize(model, cfg) as engine:
        x = torch.randn(8, 4).to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype]))
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
