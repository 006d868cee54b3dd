"""A cheap check that every rank runs the same unit at the same point of a step.

[Note: ranks run the same units]
Every rank must issue the same all-gathers and reductions in the same order,
so every rank must run the same units in the same order (as DDP requires).
Before a unit's collectives, each rank contributes h = the unit's number
(forward and backward apart) to one all-reduce of (h, h^2): the ranks agree
iff world * sum(h^2) == sum(h)^2. A mismatch raises on every rank at the same
collective, instead of pairing one rank's all-gather with another's and
hanging or mixing weights. Cost: one all-reduce of two numbers per unit and
pass (a host synchronisation with NCCL); `engine.check_rank_order = false`
turns it off.
"""

from __future__ import annotations

from ..comm import Collectives
from .units import Unit

__all__ = ["RankOrder"]


class RankOrder:
    def __init__(self, comm: Collectives, units: list[Unit], enabled: bool) -> None:
        self._comm = comm
        self._index = {id(u): i for i, u in enumerate(units)}
        self._n = len(units)
        self.enabled = enabled and comm.world > 1

    def check(self, unit: Unit, backward: bool) -> None:
        """Raises RuntimeError on every rank if the ranks are not all at `unit`."""
        if not self.enabled:
            return
        h = 1.0 + self._index[id(unit)] + (self._n if backward else 0)
        total, squares = self._comm.sum_scalars([h, h * h])
        if self._comm.world * squares != total * total:
            where = "backward" if backward else "forward"
            raise RuntimeError(
                f"rank {self._comm.rank} runs the {where} of unit {unit.name!r} while another "
                "rank runs a different unit at this point of the step: every rank must run "
                "the same modules in the same order each step (as under DDP), so that their "
                "all-gathers and reductions pair up. Run every module on every rank (e.g. "
                "multiply an unused branch's output by 0), or keep modules that may be "
                "skipped inside a larger unit (raise engine.group_size) so the skip happens "
                "within one unit")
