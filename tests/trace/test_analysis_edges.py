"""Figures of traces at their edges: a negative duration, a request still in flight at
the end, steps with no number, a negative byte count, steps that touch."""

from __future__ import annotations

import json
from pathlib import Path

from offload.trace import TraceRecorder, load_chrome_trace, write_chrome_trace
from offload.trace.analysis import (RankTrace, Span, Step, StepIndex, bytes_moved,
                                    bytes_moved_per_step, parse_trace, steps_of)
from offload.trace.report import build_model, load_traces

US = 1000  # ns per microsecond


def test_a_negative_duration_is_drawn_and_summed_as_none(tmp_path: Path) -> None:
    """A span whose dur is negative (a hand-edited or foreign trace) lasts 0, not less."""
    path = tmp_path / "neg.trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "step", "cat": "compute", "ts": 0.0, "dur": 100.0, "pid": 0,
         "tid": 1, "args": {"step": 1}},
        {"ph": "X", "name": "forward", "cat": "compute", "ts": 10.0, "dur": -5.0, "pid": 0,
         "tid": 1}]}))
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    forward = next(s for s in rt.spans if s.name == "forward")
    assert (forward.start, forward.end) == (10.0, 10.0)
    model = build_model(load_traces([path]))
    assert model["summary"][0]["steps"][0]["phases_us"]["forward"] == 0.0
    lane = next(lane for g in model["groups"] for lane in g["lanes"] if lane["label"] == "phases")
    assert lane["d"] == [0.0]


def test_a_request_in_flight_at_the_end_lasts_until_the_last_event(tmp_path: Path) -> None:
    """An async begin with no end is drawn up to the rank's last timestamp (docs of parse_trace)."""
    rec = TraceRecorder(enabled=True)
    rec.complete("step", 0, 10_000 * US, cat="compute", track="compute", args={"step": 1})
    rec.async_begin("read", "io", "io:aio", {"bytes": 4096, "path": "/swap/a/r0.swap"},
                    ts_ns=9_990 * US)
    path = write_chrome_trace(tmp_path / "t.trace.json", rec)
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    read = next(s for s in rt.spans if s.name == "read")
    assert read.args["unfinished"] is True and (read.start, read.end) == (9_990.0, 10_000.0)
    model = build_model(load_traces([path]))
    lane = next(lane for lane in model["groups"][0]["lanes"] if lane["label"] == "read a")
    assert lane["d"] == [10.0]


def test_requests_in_flight_read_the_rank_s_events_once(tmp_path: Path, monkeypatch) -> None:
    """Each request still in flight ends at the rank's last timestamp, found once per rank:
    before, each read every event of its rank again (16,000 of them took 30 s to view)."""
    from offload.trace.analysis import RankTrace
    events = [{"ph": "X", "name": "step", "cat": "compute", "ts": 0.0, "dur": 50.0, "pid": 0,
               "tid": 1, "args": {"step": 1}}]
    events += [{"ph": "b", "cat": "io", "name": "read", "id": hex(i), "ts": float(i),
                "pid": 0, "tid": 2, "args": {"bytes": 4096}} for i in range(200)]
    path = tmp_path / "open.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    calls = []
    extent = RankTrace.extent
    monkeypatch.setattr(RankTrace, "extent", lambda rt: calls.append(1) or extent(rt))
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    assert len(calls) == 1
    reads = sorted((s.start, s.end) for s in rt.spans if s.name == "read")
    # until the rank's last timestamp so far: the step's end, or the request's begin
    assert reads == [(float(i), max(50.0, i)) for i in range(200)]


def test_unnumbered_steps_count_from_one(tmp_path: Path) -> None:
    rec = TraceRecorder(enabled=True)
    rec.complete("step", 0, 1_000 * US, cat="compute", track="compute")
    rec.complete("step", 2_000 * US, 3_000 * US, cat="compute", track="compute")
    path = write_chrome_trace(tmp_path / "t.trace.json", rec)
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    assert [s.label for s in steps_of(rt)] == ["step 1", "step 2"]


def test_a_negative_byte_count_moves_nothing(tmp_path: Path) -> None:
    """bytes < 0 comes from no transfer: left out, not subtracted from the step's reads."""
    rec = TraceRecorder(enabled=True)
    rec.complete("step", 0, 1_000 * US, cat="compute", track="compute", args={"step": 1})
    for n, t in ((4096, 100), (-4096, 300)):
        tok = rec.async_begin("read", "io", "io:aio", {"bytes": n}, ts_ns=t * US)
        rec.async_end(tok, ts_ns=(t + 50) * US)
    path = write_chrome_trace(tmp_path / "t.trace.json", rec)
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    (step,) = steps_of(rt)
    assert bytes_moved(rt, step)["nvme_read"] == 4096
    model = build_model(load_traces([path]))
    lane = next(lane for lane in model["groups"][0]["lanes"] if lane["section"] == "nvme")
    assert sorted(lane["b"]) == [0, 4096]


def test_an_event_at_the_instant_one_step_ends_and_the_next_begins_is_the_next_s() -> None:
    """Steps hold [start, end): where step 1 ends as step 2 begins, a read begun at that
    instant is step 2's alone (both steps counted it before); a step of zero length
    holds its one instant, so what began in it is still counted."""
    one, two, still = Step("step 1", 0.0, 100.0), Step("step 2", 100.0, 200.0), \
        Step("step 3", 300.0, 300.0)
    assert one.holds(0.0) and not one.holds(100.0) and two.holds(100.0)
    assert not two.holds(200.0) and still.holds(300.0) and not still.holds(300.5)
    index = StepIndex([one, two, still])
    assert index.holding(100.0) == [1] and index.holding(300.0) == [2]
    assert index.holding(200.0) == [] and index.holding(99.5) == [0]
    rt = RankTrace(0, "rank 0", "<test>", [
        Span(100.0, 120.0, "read", "io", "io:aio", {"bytes": 4096}, is_async=True),
        Span(300.0, 300.0, "write", "io", "io:aio", {"bytes": 512}, is_async=True)])
    moved = bytes_moved_per_step(rt, [one, two, still])
    assert [m["nvme_read"] for m in moved] == [0, 4096, 0]
    assert [m["nvme_write"] for m in moved] == [0, 0, 512]
