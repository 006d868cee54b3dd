"""What the store evicts when a tier is full: the copy the step needs last.

[Note: prefetch room]
A prefetch that evicts a copy needed before the group it fetches costs a read
it was meant to save: the evicted copy comes back at its use, on demand. So
the engine prefetches a group only where the store can make room by evicting
copies needed after it (`TieredStore.fits_sparing` with `sooner_than`), and
stops at the first group that does not fit so (the ones after it are needed
later still). With a 6-layer MLP streaming from NVMe, a device tier of two
layers and a look-ahead of three, a step read 31 layer copies for its 12 uses;
sparing, 10. Each group fetched ahead still holds room that would otherwise
keep a copy (without look-ahead the same step read 7, all on demand): the
look-ahead trades those bytes for reads that overlap compute.

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

__all__ = ["next_use_of", "sooner_than"]


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


def sooner_than(trace: AccessTrace, gid: int) -> Callable[[Hashable], bool]:
    """`key` -> True where the step needs that copy no later than group `gid`'s next
    use ([Note: prefetch room])."""
    at = trace.next_use(gid)
    next_use = next_use_of(trace)

    def sooner(key: Hashable) -> bool:
        d = next_use(key)
        return at is not None and d is not None and d <= at
    return sooner
