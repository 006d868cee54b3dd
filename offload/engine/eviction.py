"""What the store evicts when a tier is full: the copy the step needs last.

The engine's records are keyed ("p", gid) for a group's parameter partition and
("g", gid) for its gradient. `next_use_of(trace)` tells the store's
`NextUsePolicy` how far ahead each is needed, from the access trace the step
follows: a parameter at its group's next use (forward or backward, this step or
the next), a gradient at the step's end, where the update reads it (with
gradient accumulation a later backward adds to it first; the end is the
farther guess, and evicting a gradient costs a write and a read where
evicting a parameter copy costs a read). While the step has left the trace,
the store falls back to least recently used.
"""

from __future__ import annotations

from typing import Callable, Hashable

from ..planner import AccessTrace

__all__ = ["next_use_of"]


def next_use_of(trace: AccessTrace) -> Callable[[Hashable], int | None]:
    """`key` -> uses until it is needed again (None: not known), for the store's policy."""
    def next_use(key: Hashable) -> int | None:
        if not (isinstance(key, tuple) and len(key) == 2):
            return None
        kind, gid = key
        if kind == "p":
            return trace.next_use(gid)
        if kind == "g":
            return trace.until_end()
        return None
    return next_use
