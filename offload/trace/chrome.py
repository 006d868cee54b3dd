"""Readers of recorded events: Chrome Trace Event Format JSON (opens in Perfetto), summaries.

The file is one JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms",
"metadata": {...}}``. Each recorder (one per rank) is one process, pid = rank;
each track is one thread of it, named by ``thread_name`` metadata and ordered
by ``thread_sort_index``. Timestamps are microseconds (floats) of
``time.perf_counter_ns()``, kept absolute so that files written by different
ranks of one host can be merged by concatenation (:func:`merge_chrome_traces`).

Beyond the recorded events the export adds, for Perfetto: beside each
``tier:<TIER>`` counter (bytes held per kind of partition), an ``occupancy:<TIER>``
counter with the bytes ``used`` in all and the tier's ``budget`` (where the store
stated it), and a flow arrow (``s``/``f``, cat ``fetch``) from each fetch issued
ahead of a use to that use (see [Note: prefetch outcome] in analysis.py).
Facts given to ``TraceRecorder.set_info`` go in ``metadata["info"][rank]``.
"""

from __future__ import annotations

import enum
import gzip
import json
import math
import numbers
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from offload.files import NotRegularFileError, check_directory, read_regular, replace_atomically
from offload.trace.analysis import (COMPUTE_TRACK, FETCH, TIER_COUNTER_PREFIX, TraceFormatError,
                                    byte_count, check_key_fields, finite, parse_trace,
                                    prefetch_outcomes, short_repr)
from offload.trace.recorder import (ASYNC_BEGIN, ASYNC_END, COMPLETE, COUNTER, INSTANT,
                                    TraceEvent, TraceRecorder, TraceSnapshot, as_snapshot)

__all__ = ["TraceFormatError", "load_chrome_trace", "merge_chrome_traces", "summarize",
           "to_chrome_trace", "write_chrome_trace", "write_trace_dict"]

FORMAT_VERSION = 1
OCCUPANCY_PREFIX = "occupancy:"  # the export's counter beside each tier's (_occupancy_counter)
_CLOCK = "time.perf_counter_ns (CLOCK_MONOTONIC on Linux), exported as microseconds"
_RESERVED_METADATA = frozenset((
    "generator", "format_version", "clock", "ranks", "dropped_events", "dropped_events_by_rank",
    "unmatched_async_begins", "orphan_async_ends_dropped", "clock_anchors", "info"))

Source = TraceRecorder | TraceSnapshot | Iterable[Iterable[Any]]


def to_chrome_trace(source: Source, *more: Source,
                    metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build the Chrome-trace dict of one or more recorders (or snapshots, or raw events).

    Recorders with the same rank share one process and its tracks. Async ids
    are renumbered so they are unique across the whole file. An async end
    whose begin is missing is dropped; a begin without an end is kept (it
    shows what was in flight) and counted in ``metadata["unmatched_async_begins"]``.
    ``metadata`` adds keys to the file's metadata; reserved keys raise ValueError.
    """
    snapshots = [as_snapshot(s) for s in (source, *more)]
    user_meta = dict(metadata or {})
    clash = _RESERVED_METADATA.intersection(user_meta)
    if clash:
        raise ValueError(f"metadata keys {sorted(clash)} are written by the exporter; "
                         "rename them")
    events: list[tuple[tuple[int, int], dict[str, Any]]] = []
    meta_events: list[dict[str, Any]] = []
    tids: dict[int, dict[str, int]] = {}  # rank -> track -> tid
    process_names: dict[int, str] = {}
    next_async = 1
    unmatched = orphans = 0
    for snap in snapshots:
        rank_tids = tids.setdefault(snap.rank, {})
        process_names.setdefault(snap.rank, snap.process_name)
        for track in snap.tracks:
            rank_tids.setdefault(track, len(rank_tids) + 1)
        async_ids: dict[int, str] = {}
        ended: set[int] = set()
        for ev in snap.events:
            if ev.phase == ASYNC_END:
                ended.add(ev.async_id)
        for ev in snap.events:
            tid = rank_tids.setdefault(ev.track, len(rank_tids) + 1)
            if ev.phase == ASYNC_BEGIN:
                async_ids[ev.async_id] = f"0x{next_async:x}"
                next_async += 1
                unmatched += ev.async_id not in ended
            elif ev.phase == ASYNC_END and ev.async_id not in async_ids:
                orphans += 1
                continue
            out = _event_dict(ev, snap.rank, tid, async_ids)
            if ev.phase == COUNTER and ev.name.startswith(TIER_COUNTER_PREFIX):
                events.append(((ev.ts_ns, 0), _occupancy_counter(out, snap.info)))
            # Parents before children when spans start together: Chrome's legacy
            # viewer nests "X" events in file order.
            events.append(((ev.ts_ns, -ev.dur_ns), out))
    for rank, rank_tids in sorted(tids.items()):
        meta_events.extend(_process_metadata(rank, process_names[rank], rank_tids))
    events.extend(_fetch_flows(meta_events, [e for _, e in events], tids))
    events.sort(key=lambda pair: pair[0])
    dropped_by_rank: dict[str, int] = {}
    anchors: dict[str, dict[str, int]] = {}
    info: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        key = str(snap.rank)
        info.setdefault(key, {}).update(_jsonable(dict(snap.info)))
        dropped_by_rank[key] = dropped_by_rank.get(key, 0) + snap.dropped
        anchors.setdefault(key, {"perf_counter_ns": snap.clock_anchor_ns[0],
                                 "time_ns": snap.clock_anchor_ns[1]})
    meta = {
        "generator": "offload.trace",
        "format_version": FORMAT_VERSION,
        "clock": _CLOCK,
        "ranks": sorted(tids),
        "dropped_events": sum(dropped_by_rank.values()),
        "dropped_events_by_rank": dropped_by_rank,
        "unmatched_async_begins": unmatched,
        "orphan_async_ends_dropped": orphans,
        "clock_anchors": anchors,
        "info": info,
    }
    meta.update(_jsonable(user_meta))
    return {"traceEvents": meta_events + [e for _, e in events], "displayTimeUnit": "ms",
            "metadata": meta}


def _event_dict(ev: TraceEvent, pid: int, tid: int, async_ids: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": ev.name, "cat": ev.cat, "ph": ev.phase,
                           "ts": ev.ts_ns / 1000.0, "pid": pid, "tid": tid}
    if ev.phase == COMPLETE:
        out["dur"] = ev.dur_ns / 1000.0
    elif ev.phase in (ASYNC_BEGIN, ASYNC_END):
        out["id"] = async_ids[ev.async_id]
    elif ev.phase == INSTANT:
        out["s"] = "t"
    if ev.phase == COUNTER:
        # Counter args must be numbers; JSON has no NaN/inf, so such samples are left out.
        out["args"] = {k: v for k, v in (ev.args or {}).items()
                       if isinstance(v, (int, float)) and math.isfinite(v)}
    elif ev.args:
        out["args"] = _jsonable(ev.args)
    return out


def _occupancy_counter(tier_counter: dict[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """The ``occupancy:<TIER>`` counter beside a ``tier:<TIER>`` one: ``used`` (its kinds
    summed) and the tier's ``budget`` where the store stated it."""
    tier = tier_counter["name"][len(TIER_COUNTER_PREFIX):]
    args = {"used": float(sum(tier_counter.get("args", {}).values()))}
    budgets = info.get("tier_budgets")
    budget = budgets.get(tier) if isinstance(budgets, Mapping) else None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        args["budget"] = float(budget)
    return {**tier_counter, "name": f"{OCCUPANCY_PREFIX}{tier}", "args": args}


def _fetch_flows(meta_events: list[dict[str, Any]], events: list[dict[str, Any]],
                 tids: Mapping[int, Mapping[str, int]]) -> list[tuple[tuple[float, float],
                                                                         dict[str, Any]]]:
    """Flow events from each fetch issued ahead of a use to the use, on the compute track.

    The start sits at the fetch's issue and the end at the use (the ``wait:gather``
    span it binds to), both on the ``compute`` thread where the engine issued and
    used the record; sort keys (nanoseconds) put them after spans starting then.
    """
    if not any(e.get("cat") == FETCH for e in events):
        return []
    out = []
    n = 0
    for rt in parse_trace({"traceEvents": meta_events + events}, "<export>", checked=True):
        tid = tids.get(rt.rank, {}).get(COMPUTE_TRACK)
        if tid is None:
            continue
        for use in prefetch_outcomes(rt):
            if use.outcome not in ("in time", "late") or use.issued is None:
                continue
            n += 1
            common = {"name": "prefetch", "cat": FETCH, "id": f"0x{n:x}", "pid": rt.rank,
                      "tid": tid}
            out.append(((use.issued * 1000.0, 1), {**common, "ph": "s", "ts": use.issued}))
            out.append(((use.use * 1000.0, 1), {**common, "ph": "f", "bp": "e", "ts": use.use,
                                                "args": {"key": use.key,
                                                         "outcome": use.outcome}}))
    return out


def _process_metadata(rank: int, process_name: str,
                      rank_tids: Mapping[str, int]) -> list[dict[str, Any]]:
    meta = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
         "args": {"name": process_name}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]
    for track, tid in rank_tids.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                     "args": {"name": track}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                     "args": {"sort_index": tid}})
    return meta


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats, enums and objects become strings."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else repr(f)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


def write_chrome_trace(path: str | os.PathLike[str], *sources: Source,
                       metadata: Mapping[str, Any] | None = None) -> Path:
    """Export ``sources`` (see :func:`to_chrome_trace`) to ``path`` atomically; return the path.

    Written to a temporary file in the same directory, fsynced, then renamed
    over ``path``, so readers see the old file or the whole new one. A path
    ending in ``.gz`` is gzip-compressed (Perfetto opens it directly).
    """
    if not sources:
        raise ValueError(f"write_chrome_trace({str(path)!r}) got no recorders to export")
    return write_trace_dict(path, to_chrome_trace(*sources, metadata=metadata))


def write_trace_dict(path: str | os.PathLike[str], trace: Mapping[str, Any]) -> Path:
    """Write an already-built trace dict to ``path`` atomically (see :func:`write_chrome_trace`)."""
    target = Path(path)
    check_directory(target.parent, "write_chrome_trace")
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(raw) -> None:
        if target.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                gz.write(_encode(trace))
        else:
            raw.write(_encode(trace))
    replace_atomically(target, write)
    return target


def _encode(trace: Mapping[str, Any]) -> bytes:
    return json.dumps(trace, separators=(",", ":"), allow_nan=False).encode("utf-8")




def load_chrome_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a trace file written by :func:`write_chrome_trace` (plain or ``.gz``).

    Raises :class:`~offload.trace.analysis.TraceFormatError` (a ValueError) naming the
    file when it is not one: truncated or corrupted (JSON, gzip, UTF-8), no trace
    object, an event that is not an object, metadata that is not an object or whose
    counts or ranks are not numbers, an event whose pid, tid, id, cat or name is a list
    or an object, written in a newer format than this reads, or a path that is not a
    regular file (a pipe, a device); ``OSError`` when it cannot be read at all (missing,
    a directory).
    """
    target = Path(path)
    raw = _read_regular_file(target)
    try:
        if raw[:2] == b"\x1f\x8b":  # gzip's magic, whatever the name
            raw = gzip.decompress(raw)
        trace = json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, zlib.error) as e:
        raise TraceFormatError(f"{target}: not a readable gzip file ({e}); is the file "
                               "complete?") from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{target}: not a trace file (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        if raw.lstrip()[:1] == b"<":
            raise TraceFormatError(f"{target}: is HTML or XML (such as a report), not a "
                                   "trace; pass the .trace.json file the run wrote") from None
        if not raw.strip():
            raise TraceFormatError(f"{target}: the file is empty; was the run that writes it "
                                   "stopped before it finished?") from None
        raise TraceFormatError(f"{target}: not valid JSON ({e.msg} at line {e.lineno} "
                               f"column {e.colno}); is the file complete?") from None
    except (ValueError, RecursionError) as e:  # a number of over 4300 digits, deep nesting
        raise TraceFormatError(f"{target}: not a trace file ({str(e)[:80]})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceFormatError(f"{target}: not a Chrome trace (expected a JSON object with "
                               "a 'traceEvents' list)")
    meta = trace.get("metadata")
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version > FORMAT_VERSION):
        raise TraceFormatError(f"{target}: written in trace format {short_repr(version)}; this "
                               f"offload reads format {FORMAT_VERSION} and before: read it "
                               "with the offload that wrote it")
    for ev in trace["traceEvents"]:
        if not isinstance(ev, dict):
            raise TraceFormatError(f"{target}: trace event {short_repr(ev)} is not an object")
        check_key_fields(ev, str(target))  # merging and summing key on them
    if meta is not None and not isinstance(meta, dict):
        raise TraceFormatError(f"{target}: its metadata is {short_repr(meta)}, not an object")
    _merge_metadata({}, meta or {}, target)  # checks its counts and ranks
    return trace


def _read_regular_file(target: Path) -> bytes:
    """The bytes of ``target``; a FIFO (which would block), a device (``/dev/zero``
    never ends) or a socket raises :class:`TraceFormatError`, a directory
    ``IsADirectoryError`` (`read_regular`)."""
    try:
        return read_regular(target)
    except NotRegularFileError:
        raise TraceFormatError(f"{target}: is not a regular file (a pipe, device or "
                               "socket); pass the trace file a run wrote") from None


def merge_chrome_traces(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Any]:
    """Merge per-rank trace files into one trace dict (e.g. to write with ``write_trace_dict``).

    Async ids are renumbered per file so that they stay unique; events of
    the same pid from different files share that pid. Metadata counts are
    summed and ``ranks`` merged; other metadata keys come from the first file.
    """
    merged_meta: dict[str, Any] = {}
    meta_events: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    seen_meta: set[tuple[Any, ...]] = set()
    next_async = 1
    for path in paths:
        trace = load_chrome_trace(path)
        remap: dict[tuple[str, Any], str] = {}
        for ev in trace["traceEvents"]:  # objects: load_chrome_trace checked them
            if ev.get("ph") == "M":
                key = (ev.get("name"), ev.get("pid"), ev.get("tid"))
                if key not in seen_meta:
                    seen_meta.add(key)
                    meta_events.append(ev)
                continue
            if ev.get("ph") in (ASYNC_BEGIN, ASYNC_END, "s", "t", "f") and "id" in ev:
                key = (ev.get("cat", ""), ev["id"])
                if key not in remap:
                    remap[key] = f"0x{next_async:x}"
                    next_async += 1
                ev = {**ev, "id": remap[key]}
            events.append(ev)
        _merge_metadata(merged_meta, trace.get("metadata") or {}, path)
    events.sort(key=lambda e: (_number(e.get("ts")), -_number(e.get("dur"))))
    return {"traceEvents": meta_events + events, "displayTimeUnit": "ms",
            "metadata": merged_meta}


def _number(value: Any) -> float:
    """A timestamp or duration to sort by: 0 where there is none, or it is no number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)
    return float(value) if ok else 0.0


def _merge_metadata(into: dict[str, Any], meta: Mapping[str, Any],
                    path: str | os.PathLike[str] = "<trace>") -> None:
    for key, value in meta.items():
        if key in ("dropped_events", "unmatched_async_begins", "orphan_async_ends_dropped"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TraceFormatError(f"{path}: metadata {key} is {short_repr(value)}, not a "
                                       "count")
            into[key] = into.get(key, 0) + value
        elif key == "ranks":
            if not isinstance(value, list) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in value):
                raise TraceFormatError(f"{path}: metadata ranks is {short_repr(value)}, not a "
                                       "list of ranks")
            into[key] = sorted(set(into.get(key, [])) | set(value))
        elif key in ("dropped_events_by_rank", "clock_anchors", "info") \
                and isinstance(value, Mapping):
            into.setdefault(key, {}).update(value)
        else:
            into.setdefault(key, value)


def summarize(source: Source | str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Totals for tables: time per category, time and bytes per async name.

    `source`: a recorder, a snapshot or raw events as elsewhere here, or a trace
    file written by :func:`write_chrome_trace` (a path, plain or ``.gz``) or that
    file's object as :func:`load_chrome_trace` returns it, so saved runs compare
    as live ones do. A file's events are totalled over all of its ranks; the
    ``occupancy:<TIER>`` counters the export adds are left out, as a recorder has
    none. Raises :class:`~offload.trace.analysis.TraceFormatError` (a ValueError)
    naming the file when it is not such a trace.

    Returns ``{"categories": {cat: {"count", "total_ns"}}, "async": {name:
    {"count", "in_flight", "total_ns", "total_bytes"}}, "instants": {name:
    count}, "counters": {name: {series: last value}}, "events": n,
    "dropped": n}``. Category totals sum complete spans (nested spans count in
    full in each category). Async ``count`` is completed pairs, ``total_ns``
    their summed duration, ``total_bytes`` the sum of ``args["bytes"]`` taken
    from the end event or else the begin event; ``in_flight`` counts begins
    without an end.
    """
    if isinstance(source, (str, os.PathLike)):
        snap = _file_snapshot(load_chrome_trace(source), str(source), checked=True)
    elif isinstance(source, Mapping):
        snap = _file_snapshot(source, "<trace>")
    else:
        snap = as_snapshot(source)
    categories: dict[str, dict[str, int]] = {}
    async_stats: dict[str, dict[str, int]] = {}
    instants: dict[str, int] = {}
    counters: dict[str, dict[str, float]] = {}
    open_begins: dict[int, TraceEvent] = {}
    for ev in sorted(snap.events, key=lambda e: e.ts_ns):
        if ev.phase == COMPLETE:
            cat = categories.setdefault(ev.cat, {"count": 0, "total_ns": 0})
            cat["count"] += 1
            cat["total_ns"] += ev.dur_ns
        elif ev.phase == ASYNC_BEGIN:
            open_begins[ev.async_id] = ev
        elif ev.phase == ASYNC_END:
            begin = open_begins.pop(ev.async_id, None)
            if begin is None:
                continue
            stats = async_stats.setdefault(ev.name, _new_async_stats())
            stats["count"] += 1
            stats["total_ns"] += ev.ts_ns - begin.ts_ns
            stats["total_bytes"] += _bytes_of(ev.args, begin.args)
        elif ev.phase == INSTANT:
            instants[ev.name] = instants.get(ev.name, 0) + 1
        elif ev.phase == COUNTER:
            counters.setdefault(ev.name, {}).update(ev.args or {})
    for begin in open_begins.values():
        async_stats.setdefault(begin.name, _new_async_stats())["in_flight"] += 1
    return {"categories": categories, "async": async_stats, "instants": instants,
            "counters": counters, "events": len(snap.events), "dropped": snap.dropped}


def _new_async_stats() -> dict[str, int]:
    return {"count": 0, "in_flight": 0, "total_ns": 0, "total_bytes": 0}


def _bytes_of(end_args: dict[str, Any] | None, begin_args: dict[str, Any] | None) -> int:
    for args in (end_args, begin_args):
        if args and "bytes" in args:
            return byte_count(args["bytes"])  # as the report counts it
    return 0


def _file_snapshot(trace: Mapping[str, Any], where: str,
                   checked: bool = False) -> TraceSnapshot:
    """The events of a written trace (`write_chrome_trace`'s object) as one snapshot:
    times back in nanoseconds, async pairs keyed by (rank, category, id). `checked`:
    as `parse_trace`'s."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise TraceFormatError(f"{where}: no traceEvents list; is it a trace that "
                               "offload.trace.write_chrome_trace wrote?")
    ids: dict[tuple[Any, Any, Any], int] = {}
    out: list[TraceEvent] = []
    for ev in events:
        if not isinstance(ev, Mapping):
            raise TraceFormatError(f"{where}: trace event {short_repr(ev)} is not an object")
        if not checked:
            check_key_fields(ev, where)  # async pairs key on pid, cat and id
        phase = ev.get("ph")
        if phase not in (COMPLETE, ASYNC_BEGIN, ASYNC_END, INSTANT, COUNTER):
            continue  # metadata and flow arrows
        name = ev.get("name")
        if not isinstance(name, str) or (phase == COUNTER and name.startswith(OCCUPANCY_PREFIX)):
            continue
        ts, dur = finite(ev.get("ts")), finite(ev.get("dur", 0))
        if ts is None or dur is None:
            raise TraceFormatError(f"{where}: trace event {short_repr(ev)} has no finite ts/dur")
        async_id = 0
        if phase in (ASYNC_BEGIN, ASYNC_END):
            async_id = ids.setdefault((ev.get("pid"), ev.get("cat"), ev.get("id")), len(ids) + 1)
        args = ev.get("args")
        out.append(TraceEvent(phase, round(ts * 1000), round(dur * 1000) if phase == COMPLETE
                              else 0, async_id, name, str(ev.get("cat", "")),
                              str(ev.get("tid", "")), dict(args) if isinstance(args, Mapping)
                              else None))
    meta = trace.get("metadata")
    dropped = meta.get("dropped_events", 0) if isinstance(meta, Mapping) else 0
    return TraceSnapshot(rank=0, process_name=where, events=tuple(out), tracks=(),
                         dropped=dropped if isinstance(dropped, int) else 0)
