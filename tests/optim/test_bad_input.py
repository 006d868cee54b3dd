"""Bad input to the CPU optimizer gets a clear error, before anything changes, and
never a crash: hyper-parameters torch.optim.AdamW refuses, tensors the native
kernel cannot take (misaligned), state dicts whose 8-bit codes do not fit."""

import math

import numpy as np
import pytest
import torch

from offload.config import OptimConfig
from offload.optim import AdamHyper, CpuAdam
from offload.optim import native as native_mod
from offload.optim.codec import QBLOCK, new_moment

BUILT, WHY = native_mod.native_status()
needs_native = pytest.mark.skipif(not BUILT, reason=WHY)
N = 2 * QBLOCK + 88  # a tail block


def _opt(state_dtype: str = "fp32", kernel: str = "auto", **group) -> tuple[CpuAdam, torch.Tensor]:
    opt = CpuAdam(OptimConfig(state_dtype=state_dtype, kernel=kernel),
                  param_groups=[group] if group else None)
    master = torch.randn(N)
    opt.add_partition("x", master)
    return opt, master


# -- hyper-parameters ---------------------------------------------------------------

BAD_GROUPS = [{"betas": (1.0, 0.999)}, {"betas": (0.9, 1.0)}, {"betas": (-0.1, 0.999)},
              {"betas": (0.9,)}, {"lr": -1e-3}, {"lr": float("nan")}, {"eps": -1e-8},
              {"weight_decay": -0.1}, {"weight_decay": float("inf")}]


@pytest.mark.parametrize("group", BAD_GROUPS, ids=lambda g: str(g))
def test_param_groups_torch_refuses_are_refused_when_built(group):
    """torch.optim.AdamW raises ValueError for these; so does CpuAdam, at once
    (before: a ZeroDivisionError at the first step for beta1 = 1, NaN weights
    for beta2 = 1, the others silently taken)."""
    key = next(iter(group))
    with pytest.raises(ValueError, match=rf"param_groups\[0\].*{key}"):
        CpuAdam(OptimConfig(), param_groups=[group])


@pytest.mark.parametrize("group", BAD_GROUPS, ids=lambda g: str(g))
def test_a_bad_value_written_into_a_group_is_refused_before_the_update(group):
    opt, master = _opt("int8")
    before = master.clone()
    opt.param_groups[0].update(group)
    with pytest.raises(ValueError, match=r"param_groups\[0\]"):
        opt.step({"x": torch.randn(N)})
    assert torch.equal(master, before) and opt.partition("x").step == 0 and opt.steps == 0


def test_a_schedule_giving_a_bad_lr_is_refused():
    opt = CpuAdam(OptimConfig(), lr_lambda=lambda k: float("nan") if k else 1.0)
    master = torch.randn(N)
    opt.add_partition("x", master)
    opt.step({"x": torch.randn(N)})
    before = master.clone()
    with pytest.raises(ValueError, match="lr"):
        opt.step({"x": torch.randn(N)})
    assert torch.equal(master, before)


def test_load_state_dict_refuses_bad_hyper_parameters_before_loading():
    opt, _ = _opt()
    opt.step({"x": torch.randn(N)})
    sd = opt.state_dict()
    sd["param_groups"][0]["betas"] = (0.9, 1.5)
    other, master = _opt()
    before = master.clone()
    with pytest.raises(ValueError, match="betas"):
        other.load_state_dict(sd)
    assert torch.equal(master, before) and other.param_groups[0]["betas"] == (0.9, 0.999)


def test_load_state_dict_with_one_damaged_partition_changes_no_partition():
    """Everything is checked before anything changes: a state dict whose last partition
    is damaged (an exp_avg_sq below zero) leaves the first partition's state, loaded
    first, and the hyper-parameters as they were."""
    src = CpuAdam(OptimConfig())
    for pid in ("a", "b"):
        src.add_partition(pid, torch.ones(8))
    src.step({"a": torch.ones(8), "b": torch.ones(8)})
    sd = src.state_dict()
    sd["state"]["a"] = {**sd["state"]["a"], "step": 7, "exp_avg": torch.full((8,), 5.0)}
    sd["state"]["b"] = {**sd["state"]["b"], "exp_avg_sq": torch.full((8,), -1.0)}
    sd["param_groups"][0]["lr"] = 0.5
    before = {k: v.clone() for k, v in src.partition_state("a").items()}
    with pytest.raises(ValueError, match="exp_avg_sq"):
        src.load_state_dict(sd)
    after = src.partition_state("a")
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert src.param_groups[0]["lr"] != 0.5


def test_segment_update_counts_above_the_partitions_step_are_refused():
    """Adam's bias correction reads each segment's count: one above the partition's own
    step is damage, refused on load."""
    opt = CpuAdam(OptimConfig())
    opt.add_partition("a", torch.ones(8))
    state = {**opt.partition_state("a"), "step": 1, "segment_steps": [5]}
    with pytest.raises(ValueError, match="segment"):
        opt.load_partition_state("a", state)


@pytest.mark.parametrize("steps", ["three", -5, 2.5, True, None])
def test_a_state_dicts_steps_that_are_no_count_are_refused_before_anything_loads(steps):
    """`steps` was converted after every partition had loaded: "three" raised a bare
    int() error with the partitions at the dict's state and `steps` at the optimizer's,
    and -5 loaded, leaving the optimizer's count below the engine's."""
    opt, master = _opt()
    opt.step({"x": torch.randn(N)})
    saved = opt.state_dict()
    opt.step({"x": torch.randn(N)})
    before = {k: v.clone() for k, v in opt.partition_state("x").items()}
    with pytest.raises(ValueError, match=r"state_dict\['steps'\]: .* is not a count"):
        opt.load_state_dict({**saved, "steps": steps})
    after = opt.partition_state("x")
    assert opt.steps == 2 and all(torch.equal(after[k], v) for k, v in before.items())
    opt.load_state_dict({**saved, "steps": torch.tensor(1)})  # a tensor of a count: taken
    assert opt.steps == 1 and opt.partition("x").step == 1
    opt.load_state_dict({**saved, "steps": np.int64(1)})  # and a numpy one
    assert opt.steps == 1 and type(opt.steps) is int


def test_a_grad_norm_not_finite_skips_the_step_without_found_inf():
    """A global gradient norm that is NaN or inf (another rank's overflow, all-reduced)
    skips the step even where the caller passed found_inf=False, leaving the master."""
    for norm in (math.nan, math.inf):
        opt = CpuAdam(OptimConfig(max_grad_norm=1.0))
        master = torch.ones(4)
        opt.add_partition("a", master)
        res = opt.step({"a": torch.ones(4)}, grad_norm=norm, found_inf=False)
        assert res.skipped and torch.equal(master, torch.ones(4)), (norm, master)


def test_edge_values_torch_accepts_still_match_torch():
    """eps = 0, weight_decay = 0, beta1 = 0 and beta2 close to 1: accepted, as torch does."""
    for group in ({"eps": 0.0}, {"weight_decay": 0.0}, {"betas": (0.0, 0.999999)}):
        opt, master = _opt(**group)
        p = torch.nn.Parameter(master.clone())
        hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, **group}
        ref = torch.optim.AdamW([p], **hyper)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            g = torch.randn(N, generator=gen)
            opt.step({"x": g})
            p.grad = g.clone()
            ref.step()
        torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=1e-7)


def test_a_schedule_may_take_lr_below_zero_as_lambdalr_does():
    opt = CpuAdam(OptimConfig(), lr_lambda=lambda k: 1.0 - k)
    master = torch.randn(N)
    opt.add_partition("x", master)
    for _ in range(3):
        opt.step({"x": torch.randn(N)})
    assert torch.isfinite(master).all()


def test_adam_hyper_checks_its_values():
    with pytest.raises(ValueError, match="beta1"):
        AdamHyper(1e-3, 1.0, 0.999, 1e-8, 0.0, True)


# -- misaligned tensors -------------------------------------------------------------

def _misaligned(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A contiguous CPU tensor whose address is not a multiple of its element size."""
    buf = bytearray(n * dtype.itemsize + 64)
    t = torch.frombuffer(buf, dtype=dtype, offset=1, count=n)
    t._buf = buf  # keep the memory alive with the tensor
    assert t.is_contiguous() and t.data_ptr() % dtype.itemsize
    return t


@needs_native
@pytest.mark.parametrize("what", ["master", "src", "grad", "out"])
def test_misaligned_tensors_are_refused_by_the_native_kernel(what):
    """A bf16 copy or a master one byte off its element size made the AVX-512 loop's
    aligned streaming stores fault (a segfault of the process)."""
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    n = 4096
    args = {"master": torch.randn(n), "grad": torch.randn(n), "out": torch.zeros(
        n, dtype=torch.bfloat16), "src": torch.randn(n)}
    dt = torch.bfloat16 if what == "out" else torch.float32
    args[what] = _misaligned(dt, n).copy_(args[what])
    m, v = new_moment("fp32", "exp_avg", n), new_moment("fp32", "exp_avg_sq", n)
    with pytest.raises(ValueError, match="aligned"):
        native_mod.NativeAdam().block(args["master"], args["grad"], m, v, args["out"], 1.0,
                                      [(0, n, h, 0)], src=args["src"])


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_cpu_adam_refuses_a_misaligned_params_out(state_dtype):
    opt, master = _opt(state_dtype)
    before = master.clone()
    out = _misaligned(torch.bfloat16, N)
    with pytest.raises(ValueError, match="aligned"):
        opt.step({"x": torch.randn(N)}, params_out={"x": out})
    assert torch.equal(master, before)


# -- state dicts with 8-bit codes -----------------------------------------------------

def _int8_state() -> dict:
    opt, _ = _opt("int8")
    opt.step({"x": torch.randn(N)})
    return opt.partition_state("x")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("bad", ["exp_avg as uint8", "exp_avg_sq as int8", "1 scale",
                                 "5 scales", "bool moment", "complex moment", "scale list",
                                 "master list"])
def test_state_dict_codes_that_do_not_fit_are_refused(state_dtype, bad):
    """Codes of the wrong signedness were decoded silently to other values (exp_avg's
    -1 as 255); a wrong number of scales was broadcast or raised a shape error
    from deep inside decoding; non-float moments were cast."""
    st = dict(_int8_state())
    if bad == "exp_avg as uint8":
        st["exp_avg"] = st["exp_avg"].view(torch.uint8)
    elif bad == "exp_avg_sq as int8":
        st["exp_avg_sq"] = st["exp_avg_sq"].view(torch.int8)
    elif bad == "1 scale":
        st["exp_avg_scale"] = st["exp_avg_scale"][:1]
    elif bad == "5 scales":
        st["exp_avg_sq_scale"] = torch.ones(5)
    elif bad == "bool moment":
        st = {"step": st["step"], "exp_avg": torch.zeros(N, dtype=torch.bool),
              "exp_avg_sq": torch.zeros(N)}
    elif bad == "complex moment":
        st = {"step": st["step"], "exp_avg": torch.zeros(N), "exp_avg_sq": torch.zeros(
            N, dtype=torch.complex64)}
    elif bad == "scale list":
        st["exp_avg_scale"] = st["exp_avg_scale"].tolist()
    else:
        st["master"] = st["master"].tolist()
    opt, master = _opt(state_dtype)
    before = master.clone()
    with pytest.raises((ValueError, TypeError), match=r"state\[|exp_avg|master"):
        opt.load_partition_state("x", st)
    assert torch.equal(master, before)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_int8_codes_load_into_other_forms_as_their_values(state_dtype):
    st = _int8_state()
    opt, _ = _opt(state_dtype)
    opt.load_partition_state("x", st)
    src, _ = _opt("int8")
    src.load_partition_state("x", st)
    for k in ("exp_avg", "exp_avg_sq"):
        got = opt.partition_state("x")[k]
        want = {}
        src.read_state_chunks("x", lambda lo, n, d: want.setdefault(lo, d[k].clone()))
        want = torch.cat([want[lo] for lo in sorted(want)]).to(got.dtype)
        assert torch.equal(got, want)
