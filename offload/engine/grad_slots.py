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
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..comm import Collectives

__all__ = ["GradSlots"]


class GradSlots:
    """Slots (parameters) of each group that had a gradient since the last step."""

    def __init__(self, comm: Collectives) -> None:
        self._comm = comm
        self.segment_slots: dict[int, list[int | None]] = {}  # gid -> slot of each segment
        self._seen: dict[int, set[int]] = {}

    def hook(self, gid: int, slot: int) -> Callable[[torch.Tensor], None]:
        """A tensor hook for a view of slot `slot` of group `gid`."""
        return functools.partial(self._saw, gid, slot)

    def _saw(self, gid: int, slot: int, grad: torch.Tensor) -> None:
        self._seen.setdefault(gid, set()).add(slot)

    def share(self, gid: int, slots: int) -> None:
        """Every rank learns which of the group's `slots` parameters had a gradient on
        any rank (as DDP's reduced gradient exists where any rank made one)."""
        seen = self._seen.setdefault(gid, set())
        counts = self._comm.sum_scalars([1.0 if i in seen else 0.0 for i in range(slots)])
        seen.update(i for i, c in enumerate(counts) if c > 0)

    def active(self, gid: int) -> list[bool]:
        """For each segment of the rank's partition of `gid`: its parameter had a gradient."""
        seen = self._seen.get(gid, set())
        return [i is not None and i in seen for i in self.segment_slots[gid]]

    def clear(self) -> None:
        self._seen.clear()
