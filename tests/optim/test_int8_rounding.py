"""Stochastic rounding of the int8 codes the update writes ([Note: stochastic
rounding] in offload/optim/codec.py): unbiased, a decoded block keeps its codes,
elements no run updates round to nearest, and the stall it fixes (a small steady
gradient beside a spike in its block) on the native kernel and torch's."""

import pytest
import torch

from offload.config import OptimConfig
from offload.optim import AdamHyper, CpuAdam
from offload.optim import blocks
from offload.optim import native as native_mod
from offload.optim.codec import (NEAREST, QBLOCK, Moment, clone_moment, decode, encode,
                                 int8_offsets, new_moment, rounding_hash)

KINDS = ["exp_avg", "exp_avg_sq"]


def _kernel_or_skip(kernel: str) -> None:
    if kernel == "native" and not native_mod.native_status()[0]:
        pytest.skip(native_mod.native_status()[1])


def _offsets(kind: str, first: int, n: int, count: int) -> torch.Tensor:
    return int8_offsets(rounding_hash(first, n, count, torch.device("cpu")), kind)


def _coded(kind: str, n: int, seed: int) -> Moment:
    """A moment as the update leaves it: random values over 6 decades, coded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 0, n)
    m = new_moment("int8", kind, n)
    encode(x.square() if kind == "exp_avg_sq" else x, m, torch.empty(n))
    return m


@pytest.mark.parametrize("kind", KINDS)
def test_offsets_are_odd_multiples_of_1_512_from_the_hashs_bytes(kind):
    h = torch.tensor([0, 0xFFFFFFFF, 0x12345678, 0x80FF7F01], dtype=torch.int64)
    k = (h >> 8) & 0xFF if kind == "exp_avg" else h >> 24
    want = ((k * 2 + 1).double() / 512).float()
    assert torch.equal(int8_offsets(h, kind), want)
    r = _offsets(kind, 0, 1 << 16, 3)
    assert r.min() == 1 / 512 and r.max() == 1 - 1 / 512
    assert abs(r.mean().item() - 0.5) < 0.01  # the bytes are spread evenly


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [QBLOCK, 3 * QBLOCK + 17])
def test_a_decoded_block_encodes_back_to_its_codes(kind, n):
    """Rounded stochastically (any offsets) or to nearest, decoded codes come back
    as they were: an update that leaves values where they are leaves the codes."""
    m = _coded(kind, n, seed=n)
    x = decode(m, torch.empty(n))
    for count in (1, 2, 1000, 2 ** 32 - 1):
        again = new_moment("int8", kind, n)
        encode(x, again, torch.empty(n), _offsets(kind, 12345, n, count))
        assert torch.equal(again.data, m.data) and torch.equal(again.scale, m.scale), count
    again = new_moment("int8", kind, n)
    encode(x, again, torch.empty(n), torch.full((n,), NEAREST))
    assert torch.equal(again.data, m.data) and torch.equal(again.scale, m.scale)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_stochastic_rounding_is_unbiased(kind):
    """One element at 38.3 code steps, coded at 4096 updates of its run: the mean of
    its codes is 38.3 within 5 standard deviations (to nearest: 38, 0.3 off), and each
    code is 38 or 39; the block's largest element keeps its top code every time."""
    top = 127 if kind == "exp_avg" else 255
    frac = 38.3
    x = torch.zeros(QBLOCK)
    x[0], x[7] = 1.0, frac / top  # the block's scale is 1 / top
    if kind == "exp_avg_sq":
        x = x.square()  # sqrt(v) is what is coded
    m = new_moment("int8", kind, QBLOCK)
    codes = []
    for count in range(1, 4097):
        encode(x, m, torch.empty(QBLOCK), _offsets(kind, 777, QBLOCK, count))
        assert m.data[0] == top
        codes.append(int(m.data[7]))
    got = torch.tensor(codes, dtype=torch.float64)
    assert set(codes) == {38, 39}
    p = frac - 38
    assert abs(got.mean().item() - frac) <= 5 * (p * (1 - p) / len(codes)) ** 0.5


@pytest.mark.parametrize("kernel", ["native", "foreach"])
def test_a_small_gradient_beside_a_spike_moves_its_weight_as_fp32_does(kernel):
    """One gradient of 10 in a block's element 0 at step 1, a steady 1e-3 in element
    1: the block's sqrt(v) scale is the spike's (0.316 / 255 a code), and element 1's
    sqrt(v) grows 0.0316 * 1e-3 a step, 2.5% of a code. Rounded to nearest its code
    stayed 0 while exp_avg's came back, so its steps were ~30x lr (-45.9 after 2000
    steps against fp32's -2.0); rounded stochastically it stays near fp32's."""
    _kernel_or_skip(kernel)
    opts = {}
    for sd in ("fp32", "int8"):
        opts[sd] = CpuAdam(OptimConfig(state_dtype=sd, lr=1e-3, weight_decay=0.0, kernel=kernel))
        opts[sd].kernel = blocks.BlockUpdater(kernel, 1024, threads=1)
        opts[sd].add_partition("p", torch.zeros(QBLOCK))
    assert opts["int8"].kernel.impl == ("native" if kernel == "native" else "foreach")
    steps = 1500
    for step in range(1, steps + 1):
        g = torch.zeros(QBLOCK)
        g[1] = 1e-3
        if step == 1:
            g[0] = 10.0
        for o in opts.values():
            o.step({"p": g})
    w = {sd: o.partition_state("p")["master"][1].item() for sd, o in opts.items()}
    for o in opts.values():
        o.close()
    assert w["fp32"] == pytest.approx(-1e-3 * steps, rel=0.01)
    assert 1 / 1.5 < w["int8"] / w["fp32"] < 1.5, w


@pytest.mark.parametrize("kernel", ["native", "foreach"])
@pytest.mark.parametrize("quieter", [0.0, 1e-3, 1.0])
def test_a_step_is_never_beyond_the_bound_fp32_adam_keeps(kernel, quieter):
    """[Note: the first moment's bound] in codec.py: a block of gradients over three
    decades, then the same gradients times `quieter` (0: an embedding row whose token
    left the batch). The two codes round apart: where sqrt(v)'s rounded down to 0 and
    exp_avg's up to 1 the second step was m / eps, up to 57,000 lr in one step (9 lr
    with the same gradient twice). Every step now stays within C = 7.27 lr, as fp32
    Adam's do, and the weights near fp32's."""
    _kernel_or_skip(kernel)
    lr, g = 1e-2, torch.Generator().manual_seed(0)
    g1 = torch.randn(QBLOCK, generator=g) * torch.logspace(-4, -1, QBLOCK)[
        torch.randperm(QBLOCK, generator=g)]
    w0 = torch.randn(QBLOCK, generator=g)
    got = {}
    for sd in ("fp32", "int8"):
        opt = CpuAdam(OptimConfig(state_dtype=sd, lr=lr, weight_decay=0.0, kernel=kernel))
        opt.kernel = blocks.BlockUpdater(kernel, 1024, threads=1)
        w = w0.clone()
        opt.add_partition("p", w)
        for grad in (g1, g1 * quieter, g1 * quieter):
            before = w.clone()
            opt.step({"p": grad})
            assert (w - before).abs().max() <= 7.27 * lr, (sd, (w - before).abs().max() / lr)
        got[sd] = w
        opt.close()
    assert (got["int8"] - got["fp32"]).abs().max() < 5 * lr


@pytest.mark.skipif(not native_mod.native_status()[0], reason=native_mod.native_status()[1])
@pytest.mark.parametrize("isa", list(native_mod.ISAS))
def test_elements_no_run_updates_keep_their_codes_in_a_block_coded_again(isa):
    """A block half updated (one run), half not (a run without gradient, then no
    run): the scale is the untouched largest element's, so the untouched codes come
    back as they were (rounded to nearest from their decoded values) and the
    updated ones move."""
    n = QBLOCK
    g = torch.Generator().manual_seed(5)
    m, v = new_moment("int8", "exp_avg", n), new_moment("int8", "exp_avg_sq", n)
    xm, xv = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-4
    xm[200], xv[200] = 1.0, 1.0  # the largest of each moment, in no run
    encode(xm, m, torch.empty(n))
    encode(xv, v, torch.empty(n))
    before = (clone_moment(m), clone_moment(v))
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    runs = [(0, 100, hyper, 4), (100, 150, None, 2)]  # [150, n): in no run
    p = torch.zeros(n)
    native_mod.NativeAdam(isa).block(p, torch.randn(n, generator=g) * 0.01, m, v, None, 1.0,
                                     runs)
    for new, old in zip((m, v), before):
        assert torch.equal(new.scale, old.scale)
        assert torch.equal(new.data[100:], old.data[100:])
    assert not torch.equal(m.data[:100], before[0].data[:100])
