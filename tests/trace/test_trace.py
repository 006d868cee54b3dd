"""Tests of the event recorder and its Chrome-trace export (real files under tmp_path)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from offload.trace import (NULL_RECORDER, TraceEvent, TraceRecorder, TraceSnapshot,
                           load_chrome_trace, merge_chrome_traces, summarize, to_chrome_trace,
                           write_chrome_trace)


def _record_step(rec: TraceRecorder, n_transfers: int = 8) -> None:
    """Emit spans, async transfers (ended on another thread), instants and counters."""
    tokens = []
    submitted = threading.Event()

    def io_thread() -> None:
        for i in range(n_transfers):
            tokens.append(rec.async_begin("read", cat="io", track="io:aio",
                                          args={"bytes": 4096 * (i + 1)}))
            rec.instant("submit", cat="io", track="io:aio", args={"i": i})
        submitted.set()

    def completer_thread() -> None:
        submitted.wait()
        for tok in tokens:
            rec.async_end(tok, args={"ok": True})

    threads = [threading.Thread(target=io_thread, name="io"),
               threading.Thread(target=completer_thread, name="completer")]
    for t in threads:
        t.start()
    for i in range(5):
        with rec.span("forward", cat="compute", track="compute", layer=i):
            with rec.span("matmul", cat="compute", track="compute") as s:
                s.set(flops=1e9)
        start = rec.now_ns()
        rec.complete("all_gather", start, start + 1500, cat="comm", track="stream:comm",
                     args={"bytes": 1 << 20})
        rec.counter("tier_bytes", {"HOST": 1000 * i, "NVME": 2 ** 30}, track="tier:HOST")
    for t in threads:
        t.join()


def _check_structure(trace: dict) -> None:
    assert set(trace) >= {"traceEvents", "displayTimeUnit", "metadata"}
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    begins = Counter((e["pid"], e["cat"], e["id"], e["name"]) for e in events if e["ph"] == "b")
    ends = Counter((e["pid"], e["cat"], e["id"], e["name"]) for e in events if e["ph"] == "e")
    assert begins == ends
    assert all(n == 1 for n in begins.values())
    named = {(e["pid"], e["tid"]) for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and e["ts"] >= 0
            assert (e["pid"], e["tid"]) in named, e
        if e["ph"] == "X":
            assert e["dur"] >= 0
        elif e["ph"] == "i":
            assert e["s"] == "t"
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
    thread_names = Counter((e["pid"], e["args"]["name"]) for e in events
                           if e["ph"] == "M" and e["name"] == "thread_name")
    assert all(n == 1 for n in thread_names.values()), thread_names
    sort_indices = {(e["pid"], e["tid"]) for e in events
                    if e["ph"] == "M" and e["name"] == "thread_sort_index"}
    assert sort_indices == named
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)


def test_two_threads_export_valid_chrome_trace(tmp_path: Path) -> None:
    rec = TraceRecorder(enabled=True, rank=0)
    _record_step(rec)
    path = write_chrome_trace(tmp_path / "step.trace.json", rec)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    _check_structure(trace)
    events = trace["traceEvents"]
    by_ph = Counter(e["ph"] for e in events)
    assert by_ph["X"] == 15 and by_ph["b"] == 8 and by_ph["e"] == 8
    assert by_ph["i"] == 8 and by_ph["C"] == 5
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {"compute", "stream:comm", "tier:HOST", "io:aio"}
    assert trace["metadata"]["dropped_events"] == 0
    assert trace["metadata"]["unmatched_async_begins"] == 0
    # A parent span precedes the child span it contains.
    fwd = [e for e in events if e["name"] == "forward"]
    mm = [e for e in events if e["name"] == "matmul"]
    assert fwd[0]["ts"] <= mm[0]["ts"] and mm[0]["ts"] + mm[0]["dur"] <= fwd[0]["ts"] + fwd[0]["dur"]
    assert mm[0]["args"] == {"flops": 1e9}


def test_merging_two_ranks_gives_one_process_per_rank(tmp_path: Path) -> None:
    recs = [TraceRecorder(enabled=True, rank=r) for r in (0, 1)]
    for rec in recs:
        _record_step(rec, n_transfers=3)
    path = write_chrome_trace(tmp_path / "merged.trace.json", *recs)
    trace = load_chrome_trace(path)
    _check_structure(trace)
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    for pid in (0, 1):
        names = [e["args"]["name"] for e in events
                 if e["name"] == "thread_name" and e["pid"] == pid]
        assert sorted(names) == sorted({"compute", "stream:comm", "tier:HOST", "io:aio"})
    ids = [e["id"] for e in events if e["ph"] == "b"]
    assert len(ids) == len(set(ids)) == 6  # unique across ranks
    assert trace["metadata"]["ranks"] == [0, 1]


def test_merge_per_rank_files(tmp_path: Path) -> None:
    paths = []
    for rank in (0, 1):
        rec = TraceRecorder(enabled=True, rank=rank)
        _record_step(rec, n_transfers=2)
        paths.append(write_chrome_trace(tmp_path / f"rank{rank}.trace.json.gz", rec))
    merged = merge_chrome_traces(paths)
    _check_structure(merged)
    ids = [e["id"] for e in merged["traceEvents"] if e["ph"] == "b"]
    assert len(ids) == len(set(ids)) == 4
    assert merged["metadata"]["ranks"] == [0, 1]


def test_disabled_recorder_records_nothing_and_is_cheap() -> None:
    rec = TraceRecorder()  # off by default
    assert rec.enabled is False
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        rec.complete("x", 0, 1, "cat", "compute", None)
    t_complete = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        with rec.span("x", cat="cat", track="compute"):
            pass
    t_span = time.perf_counter() - t0
    for _ in range(1000):
        rec.async_end(rec.async_begin("x"))
        rec.instant("x")
        rec.counter("x", {"a": 1.0})
    assert len(rec) == 0 and rec.events() == []
    # Typically ~10 ms and ~30 ms; the bound is loose so it never flakes.
    assert t_complete < 0.5, f"100k disabled complete() calls took {t_complete:.3f} s"
    assert t_span < 1.0, f"100k disabled span() blocks took {t_span:.3f} s"


def test_null_recorder_stays_disabled() -> None:
    with NULL_RECORDER.span("x") as s:
        s.set(bytes=1)
    assert NULL_RECORDER.async_begin("x") is None
    with pytest.raises(AttributeError, match="always disabled"):
        NULL_RECORDER.enabled = True
    assert NULL_RECORDER.enabled is False and len(NULL_RECORDER) == 0


def test_max_events_drops_and_counts(tmp_path: Path) -> None:
    rec = TraceRecorder(enabled=True, max_events=10)
    tok = rec.async_begin("write", cat="io", track="io:aio", args={"bytes": 8192})
    assert tok is not None
    for i in range(25):
        rec.instant("tick", track="compute", args={"i": i})
    assert rec.async_begin("late", cat="io") is None  # dropped: no token
    rec.async_end(tok)  # kept although the cap is reached, so the pair stays whole
    for _ in range(5):  # a span is one event: dropped past the cap too
        with rec.span("late span", track="compute"):
            pass
    assert len(rec) == 11 and rec.dropped == 22  # 16 instants + "late" + 5 spans
    trace = load_chrome_trace(write_chrome_trace(tmp_path / "capped.trace.json", rec))
    _check_structure(trace)
    assert trace["metadata"]["dropped_events"] == 22
    assert summarize(rec)["dropped"] == 22
    rec.clear()
    assert len(rec) == 0 and rec.dropped == 0


def test_atomic_write_leaves_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    rec = TraceRecorder(enabled=True)
    _record_step(rec, n_transfers=1)
    target = tmp_path / "out.trace.json"
    write_chrome_trace(target, rec)
    write_chrome_trace(target, rec)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.trace.json"]
    before = target.read_bytes()

    def failing_dumps(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("offload.trace.chrome.json.dumps", failing_dumps)
    with pytest.raises(OSError, match="No space"):
        write_chrome_trace(target, rec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.trace.json"]
    assert target.read_bytes() == before


def test_write_without_recorders_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no recorders"):
        write_chrome_trace(tmp_path / "x.json")


def test_span_records_error_and_reraises() -> None:
    rec = TraceRecorder(enabled=True)
    with pytest.raises(KeyError):
        with rec.span("step", cat="compute"):
            raise KeyError("boom")
    (ev,) = rec.events()
    assert ev.phase == "X" and ev.args == {"error": "KeyError"}
    assert ev.track == "thread:MainThread"


def test_complete_rejects_reversed_times() -> None:
    rec = TraceRecorder(enabled=True)
    with pytest.raises(ValueError, match="before it starts"):
        rec.complete("x", 200, 100)


def test_non_json_args_and_non_finite_values_export(tmp_path: Path) -> None:
    rec = TraceRecorder(enabled=True)
    rec.instant("odd", args={"path": tmp_path, "ratio": float("nan"), "shape": (2, 3)})
    rec.counter("bw", {"read": float("inf"), "write": 2.5})
    trace = load_chrome_trace(write_chrome_trace(tmp_path / "odd.trace.json", rec))
    (inst,) = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert inst["args"] == {"path": str(tmp_path), "ratio": "nan", "shape": [2, 3]}
    (cnt,) = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert cnt["args"] == {"write": 2.5}
    with pytest.raises(ValueError):
        rec.counter("bad", {"x": "not a number"})


def test_summarize_totals() -> None:
    rec = TraceRecorder(enabled=True)
    rec.complete("a", 0, 1000, cat="compute", track="compute")
    rec.complete("b", 2000, 2500, cat="compute", track="compute")
    rec.complete("ag", 0, 300, cat="comm", track="stream:comm")
    t1 = rec.async_begin("read", cat="io", args={"bytes": 100}, ts_ns=10)
    rec.async_end(t1, ts_ns=60)
    t2 = rec.async_begin("read", cat="io", ts_ns=20)
    rec.async_end(t2, args={"bytes": 50}, ts_ns=40)
    rec.async_begin("write", cat="io", args={"bytes": 7})
    rec.instant("fallback")
    rec.counter("tier_bytes", {"HOST": 1})
    rec.counter("tier_bytes", {"HOST": 3})
    s = summarize(rec)
    assert s["categories"] == {"compute": {"count": 2, "total_ns": 1500},
                               "comm": {"count": 1, "total_ns": 300}}
    assert s["async"]["read"] == {"count": 2, "in_flight": 0, "total_ns": 70, "total_bytes": 150}
    assert s["async"]["write"]["in_flight"] == 1 and s["async"]["write"]["count"] == 0
    assert s["instants"] == {"fallback": 1}
    assert s["counters"] == {"tier_bytes": {"HOST": 3.0}}
    # An unended begin is exported (it shows what was in flight) and counted.
    assert to_chrome_trace(rec)["metadata"]["unmatched_async_begins"] == 1


def test_summarize_reads_a_written_trace_as_the_recorder(tmp_path: Path) -> None:
    """A saved run totals as the live one did: from the file's path (plain or .gz),
    from its loaded object, and over both ranks of a merged file; not a trace: an
    error naming the file."""
    rec = TraceRecorder(enabled=True, rank=0)
    rec.complete("a", 10_000, 11_000, cat="compute", track="compute")
    t = rec.async_begin("read", cat="io", args={"bytes": 100}, ts_ns=12_000)
    rec.async_end(t, ts_ns=12_060)
    rec.async_begin("write", cat="io", args={"bytes": 7}, ts_ns=13_000)
    rec.instant("evict clean", track="store:policy")
    rec.counter("tier:HOST", {"g": 5})
    live = summarize(rec)
    for name in ("run.trace.json", "run.trace.json.gz"):
        path = write_chrome_trace(tmp_path / name, rec)
        for source in (path, str(path), load_chrome_trace(path)):
            s = summarize(source)
            assert {k: s[k] for k in ("categories", "async", "instants", "counters")} == \
                {k: live[k] for k in ("categories", "async", "instants", "counters")}
            assert s["events"] == live["events"]
    other = TraceRecorder(enabled=True, rank=1)
    t = other.async_begin("read", cat="io", args={"bytes": 50}, ts_ns=12_000)  # same id as rank 0's
    other.async_end(t, ts_ns=12_020)
    both = summarize(write_chrome_trace(tmp_path / "both.trace.json", rec, other))
    assert both["async"]["read"] == {"count": 2, "in_flight": 0, "total_ns": 80,
                                     "total_bytes": 150}
    bad = tmp_path / "notes.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="notes.json"):
        summarize(bad)


@pytest.mark.parametrize("damage", ["event", "count", "ranks", "metadata"])
def test_a_written_trace_with_bad_events_or_metadata_is_refused_naming_it(
        tmp_path: Path, damage: str) -> None:
    """load_chrome_trace (and so summarize and merge) checks what the docs list: events
    that are objects, metadata an object with numeric counts and ranks."""
    from offload.trace import TraceFormatError

    rec = TraceRecorder(enabled=True)
    rec.complete("a", 0, 1000, cat="compute", track="compute")
    trace = to_chrome_trace(rec)
    if damage == "event":
        trace["traceEvents"][1] = 5
    elif damage == "count":
        trace["metadata"]["dropped_events"] = "many"
    elif damage == "ranks":
        trace["metadata"]["ranks"] = ["zero"]
    else:
        trace["metadata"] = [1]
    path = tmp_path / f"{damage}.trace.json"
    path.write_text(json.dumps(trace))
    for read in (load_chrome_trace, summarize, lambda p: merge_chrome_traces([p])):
        with pytest.raises(TraceFormatError, match=f"{damage}.trace.json"):
            read(path)


def test_raw_events_and_declared_track_order() -> None:
    events = [TraceEvent("X", 5_000, 1_000, 0, "late", "c", "b-track", None),
              ("X", 1_000, 2_000, 0, "early", "c", "a-track", {"k": 1})]
    trace = to_chrome_trace(events)
    xs = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs == ["early", "late"]
    assert trace["traceEvents"][-1]["ts"] == 5.0 and trace["traceEvents"][-1]["dur"] == 1.0
    with pytest.raises(ValueError, match="phase"):
        to_chrome_trace([("Z", 0, 0, 0, "n", "c", "t", None)])

    rec = TraceRecorder(enabled=True)
    rec.instant("x", track="io:aio")
    rec.declare_track("compute")
    snap = rec.snapshot()
    assert isinstance(snap, TraceSnapshot) and snap.tracks == ("compute", "io:aio")
    meta = to_chrome_trace(snap)["traceEvents"]
    order = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert order == {"compute": 1, "io:aio": 2}


def test_concurrent_emitters_lose_nothing() -> None:
    rec = TraceRecorder(enabled=True)
    n_threads, n_each = 8, 5_000

    def work(k: int) -> None:
        for i in range(n_each):
            rec.instant("e", track=f"t{k}", args=None)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec) == n_threads * n_each
    assert Counter(e.track for e in rec.events()) == {f"t{k}": n_each for k in range(n_threads)}
