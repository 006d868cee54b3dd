"""The native fused Adam kernel (offload/optim/native.py) against torch's path.

The torch path (torch._fused_adamw_ on fp32 moments decoded by codec.decode,
encoded back by codec.encode with each run's codec.int8_offsets, or run by run by
codec.encode_stochastic for bf16 moments, the compute-dtype copy by Tensor.copy_) is the
reference: the native kernel must give the same bits where torch's kernel runs
its vector loop on every element (n a multiple of 64), and the same values to
fp32 rounding elsewhere. Without a built kernel these tests skip, except the
ones on the fallback.
"""

import logging

import pytest
import torch

from offload.config import OptimConfig
from offload.optim import AdamHyper, AdamKernel, CpuAdam
from offload.optim import blocks
from offload.optim import native as native_mod
from offload.optim.codec import (NEAREST, QBLOCK, bound_first_moment, clone_moment, decode,
                                 encode, encode_stochastic, int8_offsets, moment_bound,
                                 new_moment, rounding_hash)

from .conftest import grads_for

BUILT, WHY = native_mod.native_status()
needs_native = pytest.mark.skipif(not BUILT, reason=WHY)
OUTS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _state(state_dtype: str, n: int, gen: torch.Generator):
    """Moments as stored after a few steps: m ~ N(0, 0.1), v in [0, 0.01) with some
    zeros and a spread of magnitudes inside each block."""
    m, v = new_moment(state_dtype, "exp_avg", n), new_moment(state_dtype, "exp_avg_sq", n)
    v0 = torch.rand(n, generator=gen) * torch.logspace(-8, -2, n)
    v0[::7] = 0
    encode(torch.randn(n, generator=gen) * 0.1, m, torch.empty(n))
    encode(v0, v, torch.empty(n))
    return m, v


def _torch_path(p, g, m, v, out, grad_scale, runs, first=0):
    """The reference: what blocks.py does with torch's kernels (`first`: the
    partition's index of element 0)."""
    n = p.numel()
    fm, fv = decode(m, torch.empty(n)), decode(v, torch.empty(n))
    root = decode(v, torch.empty(n), squared=False)  # int8: the first moment's bound
    rm, rv = torch.full((n,), NEAREST), torch.full((n,), NEAREST)  # int8: not updated
    k = AdamKernel("fused", 1 << 20)
    for lo, hi, h, st in runs:
        o = None if out is None else out[lo:hi]
        if h is None:
            if o is not None:
                o.copy_(p[lo:hi])
            continue
        if m.scale is not None and m.data.dtype != torch.bfloat16:
            bound_first_moment(fm[lo:hi], root[lo:hi], moment_bound(h.beta1, h.beta2))
        k.update(p[lo:hi], g[lo:hi], fm[lo:hi], fv[lo:hi], step=st + 1, hyper=h,
                 grad_scale=grad_scale, param_out=o)
        if m.data.dtype == torch.bfloat16:
            encode_stochastic(fm[lo:hi], m[lo:hi], first + lo, st + 1)
            encode_stochastic(fv[lo:hi], v[lo:hi], first + lo, st + 1)
        elif m.scale is not None:
            hash_ = rounding_hash(first + lo, hi - lo, st + 1, p.device)
            int8_offsets(hash_, "exp_avg", rm[lo:hi])
            int8_offsets(hash_, "exp_avg_sq", rv[lo:hi])
    if m.data.dtype != torch.bfloat16 and any(h is not None for _, _, h, _ in runs):
        encode(fm, m, torch.empty(n), rm if m.scale is not None else None)
        encode(fv, v, torch.empty(n), rv if m.scale is not None else None)


def _both(state_dtype, n, out_name, grad_scale, runs, seed=0, isa=None, first=0):
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _state(state_dtype, n, gen)
    dt = OUTS[out_name]
    outs = [None if dt is None else torch.full((n,), 7.0).to(dt) for _ in range(2)]
    mine = (p.clone(), clone_moment(m), clone_moment(v))
    native_mod.NativeAdam(isa).block(mine[0], g, mine[1], mine[2], outs[0], grad_scale, runs,
                                     first=first)
    _torch_path(p, g, m, v, outs[1], grad_scale, runs, first)
    return mine + (outs[0],), (p, m, v, outs[1])


def _tensors(x) -> list:
    """A tensor, or a moment's codes and scales."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    return [x.data] + ([] if x.scale is None else [x.scale])


def _assert_same(a, b, exact: bool):
    for x, y in zip(a, b):
        for s, t in zip(_tensors(x), _tensors(y)):
            if exact:
                assert torch.equal(s, t), (s, t)
            elif s.is_floating_point():
                torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-7)
            else:  # codes: a moment one fp32 ulp off may round to a neighbouring code
                assert (s.int() - t.int()).abs().max() <= 1


ADAMW = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True)
ADAM = AdamHyper(1e-3, 0.8, 0.99, 1e-6, 0.05, False)


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("out", ["none", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("hyper", [ADAMW, ADAM], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_scale", [1.0, 96.0])
def test_block_equals_the_torch_path_bit_for_bit(state_dtype, out, hyper, grad_scale):
    n = 8 * QBLOCK  # a multiple of torch's vector width: no scalar tail on its side
    mine, ref = _both(state_dtype, n, out, grad_scale, [(0, n, hyper, 4)])
    _assert_same(mine, ref, exact=True)


@needs_native
@pytest.mark.parametrize("isa", list(native_mod.ISAS))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("first", [0, 12345, 2 ** 32 - 700])
def test_every_code_path_gives_the_torch_paths_bits(isa, state_dtype, first):
    """The AVX-512 loop, the scalar tiles (with or without the AVX2 stream) and the
    torch path: the same bits, bf16 moments rounded stochastically from the partition
    index (`first` on: a block anywhere in its partition, also across 2^32) and
    each run's update count."""
    n = 6 * QBLOCK
    runs = [(0, 128, ADAMW, 2), (128, 320, None, 5), (320, 1024, ADAM, 0),
            (1088, 1472, ADAMW, 9)]  # [1024, 1088) and [1472, n): in no run
    mine, ref = _both(state_dtype, n, "bf16", 1.0, runs, isa=isa, first=first)
    _assert_same(mine, ref, exact=True)


@needs_native
@pytest.mark.parametrize("isa", list(native_mod.ISAS))
def test_the_first_moments_bound_gives_every_paths_bits_at_signed_zeros(isa):
    """[Note: the first moment's bound] where sqrt(v)'s code is 0 (a bound of +0): m
    clamped to -lim was -0.0 on the scalar loop, +0.0 on the AVX-512 one (0 - lim),
    and either in torch's minimum / maximum (their vector body and scalar tail
    disagree); with weights and gradients of -0.0 and beta1 below 0.5 the sign
    reached the weights. The same bits on every path, a tail block too."""
    n = QBLOCK + 40
    hyper = AdamHyper(lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0,
                      decoupled=True)
    m, v = new_moment("int8", "exp_avg", n), new_moment("int8", "exp_avg_sq", n)
    encode(-torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.1 - 0.01, m,
           torch.empty(n))
    sq = torch.zeros(n)
    sq[::2] = 1e-3  # odd elements: sqrt(v) code 0
    encode(sq, v, torch.empty(n))
    p, g, runs = torch.full((n,), -0.0), torch.full((n,), -0.0), [(0, n, hyper, 3)]
    mine = (p.clone(), clone_moment(m), clone_moment(v))
    native_mod.NativeAdam(isa).block(mine[0], g, mine[1], mine[2], None, 1.0, runs)
    _torch_path(p, g, m, v, None, 1.0, runs)
    assert torch.equal(mine[0].view(torch.int32), p.view(torch.int32))
    _assert_same(mine[1:], (m, v), exact=True)


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", [1, 77, QBLOCK + 3, 5 * QBLOCK - 1])
def test_block_with_a_tail_equals_the_torch_path_to_rounding(state_dtype, n):
    mine, ref = _both(state_dtype, n, "bf16", 3.0, [(0, n, ADAMW, 0)])
    _assert_same(mine, ref, exact=False)


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_runs_skipped_and_split_inside_a_block(state_dtype):
    """Segments of other groups and without gradients, cut inside code blocks."""
    n = 6 * QBLOCK
    runs = [(0, 100, ADAMW, 2), (100, 300, None, 5), (300, 1000, ADAM, 0),
            (1100, 1500, ADAMW, 9)]  # [1000, 1100) and [1500, n): in no run
    mine, ref = _both(state_dtype, n, "bf16", 1.0, runs)
    _assert_same(mine, ref, exact=True)


@needs_native
def test_a_block_no_run_updates_is_left_as_it_is():
    n = 3 * QBLOCK
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    m, v = _state("int8", n, gen)
    before = (p.clone(), clone_moment(m), clone_moment(v))
    native_mod.NativeAdam().block(p, torch.randn(n), m, v, None, 1.0, [(0, n, None, 0)])
    _assert_same((p, m, v), before, exact=True)


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_a_fresh_int8_moment_holds_what_encoding_zeros_gives(kind):
    """Blocks no update touches keep their bits; encoding them again (a save and
    resume) must give the same ones."""
    n = 3 * QBLOCK + 5
    fresh, coded = new_moment("int8", kind, n), new_moment("int8", kind, n)
    coded.scale.zero_()
    encode(torch.zeros(n), coded, torch.empty(n))
    assert torch.equal(fresh.data, coded.data) and torch.equal(fresh.scale, coded.scale)


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_cpu_adam_native_equals_cpu_adam_on_torch_kernels(state_dtype, name):
    """Whole optimizer, several steps, segments of two groups, a loss scale, some
    segments without gradients, blocks split over worker threads."""
    n = 20 * 1024 + 100
    segs = [(0, 5000, 0), (5000, 3000, 1), (8000, n - 8000, 0)]
    opts = []
    for kernel in ("native", "fused"):
        cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, kernel=kernel,
                          block_elems=4096, state_dtype=state_dtype)
        opt = CpuAdam(cfg, param_groups=[{}, {"weight_decay": 0.0, "lr": 3e-3}])
        opt.kernel = blocks.BlockUpdater(kernel, 4096, threads=2)
        opt.add_partition("x", torch.linspace(-1, 1, n), segments=segs)
        opts.append(opt)
    assert opts[0].kernel.impl == "native" and opts[1].kernel.impl == "fused"
    outs = [torch.empty(n, dtype=torch.bfloat16) for _ in opts]
    for step in range(4):
        grads = grads_for({"x": n}, seed=step)
        active = {"x": [True, step % 2 == 0, True]}
        for opt, o in zip(opts, outs):
            opt.update(grads, params_out={"x": o}, loss_scale=64.0, active=active)
            opt.commit()
    a, b = (opt.partition_state("x") for opt in opts)
    for k in a:  # n is no multiple of torch's vector width: equal to fp32 rounding
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0].float(), outs[1].float())


@pytest.mark.parametrize("kernel", ["native", "fused", "foreach"])
def test_a_segment_without_a_gradient_gets_its_copy_in_a_fresh_buffer(kernel):
    """params_out is filled for every segment, the ones left as they are (no gradient)
    included: a buffer fresh from the allocator holds whatever was there."""
    if kernel == "native" and not BUILT:
        pytest.skip(WHY)
    n = 20 * 1024
    master = torch.linspace(-1, 1, n)
    opt = CpuAdam(OptimConfig(lr=1e-2, kernel=kernel, block_elems=4096))
    opt.kernel = blocks.BlockUpdater(kernel, 4096, threads=1)
    opt.add_partition("x", master.clone(), segments=[(0, 5000, 0), (5000, 3000, 0),
                                                     (8000, n - 8000, 0)])
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    opt.update(grads_for({"x": n}, seed=0), params_out={"x": out}, loss_scale=64.0,
               active={"x": [True, False, True]})
    opt.commit()
    assert torch.equal(out[5000:8000], master[5000:8000].bfloat16())
    assert not out.isnan().any()


@needs_native
def test_native_kernel_matches_torch_adamw():
    """The kernel's own numerics, no codec in between: torch.optim.AdamW, 5 steps,
    with weight decay (a kernel that skipped it would drift off at once)."""
    gen = torch.Generator().manual_seed(11)
    n = 4 * QBLOCK
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    ref = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.5, fused=True)
    opt = CpuAdam(OptimConfig(lr=1e-2, weight_decay=0.5, kernel="native", block_elems=1024))
    opt.add_partition("x", p.detach().clone())
    for _ in range(5):
        g = torch.randn(n, generator=gen)
        p.grad = g.clone()
        ref.step()
        opt.step({"x": g})
    st = opt.partition_state("x")
    assert torch.equal(st["master"], p.detach())
    assert torch.equal(st["exp_avg"], ref.state[p]["exp_avg"])
    assert torch.equal(st["exp_avg_sq"], ref.state[p]["exp_avg_sq"])


@needs_native
def test_bad_arguments_raise_before_the_call():
    k = native_mod.NativeAdam()
    n = 2 * QBLOCK
    p, g = torch.zeros(n), torch.zeros(n)
    m, v = new_moment("int8", "exp_avg", n), new_moment("int8", "exp_avg_sq", n)
    run = [(0, n, ADAMW, 0)]
    bad = [
        dict(master=p.double()), dict(grad=g[:-1]), dict(grad=torch.zeros(2 * n)[::2]),
        dict(exp_avg=new_moment("bf16", "exp_avg", n)),
        dict(exp_avg_sq=m._replace(kind="exp_avg_sq")),  # int8 codes where uint8 belong
        dict(exp_avg=m._replace(scale=None)), dict(exp_avg=m._replace(scale=m.scale[:1])),
        dict(out=torch.zeros(n, dtype=torch.int32)), dict(out=torch.zeros(n + 1)),
        dict(runs=[(0, n + 1, ADAMW, 0)]), dict(runs=[(10, 20, ADAMW, 0), (5, 30, ADAMW, 0)]),
        dict(runs=[(0, n, ADAMW, -1)]), dict(grad_scale=0.0), dict(grad_scale=float("inf")),
    ]
    for change in bad:
        kw = {**dict(master=p, grad=g, exp_avg=m, exp_avg_sq=v, out=None, grad_scale=1.0,
                     runs=run), **change}
        with pytest.raises(ValueError):
            k.block(**kw)
    assert not p.any() and not m.data.any() and not v.data.any()  # nothing was written


def test_a_switch_value_other_than_0_or_1_is_refused(monkeypatch):
    """OFFLOAD_NATIVE_ADAM=false (off, no) kept the kernel on, silently."""
    from offload.config import ConfigError
    for value in ("false", "off", " 0"):
        monkeypatch.setenv(native_mod.ENV_SWITCH, value)
        with pytest.raises(ConfigError, match=f"{native_mod.ENV_SWITCH}: {value!r} is not"):
            blocks.BlockUpdater("auto", 1024, threads=1)


def test_fallback_to_torch_when_switched_off_or_absent(monkeypatch, caplog):
    monkeypatch.setenv(native_mod.ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="offload.optim.native"):
        u = blocks.BlockUpdater("auto", 1024, threads=1)
    assert u.impl in ("fused", "foreach") and native_mod.ENV_SWITCH in caplog.text
    with pytest.raises(RuntimeError, match="native"):
        blocks.BlockUpdater("native", 1024, threads=1)
    monkeypatch.delenv(native_mod.ENV_SWITCH)
    monkeypatch.setattr(native_mod, "_library_path", lambda: None)
    native_mod._cache.clear()
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload.optim.native"):
            u = blocks.BlockUpdater("auto", 1024, threads=1)
            blocks.BlockUpdater("auto", 1024, threads=1)
        assert u.impl in ("fused", "foreach") and "not built" in caplog.text
        assert caplog.text.count("not built") == 1  # one line per process, not per optimizer
        # the torch path still gives torch.optim.AdamW's results
        opt = CpuAdam(OptimConfig(lr=1e-2, weight_decay=0.1, block_elems=1024))
        assert opt.kernel.impl in ("fused", "foreach")
        p = torch.nn.Parameter(torch.randn(3000))
        ref = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
        opt.add_partition("x", p.detach().clone())
        g = torch.randn(3000)
        p.grad = g.clone()
        ref.step()
        opt.step({"x": g}, params_out={"x": torch.empty(3000, dtype=torch.bfloat16)})
        torch.testing.assert_close(opt.partition_state("x")["master"], p.detach())
    finally:
        native_mod._cache.clear()  # the next caller loads the library again


@needs_native
def test_default_kernel_is_native_where_built():
    assert CpuAdam(OptimConfig()).kernel.impl == "native"


def _special_floats(n: int, seed: int) -> torch.Tensor:
    """fp32 values where a bf16 / fp16 conversion can go wrong: zeros, subnormals
    (fp32's, and fp16's range), ties to even, values that round up to the next
    binade or to inf, infinities, NaNs of either sign with several payloads
    (quiet and signalling); the rest random bit patterns."""
    bits = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000, 0x00018000,
            0x007fffff, 0x807fffff, 0x007f8000, 0x007f7fff, 0x00800000, 0x3f808000,
            0x3f818000, 0x3f80ffff, 0x3f7fffff, 0x33800000, 0x33000001, 0x387fc000,
            0x477fe000, 0x477ff000, 0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7fffff,
            0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
            0x7fbfffff, 0x7fffffff, 0xffffffff, 0x7fc0ffff, 0x7f80ffff]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen, dtype=torch.int64)
    special = torch.tensor(bits, dtype=torch.int64)
    x[: 3 * len(bits)] = special.repeat(3)
    x[-len(bits):] = special  # in the scalar tail too
    return (x & 0xFFFFFFFF).to(torch.int32).view(torch.float32)  # int32 bits, two's complement


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("updated", [True, False], ids=["updated", "left-alone"])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_copy_of_special_values_equals_torchs_conversion(dtype, updated, offset):
    """The compute-dtype copy, bit for bit `master.to(dtype)` (torch's conversion:
    round to nearest even, subnormals kept, its NaN), also for NaN, inf and
    subnormal masters, in the vector loop, its unaligned head (`offset`) and its
    tail. lr = 0 leaves the master as it was (but for the sign of a zero and
    quieted NaNs), so every special value reaches the conversion."""
    n = 8 * QBLOCK + 45
    p = _special_floats(n, seed=offset)
    g, m, v = torch.randn(n), new_moment("fp32", "exp_avg", n), new_moment("fp32", "exp_avg_sq", n)
    out = torch.zeros(n + offset, dtype=dtype)[offset:]
    hyper = AdamHyper(0.0, 0.9, 0.999, 1e-8, 0.0, True) if updated else None
    native_mod.NativeAdam().block(p, g, m, v, out, 1.0, [(0, n, hyper, 2)])
    want = p.to(dtype)
    same = out.view(torch.int16) == want.view(torch.int16)
    assert same.all(), (p[~same][:8].view(torch.int32), out[~same][:8].view(torch.int16),
                        want[~same][:8].view(torch.int16))


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("out", ["bf16", "fp16"])
def test_non_finite_gradients_give_the_torch_paths_bits(state_dtype, out):
    """NaN, inf and huge gradients (what a step with an overflow that went unchecked
    feeds the kernel): NaN masters, moments and copies with torch's bits."""
    n = 8 * QBLOCK
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g[::5] = float("nan")
    g[1::7] = float("inf")
    g[2::11] = -float("inf")
    g[3::13] = 3e38
    m, v = _state(state_dtype, n, gen)
    outs = [torch.zeros(n, dtype=OUTS[out]) for _ in range(2)]
    mine = (p.clone(), clone_moment(m), clone_moment(v))
    native_mod.NativeAdam().block(mine[0], g, mine[1], mine[2], outs[0], 1.0, [(0, n, ADAMW, 3)])
    _torch_path(p, g, m, v, outs[1], 1.0, [(0, n, ADAMW, 3)])
    assert p.isnan().any() and outs[1].isnan().any()
    for a, b in zip(_tensors(mine[0]) + _tensors(mine[1]) + _tensors(mine[2]) + [outs[0]],
                    _tensors(p) + _tensors(m) + _tensors(v) + [outs[1]]):
        bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
        assert torch.equal(a.view(bits), b.view(bits))


@needs_native
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("out", ["bf16", "fp16", "none"])
def test_claimed_units_on_threads_equal_one_call(state_dtype, out):
    """`claimer`: three threads share a chunk unit by unit (units of 1024, runs cut
    inside them and across them, a tail) and give `block`'s bits over the whole
    (bf16 moments: the same random bits whichever thread rounds an element)."""
    import threading

    n = 23 * 1024 + 77
    runs = [(0, 1500, ADAMW, 2), (1500, 3000, None, 5), (3000, 9000, ADAM, 0),
            (9100, n - 3, ADAMW, 9)]
    gen = torch.Generator().manual_seed(9)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _state(state_dtype, n, gen)
    outs = [None if OUTS[out] is None else torch.zeros(n, dtype=OUTS[out]) for _ in range(2)]
    mine = (p.clone(), clone_moment(m), clone_moment(v))
    k = native_mod.NativeAdam()
    k.block(p, g, m, v, outs[1], 2.0, runs, first=777)
    job = k.claimer(mine[0], g, mine[1], mine[2], outs[0], 2.0, runs, first=777, unit=1024)
    done = []
    threads = [threading.Thread(target=lambda: done.append(job())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(done) == -(-n // 1024) and job() == 0  # every unit once; none left after
    _assert_same(mine + (outs[0],), (p, m, v, outs[1]), exact=True)
    with pytest.raises(ValueError, match="multiple of 1024"):
        k.claimer(p, g, m, v, None, 1.0, runs, unit=1000)


@needs_native
def test_a_claimer_keeps_its_tensors_alive():
    """The function `claimer` returns writes through the tensors' addresses: it holds
    them, so a caller's temporaries are not freed under it (that wrote into freed
    memory: a segmentation fault)."""
    import gc
    import weakref

    n = 4096
    k = native_mod.NativeAdam()

    def job_of_temporaries():
        master = torch.zeros(n)
        m, v = _state("fp32", n, torch.Generator().manual_seed(1))
        return k.claimer(master, torch.ones(n), m, v, None, 1.0, [(0, n, ADAMW, 0)]), \
            weakref.ref(master)

    job, master = job_of_temporaries()
    gc.collect()
    assert master() is not None
    assert job() > 0 and bool((master() != 0).all())
    del job
    gc.collect()
    assert master() is None


@needs_native
@pytest.mark.parametrize("isa", list(native_mod.ISAS))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("claim", [False, True], ids=["block", "claimer"])
@pytest.mark.parametrize("out", ["bf16", None])
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "unaligned"])
def test_a_master_read_from_src_gives_the_bits_of_copying_it_first(isa, state_dtype, claim,
                                                                    out, shift):
    """`src`: the master's current values elsewhere (a partition updated into a fresh
    buffer). `master` gets what copying `src` into it and updating gives, elements no
    run updates included (skipped runs and gaps); `src` is only read. Without a copy
    the AVX-512 loop streams the new master from its first 64-byte boundary on
    ([Note: the master read in the loop] in adam_native.c): from a master on one and
    from a master one element off it."""
    import threading

    n = 9 * 1024 + 77
    runs = [(0, 1500, ADAMW, 2), (1500, 3000, None, 5), (3000, 6000, ADAM, 0),
            (6100, n - 3, ADAMW, 9)]  # [6000, 6100) and [n - 3, n): in no run
    gen = torch.Generator().manual_seed(11)
    src, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _state(state_dtype, n, gen)
    k = native_mod.NativeAdam(isa)
    copy = (lambda: torch.zeros(n, dtype=torch.bfloat16)) if out else (lambda: None)
    ref = (src.clone(), clone_moment(m), clone_moment(v), copy())
    k.block(ref[0], g, ref[1], ref[2], ref[3], 1.0, runs, first=5)
    before = src.clone()
    master = torch.full((n + 1,), float("nan"))[shift:shift + n]
    assert (master.data_ptr() % 64 == 0) == (shift == 0)
    mine = (master, m, v, copy())
    if claim:
        job = k.claimer(mine[0], g, m, v, mine[3], 1.0, runs, first=5, src=src, unit=1024)
        threads = [threading.Thread(target=job) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        k.block(mine[0], g, m, v, mine[3], 1.0, runs, first=5, src=src)
    _assert_same(mine, ref, exact=True)
    assert torch.equal(src, before)
    with pytest.raises(ValueError, match="src overlaps"):
        fm, fv = _state("fp32", n - 1, gen)
        k.block(src[1:], g[1:], fm, fv, None, 1.0, [(0, n - 1, ADAMW, 2)], src=src[:-1])
