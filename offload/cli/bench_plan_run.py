"""One configuration of `offload bench plan`, measured in a process of its own: the
disk right before, real steps with the event trace on, and what the trace says about
the step (per-use compute seconds, the Adam rate, the commit's seconds).

[Note: what a run measures]
The disk is probed at the configuration's block size and queue depth through
offload's I/O engine with O_DIRECT under the run's own swap directory (write,
read, and reads and writes in flight together: `tune_probe.probe_disk`), right
before the engine is built: the disk drifts minute to minute. Then `warmup`
untimed steps and `steps` timed ones, each wrapped in a `step` span, with the
recorder on during the timed ones. Of the timed steps, the median one's trace
gives:
  * the units' uses in order (`forward:<unit>` and `backward:<unit>` spans,
    with the groups each unit gathers), each with its compute seconds: the
    span less the main thread's waits inside it (`wait:gather`, the store's
    `wait:*`) while a request to the disk was in flight, which are I/O the
    simulator predicts (a read to arrive, a write to free room), where
    parameters stream from NVMe. A wait with no request in flight is the
    hand-off from the store's thread to the one waiting, not the disk: it stays
    in the compute seconds (about 0.1-0.4 ms a use on this machine, which the
    simulator does not model otherwise), as every wait does where parameters
    stay in memory (the gather's bookkeeping, the update thread's contention);
  * the main thread's time outside any unit span and the optimizer step (the
    loss, autograd between units): one more use between forward and backward;
  * the Adam rate: elements over seconds of the step's `optim:update` spans,
    as the kernel ran in this step (beside backward on a shared CPU where
    updates run early);
  * the commit: the `optimizer step` phase after the last update ended, less
    the main thread's waits (where updates run in the phase itself: the phase
    less their spans and waits).
Bytes per step are the store's moves to and from NVMe plus the optimizer's
(`engine.nvme_bytes()`), and the process's `/proc/self/io` beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..trace.analysis import intersection, union, union_length
from .benchutil import proc_io

__all__ = ["measure", "step_profile"]

WAITS = ("wait:gather", "wait:fetch", "wait:busy", "wait:budget", "wait:evict")


def step_profile(events: list[tuple], t0: int, t1: int, units: dict[str, list[int]],
                 streamed: bool = True) -> dict[str, Any]:
    """What the events between `t0` and `t1` (perf_counter ns, one step) say about the
    step ([Note: what a run measures]); `units`: each unit's name and its groups;
    `streamed`: parameters come from NVMe (else the main thread's waits are no disk
    I/O and stay in the compute seconds)."""
    xs = [e for e in events if e[0] == "X" and t0 <= e[1] < t1]
    waits = sorted((e[1], e[1] + e[2]) for e in xs
                   if e[4] in WAITS and e[6] in ("compute", "thread:MainThread"))
    main_waits = intersection(union(waits), _in_flight(events, t0, t1)) if streamed else []
    uses, in_units = [], 0
    for e in sorted(xs, key=lambda e: e[1]):
        kind, _, name = e[4].partition(":")
        if kind in ("forward", "backward", "recompute") and name in units:
            waited = union_length(main_waits, clip=(e[1], e[1] + e[2]))
            uses.append({"kind": "backward" if kind == "recompute" else kind, "unit": name,
                         "gids": units[name], "compute_s": max(0, e[2] - waited) / 1e9,
                         "waited_s": waited / 1e9})
            in_units += e[2]
    phase = next((e for e in xs if e[4] == "optimizer step"), None)
    p0, p1 = (phase[1], phase[1] + phase[2]) if phase else (t1, t1)
    updates = [e for e in xs if e[4] == "optim:update"]
    elems = sum((e[7] or {}).get("elems", 0) for e in updates)
    adam_s = sum(e[2] for e in updates) / 1e9
    main = [e for e in updates if e[6] == "compute" or p0 <= e[1] < p1]
    last_update = max((e[1] + e[2] for e in updates), default=p0)
    if updates and all(p0 <= e[1] < p1 for e in updates):  # updates run in the phase
        busy = sum(e[2] for e in main) + union_length(main_waits, clip=(p0, p1))
        commit = max(0, (p1 - p0) - busy)
    else:  # updates ran beside backward: the commit is what follows the last of them
        start = max(p0, last_update)
        commit = max(0, (p1 - start) - union_length(main_waits, clip=(start, p1)))
    outside = (t1 - t0) - in_units - (p1 - p0)
    return {"uses": uses, "between_s": max(0, outside - union_length(main_waits, clip=(t0, p0))
                                            + sum(u["waited_s"] for u in uses) * 1e9) / 1e9,
            "adam_elems": elems, "adam_s": adam_s,
            "adam_eps": elems / adam_s if adam_s > 0 else 0.0,
            "chunks": len(updates), "max_chunk": max(((e[7] or {}).get("elems", 0)
                                                      for e in updates), default=0),
            "commit_s": commit / 1e9, "phase_s": (p1 - p0) / 1e9,
            "exposed_s": union_length(waits, clip=(t0, t1)) / 1e9, "step_s": (t1 - t0) / 1e9,
            "waits_s": _waits_by_name(xs), "disk": _disk_busy(events, t0, t1)}


def _requests(events: list[tuple], t0: int, t1: int) -> list[tuple[str, int, int, int]]:
    """The I/O engine's requests in flight at some time in [t0, t1]: (name, begin, end,
    bytes), paired by their async id."""
    begins = {e[3]: e for e in events if e[0] == "b" and e[6].startswith("io:")}
    return [(e[4], b[1], e[1], (b[7] or {}).get("bytes") or (e[7] or {}).get("bytes") or 0)
            for e in events if e[0] == "e" and e[3] in begins
            for b in [begins[e[3]]] if e[1] >= t0 and b[1] < t1]


def _in_flight(events: list[tuple], t0: int, t1: int) -> list[tuple[int, int]]:
    """The time in the step at least one of the I/O engine's requests was in flight,
    as sorted disjoint intervals (`union`)."""
    return union((max(b, t0), min(e, t1)) for _, b, e, _ in _requests(events, t0, t1))


def _disk_busy(events: list[tuple], t0: int, t1: int) -> dict[str, float]:
    """The I/O engine's requests begun in the step: bytes read and written, and the
    seconds at least one read, one write, or any request was in flight."""
    spans: dict[str, list[tuple[int, int]]] = {"read": [], "write": []}
    nbytes = {"read": 0, "write": 0}
    for name, b, e, n in _requests(events, t0, t1):
        if name in spans and b >= t0:
            spans[name].append((b, e))
            nbytes[name] += n
    return {"read_bytes": nbytes["read"], "write_bytes": nbytes["write"],
            "read_busy_s": union_length(spans["read"]) / 1e9,
            "write_busy_s": union_length(spans["write"]) / 1e9,
            "busy_s": union_length(spans["read"] + spans["write"]) / 1e9}


def _waits_by_name(xs: list[tuple]) -> dict[str, float]:
    """Seconds of each kind of wait in the step, by thread ("wait:busy@main")."""
    out: dict[str, float] = {}
    for e in xs:
        if e[5] == "wait" or e[4].startswith(("wait:", "optim:wait")):
            who = "main" if e[6] in ("compute", "thread:MainThread") else e[6].split(":")[-1]
            key = f"{e[4]}@{who}"
            out[key] = out.get(key, 0.0) + e[2] / 1e9
    return out


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """Probes the disk, runs the job's configuration for `warmup` + `steps` steps and
    returns the raw measurements ([Note: what a run measures])."""
    import offload
    from offload.trace import TraceRecorder

    from .model_arg import ModelSpec, call
    from .tune_probe import probe_disk
    from .tune_verify import _batch

    cfg = job["config"]
    io = cfg["io"]
    disk = probe_disk(os.path.join(io["paths"][0], ".probe"), job["probe_size"],
                      grid=((io["block_size"], io["queue_depth"]),))[0]
    spec = ModelSpec(**job["spec"])
    rec = TraceRecorder(enabled=False)
    engine = offload.initialize(spec.factory(), cfg, recorder=rec)
    try:
        batch, loss_of = _batch(spec, str(engine.store.device), engine.dtype)
        spans, io0, p0, moves0 = [], None, None, None
        for i in range(job["warmup"] + job["steps"]):
            if i == job["warmup"]:
                io0, p0 = engine.nvme_bytes(), proc_io()
                moves0 = {k: v.bytes for k, v in engine.store.stats().moves.items()}
                rec.enabled = True
            t = time.perf_counter_ns()
            engine.backward(loss_of(call(engine, batch)).float())
            engine.step()
            t1 = time.perf_counter_ns()
            if i >= job["warmup"]:
                spans.append((t, t1))  # the engine marks the step in the trace
        rec.enabled = False
        io1, p1 = engine.nvme_bytes(), proc_io()
        moves = {k: (v.bytes - moves0[k]) // job["steps"]
                 for k, v in engine.store.stats().moves.items()}
        units = {u.name: list(u.needs) for u in engine.units}
        shards = [(g.shard, g.requires_grad) for g in engine.groups]
        order = list(engine.trace.plan or [])
        events = rec.events()
        if job.get("trace"):
            from offload.trace import write_chrome_trace

            write_chrome_trace(job["trace"], rec, metadata={"config": job["name"]})
    finally:
        engine.close()
    times = [(b - a) / 1e9 for a, b in spans]
    median = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    n = job["steps"]
    return {"disk": disk.__dict__, "steps_s": times, "step_s": statistics.median(times),
            "profile": step_profile(events, *spans[median], units,
                                    streamed=cfg["engine"]["params"] == "nvme"),
            "read_bytes": (io1[0] - io0[0]) // n, "write_bytes": (io1[1] - io0[1]) // n,
            "proc_read_bytes": (p1[0] - p0[0]) // n, "proc_write_bytes": (p1[1] - p0[1]) // n,
            "store_moves": moves, "engine_trace": order, "shards": shards}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    try:
        out = measure(job)
    except Exception as e:  # a configuration that fails is a row with its error
        out = {"error": f"{type(e).__name__}: {e}"}
    Path(job["out"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
