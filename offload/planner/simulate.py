"""Step-time simulator: a plan and measured rates -> the predicted step, as an event
trace in the format of a measured one (pure computation: no tensors, files or threads).

[Note: the simulated step]
Compute runs the uses one after the other, each taking its `compute_s`. The
simulation advances from event to event: the next is whichever comes first of
a use that can start (among those whose predecessors have started: the use
before it on its lane, and the uses it follows) and the disk ending an
operation or an operation falling due. So the disk receives the plan's
operations in the order of time they are issued rather than of the trace (an
update lane's later chunk comes before the next backward in the trace, but is
issued after it when the update before it runs long); a use that follows one
starting later still runs after it. The disk serves them one at a time in the
order they fall due: an operation issued before use i is due when use i is
about to start, a write-back no earlier than the end of the last use of what
it writes (`PlanOp.follows`), without holding back the use that issues it or
the operations behind it (a chunk the update lane wrote is written back while
the next backward runs, as the engine's update thread does), a fetch once the
write-backs issued before it that make room for its use or an earlier one are
done (it may read into that room; a later use's room may be written only after
the very use the fetch is for). The one being served moves at its kind's rate:
reads at `read_Bps`, writes at `write_Bps`, and at `mixed_Bps` while an
operation of the other kind is queued with it or where it follows one of the
other kind without a pause
(the disk's rate for interleaved traffic, measured by the same probe). A use
starts when the use before it on its lane ended, every fetch it needs has
arrived and every write-back that makes its room (`PlanOp.needed_at`) is done:
a tier holds a dirty copy until its bytes are on NVMe. Uses run on the
"compute" lane unless they name another (`Use.lane`: the engine's update
thread, which runs each group's update beside backward): such a use starts no
earlier than the compute use before it in the trace (which produced its
input), and a compute use waits for every other lane's use issued before the
compute use preceding it (the engine lets one update queue behind backward, no
more), a "commit" for all of them. The time a compute use waits for its
fetches or its room is exposed I/O. The step ends when every lane's last use
ended and the disk is idle. The prediction carries the same events and tier
counters a measured trace does (compute spans, fetches from issue to arrival,
NVMe reads and writes, waits, the memory tier's occupancy), so `offload view`
draws the two side by side.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from .plan import Plan, PlanOp, Use

__all__ = ["Prediction", "Rates", "simulate"]


@dataclass(frozen=True)
class Rates:
    """Measured rates, bytes per second. `mixed_Bps`: reads and writes at once (0: the
    slower of the two)."""

    read_Bps: float
    write_Bps: float
    mixed_Bps: float = 0.0

    def __post_init__(self) -> None:
        for k in ("read_Bps", "write_Bps"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)}")
        if not self.mixed_Bps >= 0:  # NaN too
            raise ValueError(f"mixed_Bps must be >= 0 (0: the slower of the two), got "
                             f"{self.mixed_Bps}")


@dataclass
class Prediction:
    """The simulated step: seconds, exposed I/O, and its events (name, cat, track,
    start s, end s, args) and occupancy samples (time s, bytes held)."""

    step_s: float
    compute_s: float
    exposed_io_s: float
    events: list[tuple[str, str, str, float, float, dict[str, Any]]] = field(default_factory=list)
    occupancy: list[tuple[float, int]] = field(default_factory=list)

    def to_trace(self, *, tier: str = "HOST", budget: int = 0, rank: int = 0,
                 metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """A Chrome-trace dict of the prediction in the format of a measured trace
        (`metadata.kind` = "predicted"; transfers and fetches as async spans, the
        compute's waits as `wait:gather`, a `step` span, `tier:<tier>` counters, the
        budget in the rank's info), so `offload view` draws it beside a measured one.
        Write it with `offload.trace.write_trace_dict`."""
        us = 1e6
        tracks = ["compute"] + sorted({e[2] for e in self.events} - {"compute"}) \
            + [f"tier:{tier}"]
        tid = {t: k + 1 for k, t in enumerate(tracks)}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank}"}}]
        out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid[t],
                 "args": {"name": t}} for t in tracks]
        out.append({"ph": "X", "name": "step", "cat": "compute", "pid": rank,
                    "tid": tid["compute"], "ts": 0.0, "dur": self.step_s * us,
                    "args": {"step": 1}})
        for n, (name, cat, track, t0, t1, args) in enumerate(self.events, start=1):
            base = {"name": name, "cat": cat, "pid": rank, "tid": tid[track]}
            if cat in ("io", "fetch"):  # transfers are async spans, as the recorder writes
                out.append({**base, "ph": "b", "ts": t0 * us, "id": hex(n), "args": args})
                out.append({**base, "ph": "e", "ts": t1 * us, "id": hex(n), "args": args})
            else:
                out.append({**base, "ph": "X", "ts": t0 * us, "dur": max(0.0, t1 - t0) * us,
                            "args": args})
        for t, held in self.occupancy:
            out.append({"ph": "C", "name": f"tier:{tier}", "cat": "counter", "pid": rank,
                        "tid": tid[f"tier:{tier}"], "ts": t * us, "args": {"planned": held}})
        info = {"tier_budgets": {tier: budget}} if budget else {}
        meta = {"generator": "offload.planner", "kind": "predicted", "ranks": [rank],
                "info": {str(rank): info}, "step_s": self.step_s,
                "exposed_io_s": self.exposed_io_s, **(metadata or {})}
        return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": meta}


class _Schedule:
    """Which use runs next, and from when it may start before its own I/O ([Note: the
    simulated step])."""

    def __init__(self, uses: Sequence[Use], io: Sequence[PlanOp]) -> None:
        self.uses = uses
        self.after: list[set[int]] = [set() for _ in uses]  # uses that must have run first
        for op in io:
            if op.needed_at is not None and op.at < op.needed_at:
                self.after[op.needed_at].add(op.at)  # the one that issues its fetch or room
        self.lanes: dict[str, list[int]] = {}
        self.prev: list[int] = []         # the compute use before each use (-1: none)
        self.sides_before: list[int] = []  # how many other lanes' uses come before it
        self.side_order: list[int] = []
        for i, use in enumerate(uses):
            compute = self.lanes.get("compute")
            self.prev.append(compute[-1] if compute else -1)
            self.sides_before.append(len(self.side_order))
            self.lanes.setdefault(use.lane, []).append(i)
            if use.lane != "compute":
                self.side_order.append(i)
        self.side_ended = [0.0]           # latest end among the first k of side_order
        self.head = {lane: 0 for lane in self.lanes}
        self.end: list[float | None] = [None] * len(uses)

    def _sides_done(self, k: int) -> float | None:
        """The latest end among the other lanes' first k uses (None: not all ran)."""
        done, order = self.side_ended, self.side_order
        while len(done) <= k and self.end[order[len(done) - 1]] is not None:
            done.append(max(done[-1], self.end[order[len(done) - 1]]))
        return done[k] if len(done) > k else None

    def _base(self, i: int) -> float | None:
        """When use i may start, before its I/O (None: what it follows has not run)."""
        use, p = self.uses[i], self.prev[i]
        if any(self.end[j] is None for j in self.after[i]):
            return None
        now = 0.0 if p < 0 else self.end[p]
        if now is None:
            return None
        if use.lane == "compute":  # backpressure: the other lanes' uses queued before the
            k = self.sides_before[i if use.kind == "commit" else max(p, 0)]  # compute use
            done = self._sides_done(k)  # before this one (all, for the commit) ended
            return None if done is None else max(now, done)
        pos = self.head[use.lane]  # after the compute use before it, in its lane's order
        before = self.end[self.lanes[use.lane][pos - 1]] if pos else 0.0
        return None if before is None else max(before, now)

    def pending(self) -> bool:
        """Whether a use has not been issued yet."""
        return any(k < len(self.lanes[name]) for name, k in self.head.items())

    def peek(self) -> tuple[float, int] | None:
        """(base, index) of the use that can start first (the lowest index among equals);
        None while every next use waits on one that has not ended."""
        ready = [(base, lane[k]) for name, k in self.head.items()
                 for lane in [self.lanes[name]] if k < len(lane)
                 for base in [self._base(lane[k])] if base is not None]
        return min(ready) if ready else None

    def take(self, i: int) -> None:
        """Use i is issued: the next of its lane comes up."""
        self.head[self.uses[i].lane] += 1


class _Disk:
    """The disk as the simulation sees it ([Note: the simulated step]): operations are
    served one at a time in the order they fall due, each at its kind's rate, or at
    `mixed_Bps` while an operation of the other kind is queued beside it or where it
    follows one of the other kind without a pause; the rate changes as the queue does,
    so the one being served keeps count of its bytes left.
    A write-back falls due when the last use of its record ended, a fetch once every
    write-back issued before it that makes room for its use or an earlier one is done
    (the fetch may read into that room), any other operation when it is issued."""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self.mixed = rates.mixed_Bps or min(rates.read_Bps, rates.write_Bps)
        self.now = 0.0
        self.seq = 0
        self.queue: deque[list] = deque()  # [op, bytes left, issued at, seq], in order due
        self.due: list[tuple[float, int, PlanOp, float]] = []  # (due at, seq, op, issued)
        self.after_use: dict[int, list[tuple[int, PlanOp, float]]] = {}  # use -> its writes
        self.rooms: dict[int, int] = {}    # write-backs that make room, not yet done: the
        # use each makes room for; fetches behind them: (those rooms left, seq, op, issued)
        self.blocked: list[tuple[set[int], int, PlanOp, float]] = []
        self.kinds = {"fetch": 0, "write-back": 0}  # queued operations of each kind
        self.began = 0.0           # when the first in the queue began to be served
        self.last = 0.0            # when the last operation ended
        self.last_kind = ""        # and its kind

    def rate(self) -> float:
        """Bytes per second the first in the queue is served at."""
        if self.kinds["fetch"] and self.kinds["write-back"]:
            return self.mixed
        if self.queue and self.began == self.last and self.last_kind not in (
                "", self.queue[0][0].op):
            return self.mixed  # it follows one of the other kind without a pause
        return self.rates.read_Bps if self.kinds["fetch"] else self.rates.write_Bps

    def issue(self, op: PlanOp, after: float | None, use: int | None = None) -> None:
        """Issue `op` now: due at once, at `after` (a write-back whose record's last use
        ends then), or when use `use` ends (one that has not run yet)."""
        self.seq += 1
        if op.op == "write-back" and op.needed_at is not None:
            self.rooms[self.seq] = op.needed_at
        # a fetch may read into the room made for its own use or an earlier one, not a
        # later use's: that room's write-back may follow the very use this fetch is for
        rooms = {s for s, needed in self.rooms.items()
                 if op.needed_at is None or needed <= op.needed_at} if op.op == "fetch" else ()
        if rooms:
            self.blocked.append((rooms, self.seq, op, self.now))
        elif use is not None:
            self.after_use.setdefault(use, []).append((self.seq, op, self.now))
        else:
            self._due(self.seq, op, self.now, after or 0.0)

    def use_ended(self, use: int, end: float) -> None:
        """Use `use` runs until `end`: the write-backs that follow it fall due then."""
        for seq, op, issued in self.after_use.pop(use, ()):
            self._due(seq, op, issued, end)

    def _due(self, seq: int, op: PlanOp, issued: float, at: float) -> None:
        if at > self.now:
            heapq.heappush(self.due, (at, seq, op, issued))
            return
        if not self.queue:
            self.began = self.now
        self.kinds[op.op] += 1
        self.queue.append([op, float(op.nbytes), issued, seq])

    def _head_ends(self) -> float:
        return self.now + self.queue[0][1] / self.rate() if self.queue else math.inf

    def next_time(self) -> float:
        """When the next operation ends or falls due (inf: none will)."""
        return min(self.due[0][0] if self.due else math.inf, self._head_ends())

    def advance(self, t: float) -> None:
        """Serve the first in the queue until `t` (no event comes before it)."""
        if t > self.now and self.queue:
            self.queue[0][1] = max(0.0, self.queue[0][1] - (t - self.now) * self.rate())
        self.now = max(self.now, t)

    def step(self) -> list[tuple[PlanOp, float, float, float]]:
        """Advance to the next event; the operation that ended there, if one did, as
        (op, issued, service began, ended)."""
        t = self.next_time()
        ends = self._head_ends() <= t
        self.advance(t)
        ended = []
        if ends:
            op, _, issued, seq = self.queue.popleft()
            self.kinds[op.op] -= 1
            ended.append((op, issued, self.began, t))
            self.began, self.last, self.last_kind = t, t, op.op
            self.rooms.pop(seq, None)
            for item in list(self.blocked):
                item[0].discard(seq)
                if not item[0]:
                    self.blocked.remove(item)
                    self._due(item[1], item[2], item[3], t)
        while self.due and self.due[0][0] <= t:
            _, seq, op, issued = heapq.heappop(self.due)
            self._due(seq, op, issued, t)
        return ended


def simulate(plan: Plan, uses: Sequence[Use], rates: Rates) -> Prediction:
    """The predicted step of `plan` over `uses` at `rates` ([Note: the simulated step])."""
    _check(plan, uses)
    io = sorted((op for op in plan.ops if op.op != "evict"),
                key=lambda op: (op.at, op.op != "write-back"))
    issued_by: dict[int, list] = {}
    waiting = [0] * len(uses)  # operations each use waits for (its fetches, its room)
    for op in io:
        issued_by.setdefault(op.at, []).append(op)
        if op.needed_at is not None:
            waiting[op.needed_at] += 1
    sched = _Schedule(uses, io)
    disk = _Disk(rates)
    arrival: dict[tuple, float] = {}
    room: dict[int, list[tuple[str, float]]] = {}  # use -> (key, end) of its write-backs
    base_of: dict[int, float] = {}                 # issued uses not yet started
    pred = Prediction(0.0, 0.0, 0.0)

    def run(i: int) -> None:  # use i has its fetches and its room: it runs
        use, base = uses[i], base_of.pop(i)
        ready = _wait(pred, plan, use, i, base, room.get(i, ()), arrival)
        end = ready + use.compute_s
        pred.compute_s += use.compute_s
        pred.events.append((use.label or f"{use.kind} {i}", "compute", use.lane,
                            ready, end, {"use": i, "kind": use.kind}))
        pred.occupancy.append((ready, plan.held[i]))
        sched.end[i] = end
        disk.use_ended(i, end)

    while base_of or sched.pending() or disk.next_time() < math.inf:
        ready = sched.peek()
        if ready is not None and ready[0] <= disk.next_time():
            base, i = ready
            sched.take(i)
            disk.advance(base)
            base_of[i] = base
            for op in issued_by.get(i, ()):  # issued when use i is about to start
                pred.events.append((op.op, "plan", "plan", base, base,
                                    {"key": str(op.key), "at": op.at}))
                follows = op.follows if op.op == "write-back" else None
                if follows is None:
                    disk.issue(op, None)
                else:
                    disk.issue(op, sched.end[follows],
                               use=follows if sched.end[follows] is None else None)
            if not waiting[i]:
                run(i)
            continue
        if disk.next_time() == math.inf:
            raise ValueError("the plan's operations wait on one another: no use can start")
        for op, issued, start, end in disk.step():
            kind = "read" if op.op == "fetch" else "write"
            pred.events.append((kind, "io", "io:nvme", start, end,
                                {"key": str(op.key), "bytes": op.nbytes}))
            if op.op == "fetch":
                arrival[(op.key, op.needed_at)] = end
                pred.events.append(("fetch", "fetch", "fetches", issued, end,
                                    {"key": str(op.key), "bytes": op.nbytes, "steps": "READ",
                                     "needed_at": op.needed_at}))  # as the store's
            elif op.needed_at is not None:
                room.setdefault(op.needed_at, []).append((str(op.key), end))
            if op.needed_at is not None:
                waiting[op.needed_at] -= 1
                if not waiting[op.needed_at] and op.needed_at in base_of:
                    run(op.needed_at)
    pred.events.sort(key=lambda e: e[3])
    pred.occupancy.sort()
    pred.step_s = max([disk.last] + [e for e in sched.end if e is not None])
    pred.occupancy.append((pred.step_s, plan.held[-1] if plan.held else 0))
    return pred


def _check(plan: Plan, uses: Sequence[Use]) -> None:
    """Raises ValueError where the plan does not fit the trace or a use takes no time
    a clock could show."""
    if len(plan.held) != len(uses):
        raise ValueError(f"the plan covers {len(plan.held)} uses, the trace has {len(uses)}")
    for i, use in enumerate(uses):
        if not 0 <= use.compute_s < float("inf"):
            raise ValueError(f"use {i} ({use.kind} {use.label}) takes {use.compute_s} "
                             "seconds; a use's compute_s is finite and >= 0")
    for op in plan.ops:  # an operation no use issues would be lost, or fail to index
        if not 0 <= op.at < len(uses):
            raise ValueError(f"the {op.op} of {op.key!r} is issued at use {op.at}: an "
                             f"operation is issued before one of the trace's {len(uses)} "
                             "uses (a write after the last one: before the commit)")
    for i, ops in plan.fetches_by_use.items():
        for op in ops:
            if not (0 <= op.at <= i < len(uses)):
                raise ValueError(f"the fetch of {op.key!r} is issued at use {op.at} and "
                                 f"needed at use {i}: a fetch is issued at or before its "
                                 f"use, within the trace's {len(uses)} uses")


def _wait(pred: Prediction, plan: Plan, use: Use, i: int, base: float,
          room: Sequence[tuple[str, float]], arrival: dict[tuple, float]) -> float:
    """When use i starts: after the write-backs that make its room, then its fetches;
    records the waits (exposed I/O on the compute lane)."""
    freed = max([base] + [end for _, end in room])
    if freed > base:  # its room is still being written
        late = [k for k, end in room if end > base]
        track = "thread:MainThread" if use.lane == "compute" else use.lane  # as the store's
        pred.events.append(("wait:budget", "wait", track, base, freed,      # waits are
                            {"key": late[0], "keys": late, "use": i}))     # recorded
    arrived = {op.key: arrival[(op.key, i)] for op in plan.fetches_by_use.get(i, ())}
    ready = max([freed, *arrived.values()])
    if use.lane == "compute":  # a use of each record, waited for or not, as the engine
        # records it (what the report's prefetch outcomes read), and of each record
        # fetched for it beyond its own (a gradient read back for its update)
        for key in dict.fromkeys([*use.keys, *arrived]):
            pred.events.append(("wait:gather", "wait", use.lane, freed,
                                max(freed, arrived.get(key, freed)), {"key": str(key),
                                                                      "use": i}))
    elif ready > freed:
        late = [str(k) for k, t in arrived.items() if t > freed]
        pred.events.append(("optim:wait_read", "wait", use.lane, freed, ready,
                            {"key": late[0], "keys": late, "use": i}))
    if use.lane == "compute":
        pred.exposed_io_s += ready - base
    return ready
