"""What a Chrome-trace file says about a step: spans per rank, steps, waits, prefetch outcomes.

Reads the dicts :func:`offload.trace.chrome.to_chrome_trace` writes (one
process per rank, timestamps in microseconds) back into per-rank lists of
spans, instants and counter samples, and computes from them what the HTML
report shows and the Perfetto export links. Everything here is a pure function
of the trace; times are microseconds of the recording clock.

The event names read here are the vocabulary of the emitting layers; docs/trace.md
lists them. [Note: prefetch outcome] says how a use of a record is classified.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

__all__ = ["Instant", "RankTrace", "Span", "Step", "TraceFormatError", "UseOutcome",
           "StepIndex", "byte_count", "bytes_moved", "bytes_moved_per_step", "check_key_fields",
           "exposed_time", "exposed_times", "finite", "intersect_length", "parse_trace",
           "prefetch_outcomes", "short_repr", "steps_of", "tier_occupancy", "union", "union_length"]

COMPUTE_TRACK = "compute"
MAIN_THREAD_TRACK = "thread:MainThread"
PHASES = ("forward", "backward", "optimizer step")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")
USE_WAIT = "wait:gather"          # the engine: the compute waits for a group's weights
OPTIM_UPDATE = "optim:update"     # the CPU optimizer computing one chunk
FETCH = "fetch"                   # the store: one fetch, from its issue to its arrival
TIER_COUNTER_PREFIX = "tier:"
# Timestamps and durations beyond this many microseconds (about 31,700 years) come from
# no clock; refusing them keeps every sum and difference of times finite.
MAX_TIME_US = 1e18
# Byte counts and counter samples beyond this come from no machine: they are left out, so
# that sums of them stay finite (JSON allows integers of any length).
MAX_VALUE = float(2**63)


class TraceFormatError(ValueError):
    """A file is not a trace this package can read; the message says what is wrong."""


@dataclass(slots=True)
class Span:
    """A complete span (``X``) or a paired async event (``b``/``e``), in microseconds."""

    start: float
    end: float
    name: str
    cat: str
    track: str
    args: dict[str, Any]
    is_async: bool = False

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class Instant:
    ts: float
    name: str
    cat: str
    track: str
    args: dict[str, Any]


@dataclass
class RankTrace:
    """One rank's events from one file. ``predicted``: written by a simulator, not measured."""

    rank: int
    name: str
    source: str
    spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    counters: dict[str, list[tuple[float, dict[str, float]]]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    anchor_ns: tuple[int, int] | None = None
    predicted: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    def shift(self, offset_us: float) -> None:
        """Moves every timestamp by ``offset_us`` (aligning ranks or a prediction)."""
        if not offset_us:
            return
        for s in self.spans:
            s.start += offset_us
            s.end += offset_us
        for i in self.instants:
            i.ts += offset_us
        for name, samples in self.counters.items():
            self.counters[name] = [(t + offset_us, v) for t, v in samples]

    def extent(self) -> tuple[float, float]:
        """(first, last) timestamp of any event; (0, 0) for an empty trace."""
        lo, hi = math.inf, -math.inf
        for s in self.spans:
            lo, hi = min(lo, s.start), max(hi, s.end)
        for i in self.instants:
            lo, hi = min(lo, i.ts), max(hi, i.ts)
        for samples in self.counters.values():
            if samples:
                lo, hi = min(lo, samples[0][0]), max(hi, samples[-1][0])
        return (lo, hi) if lo <= hi else (0.0, 0.0)


def finite(value: Any, limit: float = MAX_VALUE) -> float | None:
    """``value`` as a float when it is a number (not a bool) of magnitude at most
    ``limit``; None otherwise (NaN, infinities, integers no float holds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) and abs(f) <= limit else None


def _number(ev: Mapping[str, Any], key: str, where: str) -> float:
    value = finite(ev.get(key), MAX_TIME_US)
    if value is None:
        raise TraceFormatError(f"{where}: event {_short(ev)} has {key}={short_repr(ev.get(key))}, "
                               f"expected a finite number of microseconds up to {MAX_TIME_US:.0e}")
    return value


def short_repr(value: Any, n: int = 40) -> str:
    """``repr(value)`` in at most ``n`` characters (an integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _short(ev: Mapping[str, Any]) -> str:
    text = "{" + ", ".join(f"{k!r}: {short_repr(v)}" for k, v in ev.items()) + "}"
    return text if len(text) < 120 else text[:117] + "..."


# The fields that name a process, thread, async pair or kind of event; readers use them as
# keys, so each must be a JSON scalar (offload writes integers and strings).
KEY_FIELDS = ("pid", "tid", "id", "cat", "name")


def check_key_fields(ev: Mapping[str, Any], where: str) -> None:
    """Raises :class:`TraceFormatError` naming ``where`` and ``ev`` when one of its
    :data:`KEY_FIELDS` is a list or an object: a Chrome trace's are numbers or strings."""
    for key in KEY_FIELDS:
        value = ev.get(key)
        if value is not None and not isinstance(value, (str, int, float)):
            raise TraceFormatError(f"{where}: event {_short(ev)} has {key}={short_repr(value)}, "
                                   "expected a number or a string; offload reads the traces "
                                   "it writes (docs/trace.md)")


def parse_trace(trace: Any, source: str = "<trace>", *,
                checked: bool = False) -> list[RankTrace]:
    """The ranks of one Chrome-trace dict (as :func:`load_chrome_trace` returns it).

    Raises :class:`TraceFormatError` naming ``source`` and the offending event when the
    dict is not a Chrome trace. Async begins without an end become spans that end at
    the last timestamp of their rank, with ``args["unfinished"] = True``. `checked`:
    its events' key fields were checked already (`load_chrome_trace` did, or the
    recorder wrote them), so the per-event check is not run again.
    """
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        raise TraceFormatError(f"{source}: not a Chrome trace (expected a JSON object with a "
                               "'traceEvents' list)")
    reader = _Reader(trace, source, checked)
    for ev in trace["traceEvents"]:
        reader.add(ev)
    return reader.finish()


_DRAWN_PHASES = frozenset(("X", "b", "e", "i", "I", "n", "C"))


class _Reader:
    """Turns one file's events into ranks: spans, instants, counters, info."""

    def __init__(self, trace: Mapping[str, Any], source: str, checked: bool = False) -> None:
        meta = trace.get("metadata")
        self.meta: Mapping[str, Any] = meta if isinstance(meta, Mapping) else {}
        self.source = source
        self.tracks: dict[tuple[Any, Any], str] = {}
        self.names: dict[Any, str] = {}
        for ev in trace["traceEvents"]:
            if not isinstance(ev, Mapping):
                continue  # add() refuses it
            if not checked:
                check_key_fields(ev, source)  # before pid, tid and id are used as keys
            if ev.get("ph") == "M":
                args = ev.get("args") if isinstance(ev.get("args"), Mapping) else {}
                if ev.get("name") == "thread_name":
                    self.tracks[(ev.get("pid"), ev.get("tid"))] = str(args.get("name",
                                                                               ev.get("tid")))
                elif ev.get("name") == "process_name":
                    self.names[ev.get("pid")] = str(args.get("name", ev.get("pid")))
        self.ranks: dict[int, RankTrace] = {}
        # (pid, cat, id) -> (rank, begin args, begin ts, track, name)
        self.open: dict[tuple[Any, Any, Any], tuple[RankTrace, dict[str, Any], float, str,
                                                    str]] = {}

    def rank_of(self, pid: Any) -> RankTrace:
        rt = self.ranks.get(pid)
        if rt is None:
            if isinstance(pid, bool) or not isinstance(pid, int) or not -2**63 <= pid < 2**63:
                raise TraceFormatError(f"{self.source}: pid {short_repr(pid)} is not an integer "
                                       "rank; offload reads the traces it writes (one "
                                       "process per rank, docs/trace.md)")
            rt = self.ranks[pid] = RankTrace(
                rank=pid, name=self.names.get(pid, f"rank {pid}"), source=self.source,
                predicted=self.meta.get("kind") == "predicted", metadata=dict(self.meta))
        return rt

    def add(self, ev: Any) -> None:
        if not isinstance(ev, Mapping):
            raise TraceFormatError(f"{self.source}: trace event {ev!r} is not an object")
        ph = ev.get("ph")
        if ph not in _DRAWN_PHASES:
            return  # metadata, flows and other phases are not drawn
        ts = _number(ev, "ts", self.source)
        rt = self.rank_of(ev.get("pid"))
        track = self.tracks.get((ev.get("pid"), ev.get("tid")), f"thread {ev.get('tid')}")
        name, cat = str(ev.get("name", "")), str(ev.get("cat", ""))
        args = dict(ev["args"]) if isinstance(ev.get("args"), Mapping) else {}
        if ph == "X":
            dur = _number(ev, "dur", self.source) if "dur" in ev else 0.0
            rt.spans.append(Span(ts, ts + max(0.0, dur), name, cat, track, args))
        elif ph == "b":
            self.open[(ev.get("pid"), cat, ev.get("id"))] = (rt, args, ts, track, name)
        elif ph == "e":
            begun = self.open.pop((ev.get("pid"), cat, ev.get("id")), None)
            if begun is not None:
                brt, bargs, bts, btrack, _ = begun
                brt.spans.append(Span(bts, max(ts, bts), name, cat, btrack, {**bargs, **args},
                                      is_async=True))
        elif ph == "C":
            values = {k: f for k, f in ((k, finite(v)) for k, v in args.items())
                      if f is not None}
            rt.counters.setdefault(name, []).append((ts, values))
        else:
            rt.instants.append(Instant(ts, name, cat, track, args))

    def finish(self) -> list[RankTrace]:
        ends: dict[int, float] = {}  # each rank's last timestamp: one pass over its events
        for (_, cat, _), (rt, args, ts, track, name) in self.open.items():
            end = max(ts, ends[id(rt)] if id(rt) in ends else rt.extent()[1])
            ends[id(rt)] = end
            rt.spans.append(Span(ts, end, name, cat, track, {**args, "unfinished": True},
                                 is_async=True))
        info = self.meta.get("info") if isinstance(self.meta.get("info"), Mapping) else {}
        anchors = self.meta.get("clock_anchors")
        anchors = anchors if isinstance(anchors, Mapping) else {}
        for pid, rt in self.ranks.items():
            rinfo = info.get(str(pid))
            rt.info = dict(rinfo) if isinstance(rinfo, Mapping) else {}
            anchor = anchors.get(str(pid))
            if isinstance(anchor, Mapping) and _clock_ns(anchor.get("perf_counter_ns")) \
                    and _clock_ns(anchor.get("time_ns")) and anchor["time_ns"]:
                rt.anchor_ns = (anchor["perf_counter_ns"], anchor["time_ns"])
            rt.spans.sort(key=lambda s: (s.start, -s.end))
            rt.instants.sort(key=lambda i: i.ts)
            for samples in rt.counters.values():
                samples.sort(key=lambda p: p[0])
        return [self.ranks[k] for k in sorted(self.ranks)]


def _clock_ns(value: Any) -> bool:
    """Whether ``value`` can be a clock's reading in nanoseconds (an int64 >= 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


# -- interval arithmetic -------------------------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def union_length(intervals: Iterable[tuple[float, float]],
                 clip: tuple[float, float] | None = None) -> float:
    """Time covered by ``intervals`` (inside ``clip`` when given)."""
    total = 0.0
    for a, b in union(intervals):
        if clip is not None:
            a, b = max(a, clip[0]), min(b, clip[1])
        total += max(0.0, b - a)
    return total


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]
                 ) -> list[tuple[float, float]]:
    """The intervals covered by both of two disjoint sorted interval lists (from
    :func:`union`), sorted."""
    i = j = 0
    out = []
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def intersect_length(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Time covered by both of two disjoint sorted interval lists (from :func:`union`)."""
    return sum(b - a for a, b in intersection(xs, ys))


class _Covered:
    """A disjoint sorted interval list (from :func:`union`) whose length inside any
    window is two bisections, not a pass: a report of many steps asks it per step."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        self.starts = [a for a, _ in intervals]
        self.ends = [b for _, b in intervals]
        self.before = [0.0, *accumulate(b - a for a, b in intervals)]

    def _upto(self, t: float) -> float:
        k = bisect_right(self.starts, t)
        return self.before[k] - max(0.0, self.ends[k - 1] - t) if k else 0.0

    def within(self, a: float, b: float) -> float:
        return max(0.0, self._upto(b) - self._upto(a)) if b > a else 0.0


# -- steps ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of a rank, from ``start`` to ``end`` (microseconds)."""

    label: str
    start: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.start

    def holds(self, t: float) -> bool:
        """Whether ``t`` lies in the step: in ``[start, end)``, so that where one step
        ends as the next begins an event at that instant counts in the next one only;
        a step of zero length holds its one instant (``t == start``), so that what
        began in a step that took no measurable time is not lost."""
        return self.start <= t < self.end or t == self.start


class StepIndex:
    """Which of ``steps`` hold a time (``Step.holds``), by bisection over their starts:
    a trace of many steps is classified in one pass, not one pass per step. Steps
    may overlap (each holding the time is named)."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self._order = sorted(range(len(steps)), key=lambda i: steps[i].start)
        self._starts = [steps[i].start for i in self._order]
        self._reach = list(accumulate((steps[i].end for i in self._order), max))

    def holding(self, t: float) -> list[int]:
        """Indices into ``steps`` of the steps holding ``t``, in no set order."""
        out = []
        j = bisect_right(self._starts, t) - 1
        while j >= 0 and self._reach[j] >= t:  # an earlier step may still reach t
            i = self._order[j]
            if self.steps[i].holds(t):
                out.append(i)
            j -= 1
        return out


def _outermost(spans: list[Span]) -> list[Span]:
    """``spans`` less each one that lies within another, in their order."""
    inner, reach = set(), -math.inf
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end)):
        if spans[i].end <= reach:
            inner.add(i)
        reach = max(reach, spans[i].end)
    return [s for i, s in enumerate(spans) if i not in inner]


def steps_of(rt: RankTrace) -> list[Step]:
    """The rank's steps: its ``step`` spans, else the extent of the phase spans
    (forward, backward, optimizer step), else the extent of the whole trace; one
    whose span holds an ``error`` is labelled failed, with it. A ``step`` span
    inside another (the engine's own, inside a loop's mark) is not a
    step of its own: the outer one, the loop's, names it."""
    marked = _outermost([s for s in rt.spans if s.name == "step" and s.cat == "compute"])
    if marked:  # a step that failed says so: its retry has the same number
        return [Step(f"step {s.args.get('step', i + 1)}"
                     + (f" (failed: {s.args['error']})" if s.args.get("error") else ""),
                     s.start, s.end) for i, s in enumerate(marked)]
    phases = [s for s in rt.spans if s.name in PHASES and s.cat == "compute"]
    lo, hi = ((min(s.start for s in phases), max(s.end for s in phases)) if phases
              else rt.extent())
    step = rt.metadata.get("step")
    return [Step(f"step {step}" if step is not None else "trace", lo, hi)]


# -- waits ---------------------------------------------------------------------------------------
def is_collective_wait(s: Span) -> bool:
    return s.cat == "wait" and s.name.startswith("wait:") and s.name[5:] in COLLECTIVES


def exposed_time(rt: RankTrace, step: Step) -> dict[str, float]:
    """Microseconds of ``step`` in which the compute stood still, by cause.

    comm: collective waits (``wait:all-gather`` ...). io: the union of the compute's
    waits for a group's weights (``wait:gather``), the store's waits on the main
    thread, and the part of the optimizer phase (``optimizer step`` spans) in which
    no CPU Adam update computes; less the collective waits inside them.
    """
    return exposed_times(rt, [step])[0]


def exposed_times(rt: RankTrace, steps: list[Step]) -> list[dict[str, float]]:
    """:func:`exposed_time` of each of ``steps``: the rank's waits are gathered once."""
    comm = union((s.start, s.end) for s in rt.spans if is_collective_wait(s))
    io_parts = [(s.start, s.end) for s in rt.spans
                if s.cat == "wait" and (s.name == USE_WAIT or (
                    s.track == MAIN_THREAD_TRACK and not is_collective_wait(s)))]
    updates = union((s.start, s.end) for s in rt.spans if s.name == OPTIM_UPDATE)
    update_ends = [b for _, b in updates]
    for s in rt.spans:
        if s.name == "optimizer step" and s.cat == "compute":
            io_parts.extend(_gaps((s.start, s.end), updates, update_ends))
    io = union(io_parts)
    comm_at, io_at, both_at = _Covered(comm), _Covered(io), _Covered(intersection(io, comm))
    return [{"comm": comm_at.within(st.start, st.end),
             "io": io_at.within(st.start, st.end) - both_at.within(st.start, st.end)}
            for st in steps]


def _gaps(window: tuple[float, float], covered: list[tuple[float, float]],
          ends: list[float]) -> list[tuple[float, float]]:
    """Parts of ``window`` not in the disjoint sorted ``covered`` (``ends``: their ends)."""
    out, at = [], window[0]
    for a, b in covered[bisect_right(ends, at):]:
        if a >= window[1]:
            break
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < window[1]:
        out.append((at, window[1]))
    return out


# -- bytes and rates -----------------------------------------------------------------------------
def bytes_moved(rt: RankTrace, step: Step) -> dict[str, Any]:
    """Bytes of the transfers that began in ``step`` (``Step.holds`` their start) and
    completed (failed ones and ones still in flight when the trace ended are left
    out): store moves by direction (``NVME->HOST`` ...), NVMe reads and writes of the
    I/O engines (``nvme_read``, ``nvme_write``) with the time each had a request in
    flight (``*_busy_us``)."""
    return bytes_moved_per_step(rt, [step])[0]


def bytes_moved_per_step(rt: RankTrace, steps: list[Step]) -> list[dict[str, Any]]:
    """:func:`bytes_moved` of each of ``steps``, in one pass over the rank's spans."""
    moves: list[dict[str, int]] = [{} for _ in steps]
    busy = [{"read": [], "write": []} for _ in steps]
    nvme = [{"read": 0, "write": 0} for _ in steps]
    index = StepIndex(steps)
    for s in rt.spans:
        if not s.is_async or s.args.get("error") or s.args.get("unfinished"):
            continue
        store = s.cat == "store" and "->" in s.name
        if not (store or (s.cat == "io" and s.name in ("read", "write"))):
            continue
        n = byte_count(s.args.get("bytes"))
        for k in index.holding(s.start):
            if store:
                moves[k][s.name] = moves[k].get(s.name, 0) + n
            else:
                nvme[k][s.name] += n
                busy[k][s.name].append((s.start, s.end))
    return [{"moves": dict(sorted(m.items())), "nvme_read": v["read"],
             "nvme_write": v["write"], "read_busy_us": union_length(b["read"]),
             "write_busy_us": union_length(b["write"])}
            for m, v, b in zip(moves, nvme, busy)]


def byte_count(value: Any) -> int:
    """``value`` as a count of bytes: 0 unless it is a finite, non-negative number
    below 2**63."""
    f = finite(value)
    if f is None or f < 0:
        return 0
    return int(value)


# -- prefetch outcomes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class UseOutcome:
    """How one use of a record was served.

    ``outcome``: ``in time`` (fetched ahead, arrived ``slack_us`` before the use),
    ``late`` (fetched ahead, the compute waited ``waited_us`` for it), ``on demand``
    (fetched only when used; waited ``waited_us``), ``resident`` (no bytes had to
    move). ``issued``: when the fetch that served it was issued (None for resident).
    """

    key: str
    use: float
    end: float
    outcome: str
    slack_us: float
    waited_us: float
    issued: float | None
    arrived: float | None


# [Note: prefetch outcome]
# A use is a `wait:gather` span of the engine (args `key`): the compute needs the
# record's bytes from its start and has them at its end. The store records every
# fetch as a `fetch` async event (args `key`, `steps`: the move's steps joined by
# "+", empty when the copy was already where it was asked for) from its issue to
# its arrival. A fetch of the same key issued after the key's previous use ended
# and before this use began was issued ahead: the latest such fetch that moved
# bytes serves the use. It is `in time` when it arrived by the use's start, else
# `late`. Without one, a fetch issued inside the use that moved bytes makes it
# `on demand`; otherwise the bytes were already there: `resident`.

def prefetch_outcomes(rt: RankTrace) -> list[UseOutcome]:
    """One outcome per use of a record, in time order; see [Note: prefetch outcome]."""
    fetches: dict[str, list[Span]] = {}  # per record, the fetches that moved bytes
    for s in rt.spans:
        if s.name == FETCH and s.cat == FETCH and not s.args.get("error") \
                and s.args.get("steps"):
            fetches.setdefault(str(s.args.get("key")), []).append(s)
    starts: dict[str, list[float]] = {}
    for key, mine in fetches.items():
        mine.sort(key=lambda f: f.start)  # stable: spans come sorted already
        starts[key] = [f.start for f in mine]
    out: list[UseOutcome] = []
    last_end: dict[str, float] = {}
    for u in rt.spans:
        if u.name != USE_WAIT:
            continue
        key = str(u.args.get("key"))
        after = last_end.get(key, -math.inf)
        last_end[key] = u.end
        mine, at = fetches.get(key, []), starts.get(key, [])
        i = bisect_left(at, u.start)  # mine[:i] began before the use
        waited = u.dur
        if i and mine[i - 1].start >= after:  # the latest issued ahead, since the last use
            f = mine[i - 1]
            if f.end <= u.start:
                out.append(UseOutcome(key, u.start, u.end, "in time", u.start - f.end, waited,
                                      f.start, f.end))
            else:
                out.append(UseOutcome(key, u.start, u.end, "late", 0.0, waited, f.start, f.end))
            continue
        if i < len(mine) and mine[i].start <= u.end:  # the first issued inside it
            out.append(UseOutcome(key, u.start, u.end, "on demand", 0.0, waited,
                                  mine[i].start, mine[i].end))
        else:
            out.append(UseOutcome(key, u.start, u.end, "resident", 0.0, waited, None, None))
    return out


# -- occupancy -----------------------------------------------------------------------------------
def tier_occupancy(rt: RankTrace) -> dict[str, list[tuple[float, float, dict[str, float]]]]:
    """Per tier (``DEVICE``, ``HOST``, ``NVME``): samples of (time, bytes held, by kind)
    from the ``tier:<TIER>`` counters; bytes held is the sum of the kinds."""
    out: dict[str, list[tuple[float, float, dict[str, float]]]] = {}
    for name, samples in rt.counters.items():
        if not name.startswith(TIER_COUNTER_PREFIX):
            continue
        tier = name[len(TIER_COUNTER_PREFIX):]
        series = []
        for t, values in samples:
            series.append((t, sum(values.values()), dict(values)))
        out[tier] = series
    return out
