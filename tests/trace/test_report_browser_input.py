"""Reports of hostile and odd traces, loaded in a real headless Chromium.

Names from a trace (modules, records, paths, hosts, tiers, kinds of partition) are
text: the page must draw them as such and run nothing they hold, wherever it
shows them (panels, tooltips). Odd but valid traces (no events, many ranks,
negative durations) must render with no console error. Skipped, saying why,
where no Chromium is installed (see test_report_browser.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.trace import TraceRecorder, write_chrome_trace
from offload.trace.report import write_report

from .browser import RENDERED, browser  # noqa: F401 (a fixture)

pytestmark = pytest.mark.browser

# Each variant, if it ran, would set window.pwned: ending the script element, an
# element with an event handler (fires when the image is refused), attribute quotes.
EVIL = ("</script><script>window.pwned='script'</script>"
        "<img src=x onerror=\"window.pwned='img'\">'\"&<!--")


def _hostile_trace(path: Path) -> Path:
    rec = TraceRecorder(enabled=True, rank=0, process_name=EVIL)
    rec.set_info(host=EVIL, tier_budgets={EVIL: 1 << 20, "HOST": 2 << 20})
    t = rec.now_ns()
    ms = 1_000_000
    rec.complete("step", t, t + 10 * ms, cat="compute", track="compute", args={"step": EVIL})
    rec.complete("forward:" + EVIL, t, t + 9 * ms, cat="compute", track="compute",
                 args={EVIL: EVIL})
    rec.complete(EVIL, t, t + 9 * ms, cat=EVIL, track=EVIL, args={"key": EVIL})
    rec.complete("wait:gather", t + 9 * ms, t + 10 * ms, cat="wait", track="compute",
                 args={"key": EVIL})
    tok = rec.async_begin("read", "io", "io:aio", {"bytes": 4096, "path": f"/s/{EVIL}/x"},
                          ts_ns=t)
    rec.async_end(tok, ts_ns=t + 9 * ms)
    for i in range(10):
        rec.counter("tier:" + EVIL, {EVIL: 4096 * (i + 1)}, track="tier", ts_ns=t + i * ms)
    rec.instant(EVIL, cat="plan", track="plan", ts_ns=t + ms)
    return write_chrome_trace(path, rec)


def _open(browser, report: Path):
    page = browser.open(report.as_uri())
    page.wait_for(RENDERED)
    return page


def _hover_middle(page, selector: str) -> str:
    """Moves the mouse over the middle of every element matching ``selector`` in turn;
    returns the tooltip's text at the last one."""
    n = page.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length")
    assert n > 0, selector
    text = ""
    for i in range(n):
        r = page.evaluate(f"""(function () {{
            var e = document.querySelectorAll({json.dumps(selector)})[{i}];
            e.scrollIntoView({{block: 'center'}}); var r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": r[0], "y": r[1]})
        text = page.wait_for("document.getElementById('tooltip').style.display === 'block' "
                             "&& document.getElementById('tooltip').innerText")
    return text


def test_names_from_the_trace_are_text_and_run_nothing(browser, tmp_path: Path) -> None:
    report = write_report([_hostile_trace(tmp_path / "t.json")], tmp_path / "r.html",
                          title=EVIL)
    page = _open(browser, report)
    try:
        assert page.evaluate("document.title") == EVIL
        assert page.evaluate("document.querySelector('h1').textContent") == EVIL
        tier = _hover_middle(page, "#occupancy .plot canvas")  # the tiers' tooltips
        assert EVIL in tier
        lane = page.evaluate(f"""Array.from(document.querySelectorAll('.lane')).filter(
            function (e) {{ return e.dataset.label === {json.dumps(EVIL)}; }})[0].dataset.lane""")
        where = page.evaluate(f"window.offloadReport.locate({json.dumps(lane)}, 0)")
        page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": where["x"],
                                               "y": where["y"]})
        tip = page.wait_for("document.getElementById('tooltip').style.display === 'block' "
                            "&& document.getElementById('tooltip').innerText")
        assert EVIL in tip
        page.settle(0.3)
        assert page.evaluate("window.pwned === undefined"), page.evaluate("window.pwned")
        assert page.evaluate("document.querySelectorAll('img, iframe, object').length") == 0
        assert page.errors == [] and page.foreign_requests() == []
    finally:
        page.close()


def _raw_trace(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("kind", ["no events", "negative durations", "many ranks"])
def test_odd_traces_render_with_no_error(browser, tmp_path: Path, kind: str) -> None:
    if kind == "no events":
        traces = [_raw_trace(tmp_path / "t.json", [])]
    elif kind == "negative durations":
        traces = [_raw_trace(tmp_path / "t.json", [
            {"ph": "X", "name": "step", "cat": "compute", "ts": 100.0, "dur": -50.0, "pid": 0},
            {"ph": "b", "name": "read", "cat": "io", "ts": 10.0, "id": 1, "pid": 0,
             "args": {"bytes": -5}},
            {"ph": "e", "name": "read", "cat": "io", "ts": 5.0, "id": 1, "pid": 0},
            {"ph": "C", "name": "tier:HOST", "ts": 7.0, "pid": 0, "args": {"param": -3}}])]
    else:
        traces = [_raw_trace(tmp_path / f"r{r}.json", [
            {"ph": "X", "name": "step", "cat": "compute", "ts": 1000.0 * r, "dur": 500.0,
             "pid": r},
            {"ph": "C", "name": "tier:HOST", "ts": 1000.0 * r, "pid": r, "args": {"p": r}}])
            for r in range(48)]
    page = _open(browser, write_report(traces, tmp_path / "r.html"))
    try:
        page.settle(0.2)
        assert page.errors == []
        groups = page.evaluate("document.querySelectorAll('.group-head').length")
        assert groups == {"no events": 0, "negative durations": 1, "many ranks": 48}[kind]
    finally:
        page.close()


def test_the_first_view_shows_every_rank_s_steps(browser, tmp_path: Path) -> None:
    """Rank 1's step began 20 ms before rank 0's: the page opens on both (before, on
    rank 0's alone, hiding rank 1's first 18 ms)."""
    from .test_report import US
    paths = []
    for rank, (t0, ms) in enumerate(((20, 100), (0, 110))):
        rec = TraceRecorder(enabled=True, rank=rank)
        rec.set_info(host="h")
        rec.complete("step", t0 * 1000 * US, (t0 + ms) * 1000 * US, cat="compute",
                     track="compute", args={"step": 1})
        paths.append(write_chrome_trace(tmp_path / f"r{rank}.trace.json", rec))
    page = _open(browser, write_report(paths, tmp_path / "r.html"))
    try:
        t0, t1 = page.evaluate("[offloadReport.view.t0, offloadReport.view.t1]")
        assert t0 <= 0 and t1 >= 120_000, (t0, t1)
    finally:
        page.close()


def test_the_plan_table_shows_measured_over_predicted(browser, tmp_path: Path) -> None:
    """A measured step of 10 ms beside its prediction of 8 ms: the plan table reads
    1.25x (slower than planned), and the predicted exposed I/O is the prediction's own
    wait (200 us), not the measured one."""
    from .test_report import MiB, US, _recorder, record_step
    rec = _recorder(disk={"read_Bps": 2e9, "write_Bps": 1e9})
    record_step(rec)
    measured = write_chrome_trace(tmp_path / "run.trace.json", rec, metadata={"step": 3})
    pred = TraceRecorder(enabled=True, rank=0)
    pred.complete("step", 0, 8_000 * US, cat="compute", track="compute", args={"step": 3})
    pred.complete("wait:gather", 100 * US, 300 * US, cat="wait", track="compute",
                  args={"key": "('p', 0)"})
    pred.counter("tier:DEVICE", {"param": MiB // 2}, track="tier:DEVICE", ts_ns=50 * US)
    predicted = write_chrome_trace(tmp_path / "plan.json", pred, metadata={"kind": "predicted"})
    page = _open(browser, write_report([measured, predicted], tmp_path / "r.html"))
    try:
        rows = page.evaluate("Array.from(document.querySelectorAll('#plan tr')).map("
                             "function (r) { return r.innerText; })")
        (row,) = [r for r in rows if "×" in r]
        assert "1.25×" in row and "200 µs" in row and "(step 3)" in row, rows
    finally:
        page.close()
