"""The update's numerics against torch.optim.AdamW / Adam, on the host tier."""

import logging
import math

import pytest
import torch

from offload.config import ConfigError, OptimConfig, load_config
from offload.optim import AdamHyper, AdamKernel, CpuAdam, resolve_scaling
from offload.optim import adam as adam_mod
from offload.optim.native import native_status

from .conftest import grads_for, random_numels

SHAPES = [(37, 5), (1000,), (3, 3, 3), (4099,), (1,), (128, 33)]


def _torch_params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _reference_step(opt, params, grads, loss_scale, max_norm):
    """What a torch loop does: grads arrive loss-scaled; unscale, clip, step."""
    for p, g in zip(params, grads):
        p.grad = g.view_as(p).clone()
        p.grad.mul_(1.0 / loss_scale)  # GradScaler.unscale_ multiplies by the inverse
    if max_norm:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def _ours(cfg, params, **kw):
    opt = CpuAdam(cfg, **kw)
    for k, p in enumerate(params):
        opt.add_partition(k, p.detach().clone().view(-1))
    return opt


@pytest.mark.parametrize("kernel", ["native", "fused", "foreach"])
@pytest.mark.parametrize("name", ["adamw", "adam"])
@pytest.mark.parametrize("loss_scale,max_norm", [(1.0, 0.0), (1024.0, 0.0), (1.0, 0.5),
                                                 (256.0, 1.0), (8.0, 1e6)])
def test_matches_torch_over_steps(kernel, name, loss_scale, max_norm):
    if kernel == "native" and not native_status()[0]:
        pytest.skip(native_status()[1])
    params = _torch_params(0)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    ref = cls(params, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05, foreach=False)
    cfg = OptimConfig(name=name, lr=3e-3, betas=[0.8, 0.95], eps=1e-7, weight_decay=0.05,
                      max_grad_norm=max_norm, kernel=kernel, block_elems=1024)
    opt = _ours(cfg, params)
    for step in range(4):
        grads = grads_for({k: p.numel() for k, p in enumerate(params)}, 100 + step, loss_scale)
        _reference_step(ref, params, [grads[k] for k in range(len(params))], loss_scale, max_norm)
        res = opt.step(grads, loss_scale=loss_scale)
        assert not res.skipped and res.updated == tuple(range(len(params)))
        if max_norm:
            assert res.grad_norm == pytest.approx(
                math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())) / loss_scale,
                rel=1e-5)
    for k, p in enumerate(params):
        st = opt.partition_state(k)
        torch.testing.assert_close(st["master"], p.detach().view(-1))
        torch.testing.assert_close(st["exp_avg"], ref.state[p]["exp_avg"].view(-1))
        torch.testing.assert_close(st["exp_avg_sq"], ref.state[p]["exp_avg_sq"].view(-1))
        assert float(st["step"]) == float(ref.state[p]["step"]) == 4


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_fused_kernel_is_bit_identical_to_torch_fused(name):
    params = _torch_params(1)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    ref = cls(params, lr=1e-2, weight_decay=0.1, fused=True)
    opt = _ours(OptimConfig(name=name, lr=1e-2, weight_decay=0.1, kernel="fused",
                            block_elems=1024), params)
    for step in range(3):
        grads = grads_for({k: p.numel() for k, p in enumerate(params)}, step)
        _reference_step(ref, params, [grads[k] for k in range(len(params))], 1.0, 0.0)
        opt.step(grads)
    for k, p in enumerate(params):
        assert torch.equal(opt.partition_state(k)["master"], p.detach().view(-1))


def test_param_groups_and_lr_lambda_match_torch_lambdalr():
    params = _torch_params(2)
    lam = lambda k: 0.5 ** k  # noqa: E731
    ref = torch.optim.AdamW([{"params": params[:3], "lr": 1e-2},
                             {"params": params[3:], "lr": 5e-3, "weight_decay": 0.0,
                              "betas": (0.5, 0.9)}], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, lam)
    opt = CpuAdam(OptimConfig(block_elems=1024),
                  param_groups=[{"lr": 1e-2}, {"lr": 5e-3, "weight_decay": 0.0,
                                               "betas": (0.5, 0.9)}], lr_lambda=lam)
    for k, p in enumerate(params):
        opt.add_partition(k, p.detach().clone().view(-1), group=0 if k < 3 else 1)
    for step in range(3):
        grads = grads_for({k: p.numel() for k, p in enumerate(params)}, 7 + step)
        _reference_step(ref, params, [grads[k] for k in range(len(params))], 1.0, 0.0)
        sched.step()
        opt.step(grads)
    for k, p in enumerate(params):
        torch.testing.assert_close(opt.partition_state(k)["master"], p.detach().view(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_dtype_output_equals_rounded_master(dtype):
    numels = {pid: n for pid, n in enumerate(random_numels(3, 4, 1024))}
    opt = CpuAdam(OptimConfig(block_elems=1024))
    for pid, n in numels.items():
        opt.add_partition(pid, torch.randn(n))
    for step in range(2):
        out = {pid: torch.full((n,), float("nan"), dtype=dtype) for pid, n in numels.items()}
        opt.step(grads_for(numels, step), params_out=out, loss_scale=2.0)
        for pid in numels:
            assert torch.equal(out[pid], opt.partition_state(pid)["master"].to(dtype))


def test_gradients_are_never_written():
    opt = CpuAdam(OptimConfig(max_grad_norm=0.1, block_elems=1024))
    opt.add_partition("a", torch.randn(5000))
    g = torch.randn(5000) * 100
    before = g.clone()
    opt.step({"a": g}, loss_scale=100.0)
    assert torch.equal(g, before)


def test_overflow_skips_the_step_and_keeps_state():
    opt = CpuAdam(OptimConfig(block_elems=1024))
    m = torch.randn(3000)
    opt.add_partition("a", m)
    before = m.clone()
    g = torch.randn(3000)
    g[1234] = float("inf")
    res = opt.step({"a": g}, loss_scale=65536.0)
    assert res.skipped and res.updated == () and torch.equal(m, before)
    assert opt.partition("a").step == 0
    res = opt.step({"a": torch.randn(3000)}, loss_scale=65536.0, found_inf=False)
    assert not res.skipped and opt.partition("a").step == 1


def test_early_update_equals_the_sequential_step():
    numels = {"a": 3000, "b": 5000, "c": 70}
    masters = {pid: torch.randn(n) for pid, n in numels.items()}
    seq = CpuAdam(OptimConfig(block_elems=1024))
    early = CpuAdam(OptimConfig(block_elems=1024))
    for pid, m in masters.items():
        seq.add_partition(pid, m.clone())
        early.add_partition(pid, m.clone())
    assert early.early_update_allowed() and not early.early_update_allowed(loss_scale=8.0)
    for step in range(2):
        grads = grads_for(numels, step)
        seq.step(grads)
        early.update({"b": grads["b"]})        # while backward still runs
        with pytest.raises(ValueError, match="already updated"):
            early.update({"b": grads["b"]})
        early.step({"a": grads["a"], "c": grads["c"]})
    early.update(grads_for(numels, 5))       # every partition early...
    assert early.step({}).updated == ()      # ...then the step has nothing left to do
    seq.step(grads_for(numels, 5))
    for pid in numels:
        assert torch.equal(seq.partition_state(pid)["master"], early.partition_state(pid)["master"])


def test_early_update_refused_where_results_would_change():
    opt = CpuAdam(OptimConfig(max_grad_norm=1.0, block_elems=1024))
    opt.add_partition("a", torch.randn(100))
    opt.add_partition("b", torch.randn(100))
    assert not opt.early_update_allowed()
    with pytest.raises(ValueError, match="grad_norm"):
        opt.update({"a": torch.randn(100)})
    res = opt.update({"a": torch.randn(100)}, grad_norm=3.0)  # the engine knew the norm
    assert res.clip_coef == pytest.approx(1.0 / 3.0, rel=1e-5)
    with pytest.raises(ValueError, match="no gradient"):
        opt.step({})
    with pytest.raises(ValueError, match="grad_norm"):  # not the whole step: needs the norm
        opt.step({"b": torch.randn(100)})
    opt.step({"b": torch.randn(100)}, grad_norm=3.0)
    loss = CpuAdam(OptimConfig(block_elems=1024))
    loss.add_partition("a", torch.randn(100))
    loss.add_partition("b", torch.randn(100))
    with pytest.raises(ValueError, match="found_inf"):
        loss.update({"a": torch.randn(100)}, loss_scale=4.0)


def test_scaling_folds_clip_into_one_divisor():
    g = [torch.full((4,), 3.0), torch.full((4,), 4.0)]  # norm 10 before the loss scale of 2
    sc = resolve_scaling(g, loss_scale=2.0, max_grad_norm=1.0)
    assert sc.grad_norm == pytest.approx(5.0) and sc.clip_coef == pytest.approx(1 / 5.0, rel=1e-5)
    assert sc.grad_scale == pytest.approx(2.0 * 5.0, rel=1e-5) and not sc.found_inf
    none = resolve_scaling(g, loss_scale=1.0, max_grad_norm=0.0)
    assert none.grad_norm is None and none.grad_scale == 1.0  # nothing read
    assert resolve_scaling([torch.tensor([math.nan])], loss_scale=2.0, max_grad_norm=0).found_inf


def test_fallback_when_the_fused_kernel_is_absent(monkeypatch, caplog):
    monkeypatch.setattr(adam_mod, "fused_status", lambda: (False, "torch.x has no CPU kernel"))
    with caplog.at_level(logging.WARNING, logger="offload.optim.adam"):
        k = AdamKernel("auto", block_elems=1024)
    assert k.impl == "foreach" and "falling back" in caplog.text and "no CPU kernel" in caplog.text
    with pytest.raises(RuntimeError, match="optim.kernel = 'fused'"):
        AdamKernel("fused")
    assert AdamKernel("foreach", block_elems=1000).impl == "foreach"


def test_kernel_checks_its_arguments():
    k = AdamKernel("auto", block_elems=1024)
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    p = torch.zeros(10)
    with pytest.raises(ValueError, match="grad has 9"):
        k.update(p, torch.zeros(9), torch.zeros(10), torch.zeros(10), step=1, hyper=h)
    with pytest.raises(ValueError, match="step 0"):
        k.update(p, p.clone(), p.clone(), p.clone(), step=0, hyper=h)


def test_bad_inputs_are_refused_before_anything_changes():
    opt = CpuAdam(OptimConfig(block_elems=1024))
    m = torch.randn(100)
    opt.add_partition("a", m)
    before = m.clone()
    with pytest.raises(ValueError, match="100"):
        opt.step({"a": torch.randn(99)})
    with pytest.raises(ValueError, match="float32"):
        opt.step({"a": torch.randn(100, dtype=torch.float64)})
    with pytest.raises(KeyError):
        opt.step({"a": torch.randn(100), "zz": torch.randn(3)})
    with pytest.raises(ValueError, match="already registered"):
        opt.add_partition("a", torch.randn(3))
    with pytest.raises(ValueError, match="no swap space"):
        opt.add_partition("n", torch.randn(3), tier="nvme")
    assert torch.equal(m, before) and opt.partition("a").step == 0


def test_optim_config_section():
    cfg = load_config({"optim": {"name": "adam", "betas": [0.5, 0.9], "chunk_elems": 4096}})
    assert cfg.optim.name == "adam" and cfg.optim.betas == [0.5, 0.9]
    for bad in ({"betas": [0.9]}, {"eps": 0.0}, {"chunk_elems": 1000}, {"buffers": 0},
                {"lr": -1.0}, {"buffer_share": 0.0}, {"kernel": "simd"}):
        with pytest.raises(ConfigError):
            load_config({"optim": bad})
