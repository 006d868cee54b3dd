"""The report's figures and page from traces with known events (real recorders, real files).

One hand-built step whose every figure can be worked out on paper: exposed time,
prefetch outcomes, bytes per move, occupancy and budgets, and the Perfetto
export's additions (occupancy counters, fetch flows, run facts). Browser tests
of the page are in test_report_browser.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from offload.trace import TraceRecorder, load_chrome_trace, merge_chrome_traces, write_chrome_trace
from offload.trace.analysis import (exposed_time, parse_trace, prefetch_outcomes, steps_of,
                                    union, union_length)
from offload.trace.report import (ReportInputError, build_model, default_report_path,
                                  load_traces, render_html, write_report)

US = 1000  # ns per microsecond
BASE = 5_000_000 * US  # the scenario's clock starts here (any perf_counter value)
MiB = 1 << 20


def _us(t: float) -> int:
    return BASE + int(t * US)


def record_step(rec: TraceRecorder, offset_us: float = 0.0) -> None:
    """The scenario (times in microseconds from the step's start, + offset_us):

    step 0..10000: forward 0..4000, backward 4000..8000, optimizer step 8000..10000.
    ('p', 0) is used at 100..600 and fetched inside the use (on demand); ('p', 1) is
    fetched ahead at 700 -> 1200 and used at 1600..1610 (in time, slack 400), fetched
    ahead again at 3950 -> 4100 and used at 4000..4100 (late, waited 100); ('p', 0) is
    fetched ahead at 5000 with nothing to move and used at 6000..6005 (resident).
    """
    o = offset_us

    def span(name, a, b, cat="compute", track="compute", args=None):
        rec.complete(name, _us(a + o), _us(b + o), cat=cat, track=track, args=args)

    def transfer(name, a, b, cat, track, args):
        tok = rec.async_begin(name, cat, track, args, ts_ns=_us(a + o))
        rec.async_end(tok, ts_ns=_us(b + o))

    span("step", 0, 10000, args={"step": 3})
    span("forward", 0, 4000)
    span("backward", 4000, 8000)
    span("optimizer step", 8000, 10000)
    span("forward:a", 100, 1500, args={"unit": "a"})
    span("forward:b", 1600, 3900, args={"unit": "b"})
    span("backward:b", 4000, 6000, args={"unit": "b"})
    span("backward:a", 6000, 7900, args={"unit": "a"})
    span("recompute:b", 4010, 4500, args={"unit": "b"})
    span("wait:gather", 100, 600, "wait", args={"key": "('p', 0)"})
    span("wait:gather", 1600, 1610, "wait", args={"key": "('p', 1)"})
    span("wait:gather", 4000, 4100, "wait", args={"key": "('p', 1)"})
    span("wait:gather", 6000, 6005, "wait", args={"key": "('p', 0)"})
    span("wait:all-gather", 1600, 1605, "wait", track="thread:MainThread")
    transfer("fetch", 150, 550, "fetch", "fetch", {"key": "('p', 0)", "bytes": MiB,
                                                   "steps": "READ+H2D"})
    transfer("fetch", 700, 1200, "fetch", "fetch", {"key": "('p', 1)", "bytes": MiB,
                                                    "steps": "READ+H2D"})
    transfer("fetch", 3950, 4100, "fetch", "fetch", {"key": "('p', 1)", "bytes": MiB,
                                                     "steps": "READ"})
    transfer("fetch", 5000, 5000, "fetch", "fetch", {"key": "('p', 0)", "bytes": MiB,
                                                     "steps": ""})
    transfer("read", 200, 500, "io", "io:aio", {"bytes": MiB, "path": "/swap/a/r0-param.swap"})
    transfer("read", 300, 600, "io", "io:aio", {"bytes": MiB, "path": "/swap/a/r0-param.swap"})
    transfer("write", 8100, 8600, "io", "io:aio", {"bytes": 2 * MiB,
                                                   "path": "/swap/a/r0-optim.swap"})
    transfer("NVME->HOST", 150, 500, "store", "store:NVME->HOST", {"key": "('p', 0)",
                                                                   "bytes": MiB})
    transfer("HOST->DEVICE", 500, 550, "store", "store:HOST->DEVICE", {"key": "('p', 0)",
                                                                       "bytes": MiB})
    transfer("all-gather", 1590, 1605, "comm", "comm", {"bytes": 4 * MiB})
    span("optim:update", 8200, 8400, args={"partition": "0", "chunk": 0})
    span("optim:update", 8600, 8900, args={"partition": "0", "chunk": 1})
    span("optim:wait_read", 8000, 8200, "wait", track="optim")
    rec.instant("evict dirty", "store", "store:policy", {"key": "('p', 0)", "tier": "DEVICE",
                                                         "bytes": MiB}, ts_ns=_us(7000 + o))
    for t, v in ((0, 0), (550, MiB), (7000, 0)):
        rec.counter("tier:DEVICE", {"param": v}, track="tier:DEVICE", ts_ns=_us(t + o))
    for t, p, g in ((0, 2 * MiB, 0), (4500, 2 * MiB, MiB)):
        rec.counter("tier:HOST", {"param": p, "grad": g}, track="tier:HOST", ts_ns=_us(t + o))


def _recorder(rank: int = 0, **info) -> TraceRecorder:
    rec = TraceRecorder(enabled=True, rank=rank)
    rec.set_info(tier_budgets={"DEVICE": 2 * MiB, "HOST": 4 * MiB, "NVME": 0}, **info)
    return rec


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    rec = _recorder(disk={"read_Bps": 2e9, "write_Bps": 1e9}, reference_step_s=0.004)
    record_step(rec)
    return write_chrome_trace(tmp_path / "run.trace.json", rec, metadata={"step": 3})


def test_figures_of_the_hand_built_step(trace_file: Path) -> None:
    (rt,) = parse_trace(load_chrome_trace(trace_file), str(trace_file))
    (step,) = steps_of(rt)
    assert step.label == "step 3" and step.dur == pytest.approx(10000)
    exposed = exposed_time(rt, step)
    # gathers 500 + 10 + 100 + 5, the optimizer phase outside updates 200 + 200 + 1100,
    # less the all-gather wait inside a gather (5)
    assert exposed["io"] == pytest.approx(2110, abs=0.01)
    assert exposed["comm"] == pytest.approx(5, abs=0.01)
    outcomes = [(u.key, u.outcome, round(u.slack_us, 2), round(u.waited_us, 2))
                for u in prefetch_outcomes(rt)]
    assert outcomes == [("('p', 0)", "on demand", 0, 500), ("('p', 1)", "in time", 400, 10),
                        ("('p', 1)", "late", 0, 100), ("('p', 0)", "resident", 0, 5)]


def test_model_holds_lanes_summary_occupancy_and_outcomes(trace_file: Path) -> None:
    model = build_model(load_traces([trace_file]), title="t")
    (group,) = model["groups"]
    lanes = {(lane["section"], lane["label"]): lane for lane in group["lanes"]}
    assert lanes[("compute", "forward")]["count"] == 2
    assert lanes[("compute", "backward")]["count"] == 2
    assert lanes[("compute", "recompute")]["count"] == 1
    assert lanes[("waits", "weights (gather)")]["count"] == 4
    assert lanes[("waits", "collective")]["count"] == 1
    assert lanes[("waits", "optimizer I/O")]["count"] == 1
    assert lanes[("nvme", "read a")]["count"] == 2 and lanes[("nvme", "read a")]["rows"] == 2
    assert lanes[("nvme", "write a")]["count"] == 1
    assert lanes[("copies", "NVME->HOST")]["b"] == [MiB]
    assert lanes[("copies", "evictions")]["count"] == 1
    assert lanes[("fetches", "issue -> arrival")]["count"] == 4
    assert lanes[("optimizer", "update")]["count"] == 2
    assert lanes[("comm", "all-gather")]["count"] == 1
    # lanes come in section order: compute first, then waits
    sections = [lane["section"] for lane in group["lanes"]]
    assert sections.index("compute") < sections.index("waits") < sections.index("nvme")
    (summary,) = model["summary"]
    (st,) = summary["steps"]
    assert st["step_us"] == pytest.approx(10000)
    assert st["nvme_read"] == 2 * MiB and st["nvme_write"] == 2 * MiB
    assert st["read_busy_us"] == pytest.approx(400)      # 200..600, two requests overlapping
    assert st["read_GBps_busy"] == pytest.approx(2 * MiB / 400 / 1e3)
    assert st["read_GBps_step"] == pytest.approx(2 * MiB / 10000 / 1e3)  # over the step
    assert st["write_GBps_step"] == pytest.approx(2 * MiB / 10000 / 1e3)
    assert st["moves"] == {"HOST->DEVICE": MiB, "NVME->HOST": MiB}
    assert summary["disk"] == {"read_Bps": 2e9, "write_Bps": 1e9}
    assert summary["reference_step_s"] == 0.004
    occ = {o["tier"]: o for o in model["occupancy"]}
    assert list(occ) == ["DEVICE", "HOST"]
    assert occ["DEVICE"]["series"][0]["peak"] == MiB and occ["DEVICE"]["series"][0]["budget"] == 2 * MiB
    assert occ["HOST"]["series"][0]["v"] == [2 * MiB, 3 * MiB]
    (pf,) = model["prefetch"]
    totals = pf["totals"][0]
    assert {o: totals[o]["count"] for o in model["outcomes"]} == {
        "in time": 1, "late": 1, "on demand": 1, "resident": 1}
    assert totals["in time"]["slack_us"] == pytest.approx(400)
    assert not model["plan"]["present"]


def test_page_is_self_contained(trace_file: Path, tmp_path: Path) -> None:
    out = write_report([trace_file], tmp_path / "r.html")
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    # nothing that could load a resource: no src/href attributes, no url(), no imports
    assert not re.search(r"\b(src|href)\s*=", html)
    assert "url(" not in html and "@import" not in html
    assert not re.search(r"https?://", html)
    assert not re.search(r"\bfetch\s*\(|XMLHttpRequest|WebSocket|EventSource|sendBeacon", html)
    # the model is embedded as JSON and parses back
    data = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html,
                     re.S).group(1)
    assert json.loads(data)["summary"][0]["steps"][0]["step_us"] == pytest.approx(10000)


def test_script_end_in_a_record_name_cannot_break_out(tmp_path: Path) -> None:
    rec = _recorder()
    rec.complete("</script><b>x", _us(0), _us(10), cat="compute", track="compute")
    path = write_chrome_trace(tmp_path / "t.json", rec)
    html = render_html(build_model(load_traces([path])))
    data = html.split('id="report-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data
    assert "</script><b>x" in json.loads(data)["strings"]


def test_ranks_of_two_hosts_are_aligned_by_their_clock_anchors(tmp_path: Path) -> None:
    r0, r1 = _recorder(0, host="a"), _recorder(1, host="b")
    record_step(r0)
    record_step(r1)  # same perf_counter values, but rank 1's clock reads 2500 us later
    r0.clock_anchor_ns = (BASE, 1_700_000_000_000_000_000)
    r1.clock_anchor_ns = (BASE - 2500 * US, 1_700_000_000_000_000_000)
    paths = [write_chrome_trace(tmp_path / f"r{r}.json", rec) for r, rec in ((0, r0), (1, r1))]
    model = build_model(load_traces(paths))
    steps = {s["group"]: s["start"] for s in model["steps"]}
    assert steps["r1"] - steps["r0"] == pytest.approx(2500)
    # on one host the shared monotonic clock needs no correction
    r1.set_info(host="a")
    paths[1] = write_chrome_trace(tmp_path / "r1.json", r1)
    steps = {s["group"]: s["start"] for s in build_model(load_traces(paths))["steps"]}
    assert steps["r1"] == pytest.approx(steps["r0"])
    assert [g["label"] for g in build_model(load_traces(paths))["groups"]] == ["rank 0", "rank 1"]


def test_a_prediction_is_drawn_beside_its_rank(trace_file: Path, tmp_path: Path) -> None:
    pred = TraceRecorder(enabled=True, rank=0)
    pred.complete("step", 0, 8_000 * US, cat="compute", track="compute", args={"step": 3})
    pred.complete("wait:gather", 100 * US, 300 * US, cat="wait", track="compute",
                  args={"key": "('p', 0)"})
    pred.counter("tier:DEVICE", {"param": MiB // 2}, track="tier:DEVICE", ts_ns=50 * US)
    for op, t in (("fetch", 20), ("fetch", 40), ("evict", 60)):  # the planner's schedule
        pred.instant(op, cat="plan", track="plan", args={"key": "('p', 0)", "at": t},
                     ts_ns=t * US)
    path = write_chrome_trace(tmp_path / "plan.json", pred, metadata={"kind": "predicted"})
    model = build_model(load_traces([trace_file, path]))
    assert [g["label"] for g in model["groups"]] == ["rank 0", "rank 0 (predicted)"]
    steps = {s["group"]: s for s in model["steps"]}
    assert steps["r0p"]["start"] == pytest.approx(steps["r0"]["start"])
    assert model["plan"]["present"]
    (cmp,) = model["plan"]["compare"]
    assert cmp["measured_us"] == pytest.approx(10000) and cmp["predicted_us"] == pytest.approx(8000)
    measured = build_model(load_traces([trace_file]))["summary"][0]["steps"][0]
    assert cmp["measured_exposed_io_us"] == pytest.approx(measured["exposed_io_us"])
    assert cmp["predicted_exposed_io_us"] == pytest.approx(200)  # the predicted wait's
    series = next(o for o in model["occupancy"] if o["tier"] == "DEVICE")["series"]
    assert [s["predicted"] for s in series] == [False, True]
    plan = {(lane["section"], lane["label"]): lane["count"] for lane in model["groups"][1]["lanes"]
            if lane["section"] == "plan"}
    assert plan == {("plan", "fetch"): 2, ("plan", "evict"): 1}


def test_a_prediction_is_compared_with_the_median_step(tmp_path: Path) -> None:
    """Timed steps of 190, 74 and 82 ms beside a prediction of 87: the prediction is
    compared with, and drawn beside, the 82 ms step, as `offload bench plan` compares it
    with the median; before, with the first (an outlier here: 2.18x for the bench's 0.94)."""
    rec = TraceRecorder(enabled=True, rank=0)
    for n, (t0, ms) in enumerate(((0, 190), (200, 74), (300, 82)), start=2):
        rec.complete("step", t0 * 1000 * US, (t0 + ms) * 1000 * US, cat="compute",
                     track="compute", args={"step": n})
    pred = TraceRecorder(enabled=True, rank=0)
    pred.complete("step", 0, 87_000 * US, cat="compute", track="compute", args={"step": 1})
    model = build_model(load_traces([
        write_chrome_trace(tmp_path / "m.json", rec),
        write_chrome_trace(tmp_path / "p.json", pred, metadata={"kind": "predicted"})]))
    (cmp,) = model["plan"]["compare"]
    assert (cmp["measured_step"], cmp["measured_us"]) == ("step 4", pytest.approx(82_000))
    starts = {(s["group"], s["label"]): s["start"] for s in model["steps"]}
    assert starts[("r0p", "step 1")] == pytest.approx(starts[("r0", "step 4")])


def test_a_schedule_alone_marks_the_plan_present(tmp_path: Path) -> None:
    rec = _recorder()
    record_step(rec)
    rec.instant("fetch", cat="plan", track="plan", args={"key": "('p', 1)", "at": 3},
                ts_ns=_us(100))
    model = build_model(load_traces([write_chrome_trace(tmp_path / "t.json", rec)]))
    assert model["plan"]["present"] and model["plan"]["compare"] == []


def test_chrome_export_adds_occupancy_counters_flows_and_facts(trace_file: Path) -> None:
    trace = load_chrome_trace(trace_file)
    assert trace["metadata"]["info"]["0"]["tier_budgets"]["DEVICE"] == 2 * MiB
    assert trace["metadata"]["info"]["0"]["host"]
    occ = [e for e in trace["traceEvents"] if e.get("name") == "occupancy:HOST"]
    assert [e["args"] for e in occ] == [{"used": 2.0 * MiB, "budget": 4.0 * MiB},
                                        {"used": 3.0 * MiB, "budget": 4.0 * MiB}]
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    compute_tid = next(e["tid"] for e in trace["traceEvents"] if e["ph"] == "M"
                       and e["name"] == "thread_name" and e["args"]["name"] == "compute")
    # one arrow per use served by a fetch issued ahead: the in-time and the late one
    assert sorted((e["ph"], e["ts"]) for e in flows) == sorted([
        ("s", (BASE + 700 * US) / 1e3), ("f", (BASE + 1600 * US) / 1e3),
        ("s", (BASE + 3950 * US) / 1e3), ("f", (BASE + 4000 * US) / 1e3)])
    assert all(e["tid"] == compute_tid and e["cat"] == "fetch" for e in flows)
    assert {e["bp"] for e in flows if e["ph"] == "f"} == {"e"}
    timed = [e["ts"] for e in trace["traceEvents"] if e["ph"] != "M"]
    assert timed == sorted(timed)


def test_merging_keeps_flow_ids_unique_and_facts_per_rank(tmp_path: Path) -> None:
    paths = []
    for r in (0, 1):
        rec = _recorder(r)
        record_step(rec)
        paths.append(write_chrome_trace(tmp_path / f"r{r}.json", rec))
    merged = merge_chrome_traces(paths)
    flows = [e for e in merged["traceEvents"] if e["ph"] in ("s", "f")]
    starts = [e["id"] for e in flows if e["ph"] == "s"]
    assert len(starts) == 4 and len(set(starts)) == 4
    assert set(merged["metadata"]["info"]) == {"0", "1"}


def test_union_arithmetic() -> None:
    assert union([(5, 6), (0, 2), (1, 3), (7, 7)]) == [(0, 3), (5, 6)]
    assert union_length([(0, 10), (5, 15)], clip=(2, 12)) == 10


@pytest.mark.parametrize("content, why", [
    (b"{\"traceEvents\": [", "not valid JSON"),
    (b"[1, 2]", "not a Chrome trace"),
    (b"{\"traceEvents\": [{\"ph\": \"X\", \"ts\": \"soon\", \"pid\": 0}]}", "expected a finite number"),
    (b"\x1f\x8b\x08\x00garbage", "not a readable gzip file"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_bad_files_say_which_and_why(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with pytest.raises(ReportInputError, match=re.escape(why)) as e:
        load_traces([bad])
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_duplicate_ranks(trace_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ReportInputError, match="no such file"):
        load_traces([tmp_path / "nope.json"])
    with pytest.raises(ReportInputError, match="rank 0 .* is also in"):
        load_traces([trace_file, trace_file])


def test_default_report_path() -> None:
    assert default_report_path("/x/run.trace.json") == Path("/x/run.report.html")
    assert default_report_path("run.json.gz") == Path("run.report.html")
    assert default_report_path("step") == Path("step.report.html")


def test_a_request_in_flight_at_the_end_is_drawn_not_counted(tmp_path: Path) -> None:
    rec = _recorder()
    record_step(rec)
    rec.async_begin("read", "io", "io:aio", {"bytes": 7 * MiB, "path": "/swap/a/r0-optim.swap"},
                    ts_ns=_us(9990))  # the next step's read-ahead: no end before export
    path = write_chrome_trace(tmp_path / "t.json", rec)
    assert load_chrome_trace(path)["metadata"]["unmatched_async_begins"] == 1
    model = build_model(load_traces([path]))
    lane = next(lane for lane in model["groups"][0]["lanes"] if lane["label"] == "read a")
    assert lane["count"] == 3 and 7 * MiB in lane["b"]
    assert model["summary"][0]["steps"][0]["nvme_read"] == 2 * MiB


def test_values_json_allows_but_a_trace_should_not_have_are_ignored(tmp_path: Path) -> None:
    odd = tmp_path / "odd.json"
    odd.write_text('{"traceEvents": ['
                   '{"ph": "C", "name": "tier:HOST", "ts": 1.0, "pid": 0, "tid": 1, '
                   '"args": {"param": NaN, "grad": 5}},'
                   '{"ph": "b", "name": "read", "cat": "io", "ts": 2.0, "pid": 0, "tid": 2, '
                   '"id": "0x1", "args": {"bytes": Infinity}},'
                   '{"ph": "e", "name": "read", "cat": "io", "ts": 3.0, "pid": 0, "tid": 2, '
                   '"id": "0x1"}],'
                   '"metadata": {"info": {"0": {"tier_budgets": {"HOST": NaN}, '
                   '"reference_step_s": -Infinity, "disk": {"read_Bps": NaN}}}}}')
    out = write_report([odd], tmp_path / "odd.html")
    data = json.loads(out.read_text().split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert data["occupancy"][0]["series"][0]["v"] == [5.0]
    assert data["occupancy"][0]["series"][0]["budget"] is None
    assert data["summary"][0]["steps"][0]["nvme_read"] == 0
    assert data["summary"][0]["disk"] == {} and data["summary"][0]["reference_step_s"] is None


def test_a_failed_step_and_its_retry_are_told_apart(tmp_path: Path) -> None:
    """A step that failed and the retry of its micro-batches carry one number; the
    failed one's card says it failed, and with what."""
    rec = _recorder()
    rec.complete("step", 0, 1_000_000, cat="compute", track="compute",
                 args={"step": 3, "error": "StepFailedError"})
    rec.complete("step", 2_000_000, 3_000_000, cat="compute", track="compute",
                 args={"step": 3})
    path = write_chrome_trace(tmp_path / "retry.trace.json", rec)
    (rt,) = parse_trace(load_chrome_trace(path), str(path))
    assert [s.label for s in steps_of(rt)] == ["step 3 (failed: StepFailedError)", "step 3"]
