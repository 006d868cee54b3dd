"""int8 moments with a non-finite or huge value in a block ([Note: compressed moments]
in codec.py): the block's other elements keep their values, as torch keeps the other
elements of an fp32 moment. Before, one NaN or inf (or a gradient above ~1.8e19,
whose square overflows exp_avg_sq) made the block's scale NaN or inf, and every one
of its 256 weights NaN at the next step, where torch.optim.AdamW left one weight
NaN (or, for the huge gradient, none)."""

import pytest
import torch

from offload.config import OptimConfig
from offload.optim import CpuAdam
from offload.optim import native as native_mod
from offload.optim.codec import QBLOCK, decode, encode, new_moment

BUILT, _ = native_mod.native_status()
N = 4 * QBLOCK
AT = QBLOCK + 44  # in the second block


def _train(state_dtype: str, kernel: str, bad: float, isa: str | None = None,
           monkeypatch=None) -> torch.Tensor:
    if isa is not None:
        monkeypatch.setenv(native_mod.ISA_SWITCH, isa)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, generator=gen)
    opt = CpuAdam(OptimConfig(state_dtype=state_dtype, kernel=kernel))
    opt.add_partition("w", w)
    for k in range(4):
        g = torch.randn(N, generator=gen)
        if k == 1:
            g[AT] = bad
        opt.step({"w": g})
    opt.close()
    return w


KERNELS = (["native"] if BUILT else []) + ["fused", "foreach"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38, -1e21])
def test_a_non_finite_gradient_spoils_no_more_weights_than_in_fp32(kernel, bad):
    want = _train("fp32", kernel, bad)
    got = _train("int8", kernel, bad)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (
        f"non-finite weights: int8 {(~torch.isfinite(got)).nonzero().flatten().tolist()[:8]}"
        f", fp32 {(~torch.isfinite(want)).nonzero().flatten().tolist()}")
    # the other blocks never saw the value: what they hold does not depend on it
    clean = _train("int8", kernel, 0.5)
    other = torch.ones(N, dtype=torch.bool)
    other[AT // QBLOCK * QBLOCK:(AT // QBLOCK + 1) * QBLOCK] = False
    assert torch.equal(got[other], clean[other])


@pytest.mark.skipif(not BUILT, reason="the native kernel is not built")
@pytest.mark.parametrize("isa", list(native_mod.ISAS))
def test_every_code_path_codes_a_spoilt_block_alike(isa, monkeypatch):
    for bad in (float("nan"), float("inf"), 3e38):
        got = _train("int8", "native", bad, isa, monkeypatch)
        ref = _train("int8", "fused", bad)  # the torch path the kernel matches bit for bit
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_encoding_keeps_the_finite_values_of_a_block_with_a_nan_or_inf(kind):
    x = torch.linspace(0.01, 1.0, QBLOCK)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[7] = bad
        m = new_moment("int8", kind, QBLOCK)
        encode(y, m, torch.empty(QBLOCK))
        back = decode(m, torch.empty(QBLOCK))
        assert torch.isfinite(m.scale).all()
        keep = torch.ones(QBLOCK, dtype=torch.bool)
        keep[7] = False
        if bad != bad:  # a NaN is left out of the scale: the others code as before
            ref = new_moment("int8", kind, QBLOCK)
            encode(torch.where(keep, y, torch.zeros(())), ref, torch.empty(QBLOCK))
            assert torch.equal(back[keep], decode(ref, torch.empty(QBLOCK))[keep])
        else:  # an inf saturates the scale; the others stay finite (most round to 0)
            assert torch.isfinite(back[keep]).all() and back[7] > 1e38
