"""The engine against plain PyTorch: same init, same data, torch.optim.AdamW."""

import copy

import pytest
import torch
from torch import nn

import offload

from .models import Branchy, TiedTwice, lm_batches, lm_loss


def _reference(model, batches, steps, lr=1e-2, wd=0.1, clip=0.0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for x, y in batches[:steps]:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _train(engine, batches, steps):
    losses = []
    for x, y in batches[:steps]:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _compare(engine, ref, atol):
    sd = engine.state_dict()
    want = ref.state_dict()
    assert set(sd) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(sd[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("params,grads,optimizer", [
    ("device", "host", "host"), ("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_fp32_matches_adamw(engine_cfg, params, grads, optimizer):
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(6)
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer))
    try:
        got = _train(engine, batches, 6)
        want = _reference(ref, batches, 6)
        assert got == pytest.approx(want, abs=1e-5)
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_bf16_within_tolerance(engine_cfg):
    """bf16 compute with fp32 masters, against fp32 training. Stated tolerance: losses
    within 2% relative; weights within 5 Adam steps of lr (a bf16 gradient whose sign
    differs moves a weight by up to 2 lr) at worst, and 2e-3 on average."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(6)
    engine = offload.initialize(model, engine_cfg("nvme", "host", "nvme", dtype="bf16"))
    try:
        got = _train(engine, batches, 6)
        want = _reference(ref, batches, 6)
        assert got == pytest.approx(want, rel=2e-2)
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            diff = (sd[k] - v).abs()
            assert diff.max() < 5e-2 and diff.mean() < 2e-3, (k, diff.max(), diff.mean())
    finally:
        engine.close()


def test_clipping_and_accumulation(engine_cfg):
    torch.manual_seed(1)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    cfg = engine_cfg("host", grad_accum_steps=2)
    cfg["optim"]["max_grad_norm"] = 0.5
    engine = offload.initialize(model, cfg)
    batches = lm_batches(8, seed=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        for i in range(0, 8, 2):
            for x, y in batches[i:i + 2]:
                engine.backward(lm_loss(engine(x), y) / 2)
                (lm_loss(ref(x), y) / 2).backward()
            assert engine.step() is True
            nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_dynamic_control_flow_falls_back_and_rerecords(engine_cfg):
    torch.manual_seed(2)
    ref = Branchy()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, engine_cfg("nvme", group_size=1200))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    routes = [[0, 1, 2], [0, 1, 2], [3, 1], [2, 0, 3, 1], [0, 1, 2], [1]]
    g = torch.Generator().manual_seed(0)
    try:
        for route in routes:
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)
            loss = nn.functional.mse_loss(engine(x, route), y)
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            nn.functional.mse_loss(ref(x, route), y).backward()
            opt.step()
        assert engine.trace.rerecords >= 3  # each change of route re-recorded the trace
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_meta_built_model_trains(engine_cfg):
    """Built on meta: materialised group by group with each module's own init."""
    cfg = engine_cfg("nvme", optimizer="nvme")
    engine = offload.initialize(lambda: TiedTwice(), cfg)
    try:
        sd = engine.state_dict()
        assert all(torch.isfinite(v).all() for v in sd.values())
        assert sd["head.weight"] is sd["emb.weight"] or torch.equal(sd["head.weight"],
                                                                    sd["emb.weight"])
        assert sd["l1.weight"].std() > 0 and torch.equal(sd["scale"], torch.ones(32))
        # the same seed makes the same weights
        other = engine_cfg("host")
        other["io"]["paths"] = [cfg["io"]["paths"][0] + "-2"]  # a live job's swap is locked
        again = offload.initialize(lambda: TiedTwice(), other)
        torch.testing.assert_close(again.state_dict()["l1.weight"], sd["l1.weight"])
        again.close()
        batches = lm_batches(1, seed=5) * 25
        losses = _train(engine, batches, 25)
        assert losses[-1] < losses[0] * 0.7
    finally:
        engine.close()


def test_fp16_dynamic_loss_scale_skips_overflow(engine_cfg):
    torch.manual_seed(3)
    model = TiedTwice()
    engine = offload.initialize(model, engine_cfg("host", dtype="fp16", initial_loss_scale=2.0 ** 30))
    try:
        x, y = lm_batches(1)[0]
        before = engine.state_dict()
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is False            # 2^30 overflows fp16 gradients
        assert engine.loss_scale == 2.0 ** 29
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        for _ in range(20):
            engine.backward(lm_loss(engine(x), y))
            if engine.step():
                break
        assert engine.global_step == 1 and engine.loss_scale < 2.0 ** 29
    finally:
        engine.close()
