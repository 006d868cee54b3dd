"""A cheap check that every rank runs the same unit at the same point of a step.

[Note: ranks run the same units]
Every rank must issue the same all-gathers and reductions in the same order,
so every rank must run the same units in the same order (as DDP requires).
Every block of collectives (a unit's forward: its all-gathers; a unit's
backward: its re-gathers; a group's gradient reduction: the all-reduce of
which parameters had a gradient, then the reduce-scatter) starts with a
check: each rank contributes h = the block's number to one all-reduce of
(h, h^2); the ranks agree iff world * sum(h^2) == sum(h)^2. Inside a block
the collectives follow from its number, so ranks that part ways meet at two
checks, of the same size: the mismatch raises on every rank there, instead of
pairing one rank's all-gather with another's and hanging or mixing weights.
Cost: one all-reduce of two numbers per block (a host synchronisation with
NCCL); `engine.check_rank_order = false` turns it off.
"""

from __future__ import annotations

from ..comm import Collectives
from .units import Unit

__all__ = ["RankOrder"]


class RankOrder:
    """Checks, before each block of collectives (a unit's forward, its backward, a
    group's gradient reduction), that every rank is at the same block."""

    def __init__(self, comm: Collectives, units: list[Unit], enabled: bool) -> None:
        self._comm = comm
        self._index = {id(u): i for i, u in enumerate(units)}
        self._n = len(units)
        self._unit_of: dict[int, str] = {}
        for u in units:
            for gid in u.needs:
                self._unit_of.setdefault(gid, u.name)
        self.enabled = enabled and comm.world > 1

    def check_unit(self, unit: Unit, backward: bool) -> None:
        """Before the collectives of `unit`'s forward (or backward)."""
        if self.enabled:
            self._check(1 + self._index[id(unit)] + (self._n if backward else 0),
                        f"the {'backward' if backward else 'forward'} of unit {unit.name!r}")

    def check_grad(self, gid: int) -> None:
        """Before the reduction of group `gid`'s gradient."""
        if self.enabled:
            self._check(1 + 2 * self._n + gid, f"the gradient reduction of group {gid} (unit "
                        f"{self._unit_of.get(gid, '?')!r})")

    def check_read(self, gid: int) -> None:
        """Before the all-gather of group `gid`'s whole weights (state_dict, full_weights,
        named_weights, save_pretrained, load_state_dict): numbers below zero, apart
        from every block of a step, so a rank that reads the weights while another
        trains (`if rank == 0: engine.state_dict()`, fine under DDP) raises on both
        instead of pairing its all-gathers with the other's forward and waiting for
        the process group's timeout."""
        if self.enabled:
            self._check(-1.0 - gid, f"the all-gather of group {gid}'s whole weights (state_dict, "
                        "full_weights, named_weights, save_pretrained or load_state_dict)",
                        "these gather every rank's shard: call them on every rank at the "
                        "same point, not under `if rank == 0` (state_dict keeps the weights "
                        "on rank 0 only, and save_pretrained writes on rank 0 only, by "
                        "themselves)")

    def _check(self, h: float, what: str, fix: str | None = None) -> None:
        """Raises RuntimeError on every rank if the ranks do not all contribute `h`."""
        total, squares = self._comm.sum_scalars([float(h), float(h) * h])
        if self._comm.world * squares != total * total:
            raise RuntimeError(
                f"rank {self._comm.rank} runs {what} while another rank runs something else "
                "at this point of the step (another module, or a collective such as "
                "state_dict() that every rank must call): " + (fix or
                "every rank must run the same modules in the same "
                "order each step, forward and backward (as under DDP), so that their "
                "all-gathers and reductions pair up. Run every module on every rank, and "
                "let every rank's loss depend on the same modules (e.g. add an unused "
                "branch's output times 0), or keep modules that may be skipped inside a "
                "larger unit (raise engine.group_size) so the skip happens within one unit"))
