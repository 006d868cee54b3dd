"""Argument guards of the moments' codec and the native kernel: each refuses a caller's
mistake that would otherwise pair codes with the wrong scales, write bf16 bits into
another dtype, or hash elements under indices no partition has."""

import pytest
import torch

from offload.optim import AdamHyper
from offload.optim import native as native_mod
from offload.optim.codec import QBLOCK, encode_stochastic, new_moment

BUILT, WHY = native_mod.native_status()


def test_an_int8_moment_sliced_off_its_scale_blocks_is_refused():
    m = new_moment("int8", "exp_avg", 3 * QBLOCK)
    assert m[QBLOCK:2 * QBLOCK].scale.numel() == 1
    with pytest.raises(ValueError, match="multiple"):
        m[QBLOCK // 2:2 * QBLOCK]


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_stochastic_rounding_refuses_a_moment_not_stored_as_bf16(state_dtype):
    m = new_moment(state_dtype, "exp_avg", QBLOCK)
    before = m.data.clone()
    with pytest.raises(ValueError, match="bf16"):
        encode_stochastic(torch.full((QBLOCK,), 0.3), m, 0, 1)
    assert torch.equal(m.data, before)


@pytest.mark.skipif(not BUILT, reason=WHY)
def test_the_native_kernel_refuses_a_negative_first_element():
    k = native_mod.NativeAdam()
    n = QBLOCK
    p, g = torch.zeros(n), torch.ones(n)
    m, v = new_moment("bf16", "exp_avg", n), new_moment("bf16", "exp_avg_sq", n)
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    with pytest.raises(ValueError, match="negative"):
        k.block(p, g, m, v, None, 1.0, [(0, n, hyper, 0)], first=-1)
    assert not p.any() and not m.data.any() and not v.data.any()
