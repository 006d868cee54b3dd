"""The prefetch plan: every fetch, eviction and write-back of one step, computed from
its access trace under a memory budget (pure functions: no tensors, files or threads).

[Note: the plan]
The input is one step's access trace: a sequence of uses, each naming the
records that must be in memory while it runs (a unit's parameter partitions
in forward or backward; a group's optimizer state at its update) and the
ones it modifies. Records live on NVMe unless resident; memory holds at most
`budget` bytes, counting every resident record and every fetch in flight.
`make_plan` walks the uses in order and, when a record is missing, evicts
the resident record whose next use is farthest away (uses wrap around to the
next step's, so the plan is the steady state of a loop of steps), clean
copies before dirty ones among equals, then the first in `records`' order (never
a set's, whose order changes with the process's string hashing, so the same
inputs give the same plan everywhere): a clean copy is dropped, a dirty one
is written back first, issued right after the record's last use and naming
the use whose room it makes (which cannot start before it is done). Each
fetch is then issued as early as the budget allows (at the earliest point
from which its bytes fit until its use, after the record's own previous use)
and no earlier than the fetch before it (the disk serves them in order). The
result lists every operation with the point of the trace it is issued at and
the one it is needed at, the bytes read and written, and the bytes held at
every point, which never exceed the budget.
`lru_bytes` is the same walk with on-demand fetches and least-recently-used
eviction: the baseline a plan is measured against.

[Note: the plan against LRU's victims]
With records of different sizes, or dirty ones, farthest-next-use is a heuristic: it
may write back a large state where dropping a small clean parameter would do. So
where its steady plan (every step after the first, the one that counts) moves more
bytes than `lru_bytes`, or does not fit, the walk is run again with LRU's own
victims, in LRU's order, and the plan whose steady step moves fewer bytes is kept
(its first step's plan with it: the steady plan starts from what that one leaves).
Where that one still moves more or does not fit, LRU's walk itself is run: its
victims without the rules against round trips ([Note: no round trips]), ties in
`lru_bytes`' order (a use's records, then the previous versions it keeps), so its
steady step fits and moves exactly `lru_bytes`' bytes wherever LRU's does, and the
steady plan never moves more. Why the others may move more, step after step: a
record that farthest-next-use, or those rules, keep in memory dirty to the step's
end (never written back, where LRU writes it and reads it again) starts the next
step dirty, and each update there that keeps its previous version keeps a dirty one,
whose room may be a write every step (an fp32 parameter partition of a staged
commit: 45056 bytes a modelled step where LRU moves 32768:
test_a_modelled_staged_step_moves_no_more_than_lru in
tests/planner/test_search_edges.py). A record of no bytes is never a victim: it
frees nothing (`lru_bytes` may take one; the bytes are the same). In the steady
state LRU's order of use runs on from the step before (the previous step's uses came
before this step's; `lru_bytes` counted them as this step's indices before, a record
used late in the last step looking more recent than one just used).

[Note: previous versions]
A step commits as a whole (offload/engine/step.py): where an update cannot
change its parameter partition in place, the partition's previous version
stays beside the new one until the commit, in memory or on NVMe, since a
failed step goes back to it. A use lists such partitions in `previous`: from
that use on, the record's version before it is a record of its own,
`(key, "previous")`, of the same bytes, resident and dirty where the record
was (a version already on NVMe costs nothing to drop; one only in memory is
written if it must leave), needed by no use (it leaves first); the use that
lists it in `drops` (the commit) frees it without a write. A partition the
update writes without reading it (`fresh`: the master is kept apart, so the
update only writes the compute-dtype copy) is not fetched where it is not
resident: the new version takes room, dirty, and the old one, already on NVMe
only, leaves no previous version in memory. A partition the update reads (its
own fp32 master) keeps a previous version only where it is dirty: a clean copy
is overwritten in place, its NVMe copy being the old version ([Note: the
update in the old copy's memory] in offload/engine/step.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Container, Hashable, Mapping, Sequence

__all__ = ["Plan", "PlanOp", "RecordSpec", "Use", "lru_bytes", "make_plan", "previous_key"]


def previous_key(key: Hashable) -> Hashable:
    """The record of `key`'s version before an update that keeps it ([Note: previous
    versions])."""
    return (key, "previous")


@dataclass(frozen=True)
class RecordSpec:
    """A record the trace uses: its bytes, and whether it starts resident (and dirty)."""

    nbytes: int
    resident: bool = False
    dirty: bool = False

    def __post_init__(self) -> None:
        if not self.nbytes >= 0:  # NaN too
            raise ValueError(f"nbytes must be a number of bytes >= 0, got {self.nbytes}")


@dataclass(frozen=True)
class Use:
    """One point of the access trace: `keys` must be resident while it runs; `writes`
    (a subset of `keys`) are modified by it. `kind` (forward, backward, update, ...),
    `label` (the unit or group), `compute_s` (its measured compute time, seconds) and
    `lane` (the thread that runs it: "compute", or another, e.g. the engine's update
    thread; [Note: the simulated step]) are carried along for the simulator and the
    trace. `reserved`: bytes of the budget that something outside the trace's records
    holds while it runs (e.g. gradients kept in memory from their backward to their
    update); the records get the rest. `previous` (a subset of `writes`): records whose
    version before this use is kept as `(key, "previous")`; `drops`: such versions
    freed after this use; `fresh` (a subset of `writes`): records it overwrites
    without reading, not fetched when absent ([Note: previous versions])."""

    keys: tuple[Hashable, ...]
    writes: tuple[Hashable, ...] = ()
    kind: str = "use"
    label: str = ""
    compute_s: float = 0.0
    lane: str = "compute"
    reserved: int = 0
    previous: tuple[Hashable, ...] = ()
    drops: tuple[Hashable, ...] = ()
    fresh: tuple[Hashable, ...] = ()


@dataclass(frozen=True)
class PlanOp:
    """One operation: `op` is "fetch", "write-back" or "evict"; `at` the index of the
    use it is issued before; `needed_at` the use that needs a fetched record, or the
    room a write-back or eviction makes (the simulator's use waits for that room);
    `follows`, of a write-back: the last use of what it writes, whose end it waits for
    (None: none in the step)."""

    op: str
    key: Hashable
    nbytes: int
    at: int
    needed_at: int | None = None
    follows: int | None = None


@dataclass
class Plan:
    """The schedule of one step ([Note: the plan])."""

    ops: list[PlanOp]
    budget: int
    held: list[int]            # bytes resident or in flight while each use runs
    bytes_read: int = 0
    bytes_written: int = 0
    fetches_by_use: dict[int, list[PlanOp]] = field(default_factory=dict)
    # made with the rules against round trips; LRU's own walk has none ([Note: the plan
    # against LRU's victims])
    stays: bool = True

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


def _check(uses: Sequence[Use], records: Mapping[Hashable, RecordSpec], budget: int) -> None:
    if not budget >= 0:  # NaN too
        raise ValueError(f"budget {budget} must be a number of bytes >= 0")
    previous = {previous_key(k) for k in records}
    for k in records:  # the walk would take it for the previous version it is named as
        if k in previous:
            raise ValueError(f"record {k!r} is named as the previous version of record "
                             f"{k[0]!r} (previous_key({k[0]!r})): give it another key")
    for i, use in enumerate(uses):
        unknown = [k for k in use.keys if k not in records]
        if unknown:
            raise ValueError(f"use {i} names records {unknown[:4]} that are not described")
        stray = [k for k in use.writes if k not in use.keys]
        if stray:
            raise ValueError(f"use {i} writes {stray[:4]}, which it does not use")
        for field_, what in (("previous", "keeps the previous version of"),
                             ("fresh", "overwrites")):
            stray = [k for k in getattr(use, field_) if k not in use.writes]
            if stray:
                raise ValueError(f"use {i} {what} {stray[:4]}{' whole' * (field_ == 'fresh')}"
                                 f", which it does not write (Use.{field_} is a part of "
                                 "Use.writes)")
        for pk in use.drops:  # a drop frees without a write: only a previous version may go
            if pk not in previous:
                raise ValueError(f"use {i} drops {pk!r}, which is no previous version "
                                 "(previous_key(k) of a record k): a drop frees it unwritten")
        if not use.reserved >= 0:
            raise ValueError(f"use {i} ({use.kind} {use.label}) reserves {use.reserved} "
                             "bytes; a reserve is a number of bytes >= 0")
        keys = dict.fromkeys(use.keys)
        need = sum(records[k].nbytes for k in keys) + use.reserved
        if need > budget:
            big = sorted(keys, key=lambda k: -records[k].nbytes)[:4]
            names = ", ".join(f"{k!r} ({records[k].nbytes} bytes)" for k in big)
            raise ValueError(f"use {i} ({use.kind} {use.label}) needs {need} bytes at once, "
                             f"more than the budget of {budget}: records {names}"
                             f"{'' if len(keys) <= 4 else ', ...'}, reserved {use.reserved}")
    start = sum(r.nbytes for r in records.values() if r.resident)
    if start > budget:
        raise ValueError(f"the records resident at the start hold {start} bytes, more than "
                         f"the budget of {budget}")


class _NextUse:
    """Next use of a key after a point, the trace wrapping around to the next step."""

    def __init__(self, uses: Sequence[Use]) -> None:
        self.n = len(uses)
        self.at: dict[Hashable, list[int]] = {}
        for i, use in enumerate(uses):
            for k in dict.fromkeys(use.keys):
                self.at.setdefault(k, []).append(i)

    def after(self, key: Hashable, i: int) -> int:
        pos = self.at.get(key)
        if not pos:
            return 1 << 62  # never used: the best victim
        j = bisect.bisect_right(pos, i)
        return pos[j] if j < len(pos) else pos[0] + self.n


def make_plan(uses: Sequence[Use], records: Mapping[Hashable, RecordSpec],
              budget: int, steady: bool = False) -> Plan:
    """The plan of one step ([Note: the plan]). `steady`: the plan of the step that
    follows this one in a loop (it starts with what the first left resident and
    dirty), instead of the first. Raises ValueError when a use needs more than
    `budget` at once (its records, its reserve and, where the walk keeps them, the
    previous versions of what it updates), a use names an unknown record, `previous`
    or `fresh` names a record the use does not write, `drops` names anything but a
    previous version, a record's key is another's previous version (`previous_key`),
    or a budget or reserve is not a number of bytes >= 0."""
    _check(uses, records, budget)
    nxt = _NextUse(uses)

    def walks(lru_order: bool, stays: bool) -> tuple[Plan, Plan | ValueError]:
        """The first step's plan and the steady one after it (the ValueError that says
        why where that does not fit: a first step's plan may still), with one victim
        rule; raises the ValueError of a first step that does not fit."""
        size = {k: r.nbytes for k, r in records.items()}
        resident = {k for k, r in records.items() if r.resident}
        dirty = {k for k, r in records.items() if r.dirty and r.resident}
        recent = {k: -1 for k in records if k in resident} if lru_order else None
        first = _walk(uses, size, nxt, budget, resident, dirty, recent, stays)
        if recent is not None:  # the next step's order of use: this one's came before
            for k in list(recent):
                recent[k] -= len(uses)
        try:
            return first, _walk(uses, size, nxt, budget, resident, dirty, recent, stays)
        except ValueError as e:
            return first, e

    def cost(plans: tuple[Plan, Plan | ValueError]) -> tuple[float, int]:
        after = plans[1].bytes_moved if isinstance(plans[1], Plan) else math.inf
        return after, plans[0].bytes_moved
    # [Note: the plan against LRU's victims]
    try:
        lru = sum(lru_bytes(uses, records, budget, True))
    except ValueError:  # LRU's steady step does not fit: the plan's may still
        lru = None
    best: tuple[Plan, Plan | ValueError] | None = None
    error: ValueError | None = None
    for lru_order, stays in ((False, True), (True, True), (True, False)):
        if best is not None and isinstance(best[1], Plan) and \
                (lru is None or best[1].bytes_moved <= lru):
            break  # the steady plan fits and moves no more than LRU
        if not stays and lru is None:
            break  # LRU's own walk: its steady step does not fit either
        try:
            plans = walks(lru_order, stays)
        except ValueError as e:
            error = error or e
            continue
        if best is None or cost(plans) < cost(best):
            best = plans
    if best is None:
        raise error  # type: ignore[misc]
    if not steady:
        return best[0]
    if isinstance(best[1], ValueError):
        raise best[1]
    return best[1]


def _too_big(i: int, use: Use, need: set, size: Mapping[Hashable, int], short: int,
             budget: int) -> None:
    """Raises the ValueError of a use whose records, with the previous versions it keeps
    ([Note: previous versions]) and its reserve, do not fit the budget at once."""
    # the largest first, equals by name: the message is the same in every process
    held = sorted(((size[k], k) for k in need if k in size), key=lambda t: (-t[0], repr(t[1])))
    names = ", ".join(f"{k!r} ({n} bytes)" for n, k in held[:4])
    raise ValueError(f"use {i} ({use.kind} {use.label}) needs {short} bytes more than the "
                     f"budget of {budget} leaves: its records {names}, reserved "
                     f"{use.reserved}; the previous versions it keeps count beside their "
                     "records")


def _kept(use: Use, present: Container[Hashable], dirty: Container[Hashable]
          ) -> list[Hashable]:
    """The records whose previous version `use` keeps in memory ([Note: previous
    versions]): a fresh one that is resident, and one the update reads that is dirty
    (its only copy in memory); a fresh one absent from memory and a clean one the
    update reads (its NVMe copy is the old version) leave none."""
    return [k for k in use.previous if (k in present if k in use.fresh else k in dirty)]


def _walk(uses: Sequence[Use], size: dict, nxt: _NextUse, budget: int, resident: set,
          dirty: set, recent: dict | None = None, stays: bool = True) -> Plan:
    """make_plan's walk from `resident` and `dirty`, which it leaves as the step ends.
    Victims go farthest next use first; with `recent` (each resident record -> its
    last use, in the order `lru_bytes` keeps, kept up to date), least recently used
    first, as `lru_bytes` chooses them ([Note: the plan against LRU's victims]).
    `stays`: a record that left may stay instead of being read back ([Note: no round
    trips]); without, with `recent`, the walk moves the bytes `lru_bytes` counts."""
    last = {k: -1 for k in resident}     # last use of each resident record (-1: none yet)
    rank = {k: n for n, k in enumerate(size)}  # ties go by the records' order, not a set's
    held = [0] * len(uses)
    plan = Plan([], budget, held, stays=stays)
    prev_issue = 0
    used = sum(size[k] for k in resident)  # bytes of the resident records
    gone: dict[Hashable, tuple[int, bool]] = {}  # record -> (its eviction's op, written)
    fetched: list[tuple[int, int, tuple[int, bool] | None]] = []  # (op, own floor, left)
    for i, use in enumerate(uses):
        held[i] += used + use.reserved
        need = set(use.keys) | {previous_key(k) for k in use.previous}
        room = budget - use.reserved

        def make_room(n: int) -> None:
            """Evicts until `n` more bytes fit."""
            nonlocal used
            while used + n > room:
                # a record of no bytes frees nothing: its eviction (and write-back) would
                # only hold up the use it makes "room" for
                victims = {r for r in resident - need if size[r]}
                if not victims:
                    _too_big(i, use, need, size, n - (room - used), budget)
                victim = (max(victims, key=lambda r: (nxt.after(r, i), r not in dirty, -rank[r]))
                          if recent is None else
                          min((r for r in recent if r in victims), key=recent.__getitem__))
                if recent is not None:
                    del recent[victim]
                end = last.get(victim, -1)
                wrote = victim in dirty
                if wrote:
                    plan.ops.append(PlanOp("write-back", victim, size[victim], end + 1, i,
                                           end if end >= 0 else None))
                    plan.bytes_written += size[victim]
                    dirty.discard(victim)
                plan.ops.append(PlanOp("evict", victim, size[victim], end + 1, i))
                gone[victim] = (len(plan.ops) - 1, wrote)
                resident.discard(victim)
                used -= size[victim]
                for t in range(end + 1, i + 1):  # free from just after its last use
                    held[t] -= size[victim]
        make_room(0)  # the reserve grew
        kept = _kept(use, resident, dirty)
        for k in dict.fromkeys(use.keys):
            if k in resident:
                continue
            make_room(size[k])
            resident.add(k)
            used += size[k]
            left = gone.pop(k, None)  # (its eviction in plan.ops, whether it was written)
            if k in use.fresh:  # written whole: room, no read
                held[i] += size[k]
                continue
            own = last.get(k, -1) + 1  # after its previous use: where it left, if it did
            if stays and left is not None and not (left[1] and k in use.previous) and \
                    all(held[t] + size[k] <= budget for t in range(own, i)):
                _stay(plan, left, k, size[k], own, i)  # [Note: no round trips]
                if left[1]:
                    dirty.add(k)
                continue
            issue = i
            floor = max(prev_issue, own)
            while issue > floor and held[issue - 1] + size[k] <= budget:
                issue -= 1
            for t in range(issue, i + 1):
                held[t] += size[k]
            prev_issue = issue
            op = PlanOp("fetch", k, size[k], issue, i)
            plan.ops.append(op)
            fetched.append((len(plan.ops) - 1, own, left))
            plan.bytes_read += size[k]
        new = []  # the previous versions this use adds
        for k in kept:  # [Note: previous versions]
            pk = previous_key(k)
            if pk in resident:  # an earlier update of the step keeps the step's own
                continue
            size[pk] = size[k]
            rank.setdefault(pk, len(rank))
            make_room(size[pk])
            resident.add(pk)
            used += size[pk]
            held[i] += size[pk]
            new.append(pk)
            if k in dirty:
                dirty.add(pk)
        dirty.update(use.writes)
        for k in need:
            last[k] = i
        if recent is not None:  # lru_bytes' order: the use's records, then those versions
            for k in [*dict.fromkeys(use.keys), *new]:
                recent[k] = i
        for pk in use.drops:  # freed after this use, never written
            if recent is not None:
                recent.pop(pk, None)
            if pk in resident:
                resident.discard(pk)
                used -= size[pk]
            dirty.discard(pk)
            gone.pop(pk, None)
    dirty.update(_hoist(plan, fetched, uses, stays))
    return plan


def _stay(plan: Plan, left: tuple[int, bool], key: Hashable, nbytes: int, start: int,
          end: int) -> None:
    """`key` stays in memory from `start` (where it left) through use `end` instead of
    leaving there and being read back: its eviction, and its write-back if it was
    written, are undone ([Note: no round trips])."""
    n, wrote = left
    plan.ops[n] = None  # type: ignore[call-overload]  # removed below, in _hoist
    if wrote:
        back = plan.ops[n - 1]
        if back is None or back.op != "write-back" or back.key != key:
            raise RuntimeError(f"plan: the eviction of {key!r} at op {n} follows {back}, "
                               "expected its write-back")
        plan.ops[n - 1] = None  # type: ignore[call-overload]
        plan.bytes_written -= nbytes
    for t in range(start, end + 1):
        plan.held[t] += nbytes


def _hoist(plan: Plan, fetched: list[tuple[int, int, tuple[int, bool] | None]],
           uses: Sequence[Use], stays: bool = True) -> set:
    """Issues each fetch as early as the finished plan allows: the walk placed it
    before the evictions of later uses freed room from the victims' last uses on. In
    the fetches' order, none before the one ahead of it nor its record's previous use;
    with `stays`, a record whose bytes now fit from where it left until its use stays
    instead, a written one only where staying dirty changes nothing the walk decided
    after (`_dirty_until`); otherwise it is read no earlier than the use after the one it
    was written out at. Returns the records that stay dirty to the step's end.
    [Note: no round trips]"""
    prev, held, budget = 0, plan.held, plan.budget
    ended_dirty = set()
    evictions: dict[Hashable, list[int]] = {}  # record -> its evictions' places in ops
    for n, op in enumerate(plan.ops):
        if op is not None and op.op == "evict":
            evictions.setdefault(op.key, []).append(n)
    for n, own, left in fetched:
        op = plan.ops[n]
        at = op.at
        if left is not None and plan.ops[left[0]] is not None:
            fits = stays and all(held[t] + op.nbytes <= budget for t in range(own, at))
            until = _dirty_until(plan, uses, n, evictions[op.key]) if fits and left[1] else 0
            if fits and until >= 0:
                _stay(plan, left, op.key, op.nbytes, own, at - 1)
                plan.ops[n] = None  # type: ignore[call-overload]
                plan.bytes_read -= op.nbytes
                if until == len(uses):
                    ended_dirty.add(op.key)
                continue
            own += left[1]  # not read back at the point it was written out
        while at > max(prev, own) and held[at - 1] + op.nbytes <= budget:
            at -= 1
            held[at] += op.nbytes
        if at != op.at:
            plan.ops[n] = op = PlanOp("fetch", op.key, op.nbytes, at, op.needed_at)
        prev = at
    plan.ops[:] = [op for op in plan.ops if op is not None]
    plan.fetches_by_use = {}
    for op in plan.ops:
        if op.op == "fetch":
            plan.fetches_by_use.setdefault(op.needed_at, []).append(op)
    return ended_dirty


def _dirty_until(plan: Plan, uses: Sequence[Use], n: int, evictions: list[int]) -> int:
    """Where the record fetched by `plan.ops[n]`, written out before, would be written
    again had it stayed dirty instead (len(uses): never, it ends the step dirty), or -1
    where staying dirty would change what the walk decided for it as a clean record:
    an update up to that write that keeps a dirty record's previous version, or one of
    its `evictions` (places in ops) after the fetch and before that write, which writes
    nothing back ([Note: previous versions])."""
    key, i = plan.ops[n].key, plan.ops[n].needed_at
    until = next((j for j in range(i, len(uses)) if key in uses[j].writes), len(uses))
    if any(key in u.previous and key not in u.fresh for u in uses[i:until + 1]):
        return -1
    if any(e > n and plan.ops[e] is not None and plan.ops[e].needed_at < until
           for e in evictions):
        return -1
    return until


# [Note: no round trips]
# The walk decides victims use by use, and an eviction at a later use frees its victim's
# bytes from the victim's last use on, at points the walk has passed. So a record that
# left at one use may, by the time it is needed again, fit beside everything the plan
# holds from where it left until then: it stays (its eviction, and its write-back if
# it was dirty, are undone, with no read), rather than leave and be read back; but a
# written one stays only where the use does not keep its previous version (it would
# then keep a dirty record's, whose room the use did not make). After the walk, a
# written one whose room the finished plan has stays too where being dirty changes
# nothing decided after: no update up to its next write keeps its previous version,
# and it does not leave again, clean, before that write; where it is never written
# again it ends the step dirty, which the steady plan starts from. And a
# fetch placed before a later eviction freed room can then be issued earlier: after the
# walk, each fetch moves up into the room the finished plan leaves, in the fetches'
# order. Both only ever lower the bytes the step moves and move reads earlier (a record
# kept dirty to the step's end may cost the next step more: [Note: the plan against
# LRU's victims]); the plan still holds at most the budget at every use
# (tests/planner/test_planner_edges.py).


def lru_bytes(uses: Sequence[Use], records: Mapping[Hashable, RecordSpec],
              budget: int, steady: bool = False) -> tuple[int, int]:
    """(bytes read, bytes written) of on-demand fetches with least-recently-used
    eviction under the same budget: the baseline (`steady` as for make_plan)."""
    _check(uses, records, budget)
    size = {k: r.nbytes for k, r in records.items()}
    recent: dict[Hashable, int] = {k: -1 for k, r in records.items() if r.resident}
    dirty = {k for k, r in records.items() if r.dirty and r.resident}
    moved = _lru_walk(uses, size, budget, recent, dirty)
    if not steady:
        return moved
    # the next step's order of use: this step's uses came before all of its own (they
    # kept this step's indices, so a record last used late in it counted as more recent
    # than one the next step had just used)
    return _lru_walk(uses, size, budget, {k: i - len(uses) for k, i in recent.items()}, dirty)


def _lru_walk(uses: Sequence[Use], size: dict, budget: int, recent: dict, dirty: set
              ) -> tuple[int, int]:
    read = written = 0
    used = sum(size[k] for k in recent)  # bytes of the resident records
    for i, use in enumerate(uses):
        need = set(use.keys) | {previous_key(k) for k in use.previous}
        room = budget - use.reserved

        def make_room(n: int) -> None:
            nonlocal used, written
            while used + n > room:
                victims = [r for r in recent if r not in need]
                if not victims:
                    _too_big(i, use, need, size, n - (room - used), budget)
                victim = min(victims, key=recent.__getitem__)
                if victim in dirty:
                    written += size[victim]
                    dirty.discard(victim)
                del recent[victim]
                used -= size[victim]
        make_room(0)  # the reserve grew
        kept = _kept(use, recent, dirty)
        for k in dict.fromkeys(use.keys):
            if k not in recent:
                make_room(size[k])
                used += size[k]
                read += 0 if k in use.fresh else size[k]
            recent[k] = i
        for k in kept:
            pk = previous_key(k)
            if pk in recent:  # an earlier update of the step keeps the step's own
                continue
            size[pk] = size[k]
            make_room(size[pk])
            recent[pk] = i
            used += size[pk]
            if k in dirty:
                dirty.add(pk)
        dirty.update(use.writes)
        for pk in use.drops:
            if recent.pop(pk, None) is not None:
                used -= size[pk]
            dirty.discard(pk)
    return read, written
