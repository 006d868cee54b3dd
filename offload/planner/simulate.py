"""Step-time simulator: a plan and measured rates -> the predicted step, as an event
trace in the format of a measured one (pure computation: no tensors, files or threads).

[Note: the simulated step]
Compute runs the uses one after the other, each taking its `compute_s`. The
disk serves the plan's operations in the order they are issued, one at a
time: an operation issued before use i starts no earlier than use i starts
(and, for a write-back, no earlier than the end of the last use of what it
writes), and takes its bytes over the rate of its kind: reads at `read_Bps`,
writes at `write_Bps`, and both at `mixed_Bps` when a read and a write are
queued together (the disk's rate for interleaved traffic, measured by the
same probe; an operation that follows one of the other kind on a busy disk
counts as queued with it). A use starts when the use before it on its lane
ended and every fetch it needs has arrived. Uses run on the "compute" lane
unless they name another (`Use.lane`: the engine's update thread, which runs
each group's update beside backward): such a use starts no earlier than the
compute use before it in the trace (which produced its input), and a compute
use waits for every other lane's use issued before the compute use preceding
it (the engine lets one update queue behind backward, no more), a "commit" for
all of them. The time a compute use waits for its fetches is exposed I/O. An
eviction frees its bytes when its write-back (if any) is done. The step ends
when every lane's last use ended and the disk is idle. The prediction carries the same events
and tier counters a measured trace does (compute spans, fetches from issue
to arrival, NVMe reads and writes, waits, the memory tier's occupancy), so
`offload view` draws the two side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .plan import Plan, Use

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
        if self.mixed_Bps < 0:
            raise ValueError(f"mixed_Bps must be >= 0, got {self.mixed_Bps}")


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


def simulate(plan: Plan, uses: Sequence[Use], rates: Rates) -> Prediction:
    """The predicted step of `plan` over `uses` at `rates` ([Note: the simulated step])."""
    if len(plan.held) != len(uses):
        raise ValueError(f"the plan covers {len(plan.held)} uses, the trace has {len(uses)}")
    mixed = rates.mixed_Bps or min(rates.read_Bps, rates.write_Bps)
    io = sorted((op for op in plan.ops if op.op != "evict"),
                key=lambda op: (op.at, op.op != "write-back"))
    issued_by: dict[int, list] = {}
    for op in io:
        issued_by.setdefault(op.at, []).append(op)
    arrival: dict[tuple, float] = {}
    pred = Prediction(0.0, 0.0, 0.0)
    disk_free, last_kind = 0.0, ""
    now = 0.0                      # end of the latest use of the compute lane
    prev = -1                      # index of the compute lane's latest use
    side: list[tuple[int, float]] = []  # (index, end) of the other lanes' uses
    side_done = side_end = 0.0     # latest end among those before `prev`; among all
    waited = 0                     # how many of `side` side_done has taken in
    lane_free: dict[str, float] = {}
    end_of_use: list[float] = []
    for i, use in enumerate(uses):
        if use.lane == "compute":  # backpressure: the other lanes' uses queued before the
            while waited < len(side) and side[waited][0] < prev:  # compute use before
                side_done = max(side_done, side[waited][1])      # this one are done
                waited += 1
            base = max(now, side_end if use.kind == "commit" else side_done)
        else:  # after the compute use before it (it produced its input), in its lane's order
            base = max(lane_free.get(use.lane, 0.0), now)
        for op in issued_by.get(i, ()):  # issued when use i is about to start
            start = max(disk_free, base if op.op == "fetch" else
                        (end_of_use[op.at - 1] if op.at > 0 else 0.0))
            kind = "read" if op.op == "fetch" else "write"
            queued_kinds = {o.op for o in issued_by.get(i, ())}
            together = len(queued_kinds) > 1 or (last_kind not in ("", kind)
                                                 and start <= disk_free)
            rate = mixed if together else (rates.read_Bps if kind == "read" else rates.write_Bps)
            disk_free, last_kind = start + op.nbytes / rate, kind
            pred.events.append((kind, "io", "io:nvme", start, disk_free,
                                {"key": str(op.key), "bytes": op.nbytes}))
            pred.events.append((op.op, "plan", "plan", start, start,
                                {"key": str(op.key), "at": op.at}))
            if op.op == "fetch":
                arrival[(op.key, op.needed_at)] = disk_free
                pred.events.append(("fetch", "fetch", "fetches", start, disk_free,
                                    {"key": str(op.key), "bytes": op.nbytes,
                                     "needed_at": op.needed_at}))
        ready = max([base] + [arrival[(op.key, i)] for op in plan.fetches_by_use.get(i, ())])
        if ready > base:
            late = [str(op.key) for op in plan.fetches_by_use.get(i, ())
                    if arrival[(op.key, i)] > base]
            name = "wait:gather" if use.lane == "compute" else "optim:wait_read"
            pred.events.append((name, "wait", use.lane, base, ready,
                                {"key": late[0], "keys": late, "use": i}))
            if use.lane == "compute":
                pred.exposed_io_s += ready - base
        start, end = ready, ready + use.compute_s
        pred.compute_s += use.compute_s
        pred.events.append((use.label or f"{use.kind} {i}", "compute", use.lane,
                            start, end, {"use": i, "kind": use.kind}))
        pred.occupancy.append((start, plan.held[i]))
        if use.lane == "compute":
            now, prev = end, i
        else:
            lane_free[use.lane] = end
            side.append((i, end))
            side_end = max(side_end, end)
        end_of_use.append(end)
    pred.step_s = max(now, disk_free, side_end)
    pred.occupancy.append((pred.step_s, plan.held[-1] if plan.held else 0))
    return pred
