"""Segments: one partition holding several parameters of several groups, some of
which have no gradient in a step ([Note: segments] in offload/optim/optimizer.py)."""

import pytest
import torch

from offload.config import OptimConfig
from offload.optim import CpuAdam

SIZES = [700, 300, 1500, 33]         # four parameters, packed in one partition
GROUPS = [0, 1, 0, 1]                # their parameter groups
ACTIVE = [[True, False, True, False],  # which had a gradient, per step
          [True, True, False, False],
          [False, True, True, True]]
HYPER = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0,
                                              "betas": (0.8, 0.99)}]


def _segments():
    out, at = [], 0
    for n, k in zip(SIZES, GROUPS):
        out.append((at, n, k))
        at += n
    return out


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_segments_match_torch_param_groups_and_none_grads(tier, swap, pool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    ref = torch.optim.AdamW([{"params": [p for p, k in zip(params, GROUPS) if k == g], **h}
                             for g, h in enumerate(HYPER)], fused=True)
    opt = CpuAdam(OptimConfig(block_elems=1024, chunk_elems=1024), param_groups=HYPER,
                  **({"swap": swap, "pool": pool} if tier == "nvme" else {}))
    opt.add_partition("p", torch.cat([p.detach() for p in params]), tier=tier,
                      segments=_segments())
    assert opt.param_groups[0]["params"] == ["p"] == opt.param_groups[1]["params"]
    g = torch.Generator().manual_seed(1)
    for active in ACTIVE:
        grads = [torch.randn(n, generator=g) for n in SIZES]
        for p, gr, on in zip(params, grads, active):
            p.grad = gr.clone() if on else None  # torch skips a parameter without a grad
        ref.step()
        opt.step({"p": torch.cat(grads)}, active={"p": active})
    state = opt.partition_state("p")
    torch.testing.assert_close(state["master"], torch.cat([p.detach() for p in params]),
                               atol=1e-6, rtol=0)
    want = [int(ref.state[p]["step"]) if p in ref.state else 0 for p in params]
    assert state["segment_steps"].tolist() == want == [2, 2, 2, 1]


def test_rollback_restores_segment_steps_and_load_takes_them():
    opt = CpuAdam(OptimConfig(block_elems=1024), param_groups=HYPER)
    opt.add_partition("p", torch.randn(sum(SIZES)), segments=_segments())
    opt.step({"p": torch.randn(sum(SIZES))}, active={"p": ACTIVE[0]})
    before = opt.partition_state("p")
    kept = {k: v.clone() for k, v in before.items()}
    opt.update({"p": torch.randn(sum(SIZES))}, active={"p": ACTIVE[1]})
    assert opt.partition_state("p")["segment_steps"].tolist() == [1, 0, 1, 0]  # committed
    opt.rollback()
    after = opt.partition_state("p")
    assert all(torch.equal(after[k], kept[k]) for k in kept)
    assert opt.partition("p").seg_steps == [1, 0, 1, 0]
    other = CpuAdam(OptimConfig(block_elems=1024), param_groups=HYPER)
    other.add_partition("p", torch.zeros(sum(SIZES)), segments=_segments())
    other.load_state_dict(opt.state_dict())
    assert other.partition("p").seg_steps == [1, 0, 1, 0] and other.steps == 1
    with pytest.raises(ValueError, match="segments cover"):
        other.add_partition("q", torch.zeros(10), segments=[(0, 4, 0)])
    with pytest.raises(ValueError, match="2 flags"):
        other.step({"p": torch.randn(sum(SIZES))}, active={"p": [True, False]})
