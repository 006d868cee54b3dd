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

The engine's records are keyed ("p", gid) for a group's parameter partition,
("p", gid, "staged") for its new partition until the step commits ([Note: all
or nothing] in step.py) and ("g", gid) for its gradient. `next_use_of(trace,
staged)` tells the store's `NextUsePolicy` how far ahead each is needed, from
the access trace the step follows: a parameter at its group's next use
(forward or backward, this step or the next); once the group's update has
staged its new partition, that one takes over the next use and the old one
has none (the commit replaces it; only a failed step reads it again), so the
old copy leaves first and the new one stays for the next forward; a parameter
whose group's update is queued (early, [Note: early update] in engine.py) and
reads it as the fp32 master, now; a gradient
at the step's end, where the update reads it (with gradient accumulation a
later backward adds to it first; the end is the farther guess, and evicting
a gradient costs a write and a read where evicting a parameter copy costs a
read). While the step has left the trace, the store falls back to least
recently used.

[Note: the staged copy stays]
Before this, a staged partition had no known next use and the old one kept
its group's: under budgets below the parameters' bytes every update's output
left memory first, written down, and was read back by the next forward while
old copies no step would read again held the room. A 6 x Linear(4096, 4096)
step streaming its parameters read 1,477 MB and wrote 1,208 MB where the
forced bytes are 1,074 / 889 (docs/benchmarks.md). Likewise a group's
parameters, used by its backward, looked needed only by the next step while
its early update, about to read them as the master, was queued: a prefetch
for the next backward evicted them and the update read them back. With both
rules the same step read 1,410 MB; the writes stay at 1,208 MB: with less
memory than parameters, every updated partition still leaves memory dirty
once before its next update, during the next forward or backward.
"""

from __future__ import annotations

from typing import Callable, Container, Hashable

from ..planner import AccessTrace

__all__ = ["next_use_of", "sooner_than"]


def next_use_of(trace: AccessTrace, staged: Container[int] = (), queued: Container[int] = ()
                ) -> Callable[[Hashable], int | None]:
    """`key` -> uses until it is needed again (None: not known or never), for the store's
    policy; `staged`: the groups whose new partition the open step has staged;
    `queued`: the groups whose update is queued and will read their parameter
    partition (the fp32 master) first: needed now."""
    def next_use(key: Hashable) -> int | None:
        if not isinstance(key, tuple) or len(key) not in (2, 3) or key[0] not in ("p", "g"):
            return None
        gid = key[1]
        if len(key) == 3:  # ("p", gid, "staged"): the next forward reads it
            return trace.next_use(gid) if key[2] == "staged" else None
        if key[0] == "g":
            return trace.until_end()
        if gid in staged:
            return None
        return 0 if gid in queued else trace.next_use(gid)
    return next_use


def sooner_than(trace: AccessTrace, gid: int, staged: Container[int] = (),
                queued: Container[int] = ()) -> Callable[[Hashable], bool]:
    """`key` -> True where the step needs that copy no later than group `gid`'s next
    use ([Note: prefetch room])."""
    at = trace.next_use(gid)
    next_use = next_use_of(trace, staged, queued)

    def sooner(key: Hashable) -> bool:
        d = next_use(key)
        return at is not None and d is not None and d <= at
    return sooner
