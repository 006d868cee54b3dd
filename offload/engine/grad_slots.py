"""Which parameters had a gradient in the open step.

[Note: parameters without a gradient]
torch leaves a parameter whose `.grad` is None after backward untouched by the
step: no weight decay, no moment decay, no step count. A group's flat gradient
cannot tell (SplitBackward fills unused views with zeros), so each bound view
that requires grad gets a tensor hook (`GradSlots.hook`) that records, when
backward computes the view's gradient, that its slot had one: summed over the
step's micro-batches and, with several ranks, over ranks before the reduction
(`share`). The update then names the segments of the rank's partition whose
parameter had a gradient (`active`; [Note: segments] in
offload/optim/optimizer.py); the others keep their weights, moments and Adam
step. A group none of whose parameters had a gradient is not updated at all
(its flat gradient hook never fires).

[Note: sparse gradients]
`nn.Embedding(sparse=True)` and `nn.EmbeddingBag(sparse=True)` give their weight
a sparse gradient, which the view of the group's flat buffer cannot pass on
(autograd's view backward raised "reshape is not implemented for sparse
tensors"; a tensor hook may not change a gradient's layout). Such a module's
weight is bound as `dense_grad(view)`, an identity whose backward hands the
gradient on dense: the flat gradient is dense anyway, and the engine's AdamW
updates every row, as with `sparse=False` (torch's AdamW refuses sparse
gradients; there is no lazy update of only the rows looked up, as torch's
SparseAdam does).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from ..comm import Collectives

__all__ = ["GradSlots", "dense_grad", "sparse_grad_use"]


def sparse_grad_use(module: nn.Module, name: str) -> bool:
    """Whether attribute `name` of `module` gets a sparse gradient ([Note: sparse
    gradients])."""
    return (name == "weight" and isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and bool(module.sparse))


class _DenseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to_dense() if grad.layout != torch.strided else grad


def dense_grad(view: torch.Tensor) -> torch.Tensor:
    """`view` itself, whose gradient reaches the flat buffer dense ([Note: sparse
    gradients])."""
    return _DenseGrad.apply(view) if view.requires_grad else view


class GradSlots:
    """Slots (parameters) of each group that had a gradient since the last step."""

    def __init__(self, comm: Collectives) -> None:
        self._comm = comm
        self.segment_slots: dict[int, list[int | None]] = {}  # gid -> slot of each segment
        self._seen: dict[int, set[int]] = {}

    def hook(self, gid: int, slot: int,
             frozen: Callable[[int, int], bool]) -> Callable[[torch.Tensor], Any]:
        """A tensor hook for a view of slot `slot` of group `gid`; `frozen(gid, slot)`:
        whether the parameter has `requires_grad` False now."""
        return functools.partial(self._saw, gid, slot, frozen)

    def _saw(self, gid: int, slot: int, frozen: Callable[[int, int], bool],
             grad: torch.Tensor) -> torch.Tensor | None:
        if frozen(gid, slot):  # [Note: freezing after initialize] in params_view.py
            return torch.zeros_like(grad)
        self._seen.setdefault(gid, set()).add(slot)
        return None

    def share(self, gid: int, slots: int) -> None:
        """Every rank learns which of the group's `slots` parameters had a gradient on
        any rank (as DDP's reduced gradient exists where any rank made one)."""
        seen = self._seen.setdefault(gid, set())
        counts = self._comm.sum_scalars([1.0 if i in seen else 0.0 for i in range(slots)])
        seen.update(i for i, c in enumerate(counts) if c > 0)

    def had(self, gid: int, slot: int) -> bool:
        """Whether the parameter in `slot` of `gid` had a gradient since the last step."""
        return slot in self._seen.get(gid, ())

    def active(self, gid: int) -> list[bool]:
        """For each segment of the rank's partition of `gid`: its parameter had a gradient."""
        seen = self._seen.get(gid, set())
        return [i is not None and i in seen for i in self.segment_slots[gid]]

    def clear(self) -> None:
        self._seen.clear()
