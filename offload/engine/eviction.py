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
look-ahead trades those bytes for reads that overlap compute. A prefetch runs
on the compute thread, in a unit's hook, so it never waits
(`TieredStore.prefetch`): a group whose fetch is in flight is skipped, and
one whose room is still being made (a dirty copy's write) is asked for again
at the next unit.

[Note: staging in HOST]
Where DEVICE cannot take a group without evicting a copy needed sooner (a
device tier of one or two groups) but HOST can, the group is read from NVMe
into HOST ahead of its use; the use then only moves it up (a copy over the
bus on a GPU, a hand-over on a CPU device), not from the disk. The plan
counts the memory tiers as one budget, so it already issues such a fetch
that early. With 6 x Linear(256, 256) streaming from NVMe, a device tier of
one group, HOST room for four, and a look-ahead of three, each step after the
first fetched two uses on demand at the use; staged, none.

The engine's records are keyed ("p", gid) for a group's parameter partition,
("p", gid, "staged") for its new partition until the step commits ([Note: all
or nothing] in step.py) and ("g", gid) for its gradient. `next_use_of(trace,
staged, pending)` tells the store's `NextUsePolicy` how far ahead each is
needed, from the access trace the step follows and the step's updates yet to
run (`PendingUpdates`, in the order they run): a gradient whose update is
pending now (held for it, as the plan holds gradients: a reserve, [Note: the
plan] in offload/planner/plan.py), a parameter partition that update reads
as the fp32 master at the update's place in that order; everything else
after all of them, at its group's next use in the trace (forward or
backward, this step or the next);
once the group's update has staged its new partition, that one takes over the
next use and the old one has none (the commit replaces it; only a failed step
reads it again), so the old copy leaves first and the new one stays for the
next forward; a gradient of no pending update at the step's end (with
gradient accumulation a later backward adds to it first; evicting a gradient
costs a write and a read where evicting a parameter copy costs a read).
While the step has left the trace, the store falls back to least recently
used.

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

[Note: the updates' order]
`step()` runs the updates after the trace has finished (its uses then count
from the next step's first), and a gradient's use was "the step's end": in the
update loop every gradient looked farther ahead than every parameter copy, the
nearest of them (the next update's) went first, written and read straight
back, and the parameters the later updates read as the master made room for
the staged copies and were read back too. An 8 x Linear(1024, 1024) step with
parameters streaming and host optimizer state at half the memory of its state
(`offload bench plan`, mlp params 50% fp32) moved 58.8 MB for the plan's 4.2.
Ranking the pending updates' inputs by their place in the update order, ahead
of every other use, keeps them; the old copies the updates replaced leave
instead: 25.2 MB. Holding every pending update's gradient (the plan's model of
them), a later update's master leaves instead of the last update's gradient:
written once, where the gradient cost a write and a read, and read back clean,
so its previous version then leaves for free: 21.0 MB, the plan's bytes.

An early update ([Note: early update] in updates.py) is queued only once its
group's gradient is reduced, after the group's backward; while that backward
ran, the parameters it used looked needed only by the next step, the prefetch
for the next backward evicted them, and the update read them back. The
backward's pre-hook now marks the update as expected (`PendingUpdates.expect`):
its master is needed right after the updates queued. An 8-layer stack with two
layers of each tier read 14.4-15.4 layers a step; with the mark, 10.3-11.3.

[Note: the new copy and the old one's room]
An update stages its new partition in HOST (`StagedParams.new`); on a CPU
device the old one it read often sits in the DEVICE tier, clean and read by
no step again. The planner counts both tiers as one pool of memory
(`packed_budget` in offload/planner/search.py). The store does too: a fetch
that hands a HOST copy up into a full DEVICE tier hands the copies it
displaces down at once ([Note: a hand-over swaps] in
offload/store/executor.py), and the old copy, needed by no step, is the
policy's first victim. The engine once also dropped the old copy itself after
each update and moved the new one up; since the store swaps, that changes
nothing measurable: on a quiet host, over 16 pairs of budgets (HOST 2-6
layers, DEVICE 1-6) for an 8-layer stack streaming its parameters with
optimizer state on NVMe, NVMe bytes per step summed over the pairs were 200.7
layers with it and 201.1 without, each pair within the 0.5 layer two runs of
the same code differ by; `offload bench plan` moved the same bytes in 23 of
24 rows (the other 1.7 MB more, one record).
"""

from __future__ import annotations

import threading
from typing import Callable, Container, Hashable

from ..planner import AccessTrace

__all__ = ["PendingUpdates", "next_use_of", "sooner_than"]


class PendingUpdates:
    """The open step's updates yet to run, in the order they run ([Note: the updates'
    order]); for each, whether it still has to read its parameter partition as the
    fp32 master. Read by the store's policy under the store's lock (every method is
    quick and takes only this object's lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq: dict[int, int] = {}  # gid -> its place among the step's updates
        self._reads: set[int] = set()  # gids whose update has not read its master yet
        self._expected: set[int] = set()  # gids whose backward runs, their update to follow
        self._next = 0
        self._done = 0

    def add(self, *gids: int, reads_master: bool) -> None:
        """Queues the updates of `gids`, in that order, after those queued."""
        with self._lock:
            for gid in gids:
                self._expected.discard(gid)
                if gid not in self._seq:
                    self._seq[gid] = self._next
                    self._next += 1
                if reads_master:
                    self._reads.add(gid)

    def expect(self, gid: int) -> None:
        """`gid`'s backward is running and its early update, reading its parameter
        partition as the master, follows once its gradient is reduced ([Note: the
        updates' order]): that partition is needed right after the updates queued."""
        with self._lock:
            if gid not in self._seq:
                self._expected.add(gid)

    def expected(self, gid: int) -> bool:
        return gid in self._expected

    def read_master(self, gid: int) -> None:
        """`gid`'s update has read its parameter partition: that is not needed for it."""
        with self._lock:
            self._reads.discard(gid)

    def done(self, gid: int) -> None:
        with self._lock:
            self._reads.discard(gid)
            if self._seq.pop(gid, None) is not None:
                self._done += 1

    def clear(self) -> None:
        with self._lock:
            self._seq.clear()
            self._reads.clear()
            self._expected.clear()
            self._next = self._done = 0

    def __len__(self) -> int:
        return len(self._seq)

    def reads_master(self, gid: int) -> bool:
        return gid in self._reads

    def place(self, gid: int) -> int | None:
        """How many pending updates run before `gid`'s (None: not pending); exact while
        they run in the order added, as the update thread and `step()` run them."""
        at = self._seq.get(gid)
        return None if at is None else max(0, at - self._done)


def next_use_of(trace: AccessTrace, staged: Container[int] = (),
                pending: PendingUpdates | None = None) -> Callable[[Hashable], int | None]:
    """`key` -> uses until it is needed again (None: not known or never), for the store's
    policy; `staged`: the groups whose new partition the open step has staged;
    `pending`: the step's updates yet to run, whose inputs are needed before
    anything else (an update counts as one use)."""
    def next_use(key: Hashable) -> int | None:
        if not isinstance(key, tuple) or len(key) not in (2, 3) or key[0] not in ("p", "g"):
            return None
        gid = key[1]
        ahead = 0
        if pending is not None:
            at = pending.place(gid) if len(key) == 2 else None
            if at is not None:  # [Note: the updates' order]
                if key[0] == "g":
                    return 0  # held for its update, as the plan holds it
                if pending.reads_master(gid):
                    return at
            elif len(key) == 2 and key[0] == "p" and pending.expected(gid):
                return len(pending)  # its update runs after those queued
            ahead = len(pending)  # every pending update comes first
        if len(key) == 3:  # ("p", gid, "staged"): the next forward reads it
            d = trace.next_use(gid) if key[2] == "staged" else None
        elif key[0] == "g":
            d = trace.until_end()
        else:
            d = None if gid in staged else trace.next_use(gid)
        return None if d is None else ahead + d
    return next_use


def sooner_than(trace: AccessTrace, gid: int, staged: Container[int] = (),
                pending: PendingUpdates | None = None) -> Callable[[Hashable], bool]:
    """`key` -> True where the step needs that copy no later than group `gid`'s next
    use ([Note: prefetch room])."""
    at = trace.next_use(gid)
    if at is not None and pending is not None:
        at += len(pending)
    next_use = next_use_of(trace, staged, pending)

    def sooner(key: Hashable) -> bool:
        d = next_use(key)
        return at is not None and d is not None and d <= at
    return sooner
