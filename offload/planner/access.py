"""The access trace of one step and the first look-ahead policy.

[Note: the access trace]
The engine reports every use of a group (`record(gid)`) in order. The first
step follows a static order (the modules' order, given by the engine) while
it records; at `finish()` the recorded order becomes the plan for the next
step. While following a plan, `record` checks each use against it: a use that
differs (dynamic control flow) marks the plan broken for this step, so the
engine falls back to fetching on demand, and the new order is recorded for
the next step. Nothing here touches tensors, files or processes.
"""

from __future__ import annotations

import bisect

__all__ = ["AccessTrace", "lookahead"]


def lookahead(order: list[int], position: int, depth: int) -> list[int]:
    """The next `depth` distinct groups used after `position` in `order`,
    skipping the group at `position` itself (pure function)."""
    if depth <= 0:
        return []
    current = order[position] if 0 <= position < len(order) else None
    out: list[int] = []
    for gid in order[position + 1:]:
        if gid != current and gid not in out:
            out.append(gid)
            if len(out) == depth:
                break
    return out


class AccessTrace:
    """Records the order of group uses in a step and follows it the next step."""

    def __init__(self, static: list[int] | None = None) -> None:
        # the previous step's order; before the first, the static order, if any
        self.plan: list[int] | None = list(static) if static else None
        self._static = self.plan is not None
        self._at: dict[int, list[int]] = {}  # group -> its positions in the plan
        self._index()
        self._current: list[int] = []
        self.broken = False
        self.rerecords = 0  # recorded steps that differed from the one before

    @property
    def following(self) -> bool:
        """True while this step matches the plan so far (prefetch may use it)."""
        return self.plan is not None and not self.broken

    @property
    def position(self) -> int:
        return len(self._current) - 1

    def record(self, gid: int) -> None:
        i = len(self._current)
        self._current.append(gid)
        if self.plan is not None and not self.broken:
            if i >= len(self.plan) or self.plan[i] != gid:
                self.broken = True

    def upcoming(self, depth: int) -> list[int]:
        """Groups the plan says come next (empty when there is no plan or it broke)."""
        if not self.following:
            return []
        return lookahead(self.plan, self.position, depth)

    def finish(self) -> list[int]:
        """Ends the step: its order becomes the next step's plan; returns it."""
        order, self._current = self._current, []
        if self.plan is not None and not self._static and (self.broken or order != self.plan):
            self.rerecords += 1
        self.plan, self.broken, self._static = order, False, False
        self._index()
        return order

    def _index(self) -> None:
        at: dict[int, list[int]] = {}
        for i, gid in enumerate(self.plan or ()):
            at.setdefault(gid, []).append(i)
        self._at = at

    def next_use(self, gid: int) -> int | None:
        """How many uses from now the plan uses `gid` again (wrapping around to the
        next step; a group the plan never uses: twice the step's length); None when
        there is no plan or the step left it."""
        if not self.following:
            return None
        n, i = len(self.plan), self.position
        pos = self._at.get(gid)
        if not pos:
            return 2 * n
        j = bisect.bisect_right(pos, i)
        return (pos[j] if j < len(pos) else pos[0] + n) - i

    def until_end(self) -> int | None:
        """How many uses from now the step's uses end (its update follows); None when
        there is no plan or the step left it."""
        return len(self.plan) - self.position if self.following else None
