"""The report's timeline and panels at their edges, loaded in a real headless Chromium:
a timeline of many ranks taller than a canvas may be, a sideways wheel, a zero-length
read, a prediction beside its rank, many steps, times far from the origin.

Skipped, saying why, where no Chromium is installed (see browser.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.trace.report import build_model, load_traces, render_html, write_report

from .browser import RENDERED, start_browser

pytestmark = pytest.mark.browser

MiB = 1 << 20
NEXT_FRAME = "new Promise(function (r) { requestAnimationFrame(function () { " \
             "requestAnimationFrame(function () { r(true); }); }); })"
VIEW = "[offloadReport.view.t0, offloadReport.view.t1]"


@pytest.fixture(scope="module")
def browser():
    b = start_browser()
    yield b
    b.close()


def _write(path: Path, events: list[dict], metadata: dict | None = None) -> Path:
    path.write_text(json.dumps({"traceEvents": events, **({"metadata": metadata}
                                                            if metadata else {})}))
    return path


def _x(name: str, ts: float, dur: float, pid: int = 0, tid: int = 1, cat: str = "compute",
       **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid,
            "tid": tid, "args": args}


def _open(browser, report: Path, dpr: float = 1):
    page = browser.open("about:blank")
    page.send("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 900,
                                                     "deviceScaleFactor": dpr,
                                                     "mobile": False})
    page.navigate(report.as_uri())
    page.wait_for(RENDERED)
    return page


def _canvas_center(page) -> list[float]:
    return page.evaluate("""(function () {
        var c = document.getElementById('timeline-canvas');
        c.scrollIntoView({block: 'start'}); var r = c.getBoundingClientRect();
        return [r.left + r.width / 2, r.top + 30]; })()""")


def _ink(page, lane: str) -> float:
    """The share of the timeline canvas's pixels beside the lane matching CSS selector
    `lane` that are drawn dark (slices, not background or gridlines), 0 where the
    canvas does not cover that lane."""
    return page.evaluate(f"""(function () {{
        var c = document.getElementById('timeline-canvas'), dpr = window.devicePixelRatio;
        var l = document.querySelector({json.dumps(lane)}).getBoundingClientRect();
        var y = Math.round((l.top - c.getBoundingClientRect().top) * dpr);
        var h = Math.round(l.height * dpr), n = 0;
        if (y < 0 || y + h > c.height) return 0;
        var d = c.getContext('2d').getImageData(0, y, c.width, h).data;
        for (var i = 0; i < d.length; i += 4)
          if (d[i + 3] > 0 && d[i] + d[i + 1] + d[i + 2] < 600) n++;
        return n / (d.length / 4); }})()""", timeout=10)


def _wheel(page, x: float, y: float, dx: float, dy: float) -> None:
    page.send("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": x, "y": y,
                                           "deltaX": dx, "deltaY": dy})


# -- a timeline taller than a canvas may be -----------------------------------------------------
RANKS = 128


def _many_ranks(path: Path) -> Path:
    """128 ranks of one step, each with six lanes of four overlapping spans: 44,800 CSS
    px of lanes, 89,600 device px at a devicePixelRatio of 2 (Chromium draws nothing on
    a canvas taller than 65,535 px)."""
    events = []
    for r in range(RANKS):
        events.append(_x("step", 0, 1000, pid=r, step=1))
        for k in range(6):
            events += [_x(f"r{r} t{k} e{j}", 10 * j, 900, pid=r, tid=10 + k, cat="work")
                       for j in range(4)]
    return _write(path, events)


def test_every_rank_of_a_timeline_taller_than_a_canvas_is_drawn(browser, tmp_path) -> None:
    """The canvas draws the rows in view, wherever the page is scrolled to: the first,
    a middle and the last rank's lanes are inked, and the last one's tooltip names its
    slice (before, one canvas as tall as every lane was blank, with no error)."""
    page = _open(browser, write_report([_many_ranks(tmp_path / "t.json")],
                                       tmp_path / "r.html"), dpr=2)
    try:
        assert page.evaluate("window.devicePixelRatio") == 2
        for rank in (0, RANKS // 2, RANKS - 1):
            lane = f'.lane[data-group="r{rank}"][data-label="thread 13"]'
            page.evaluate(f"document.querySelector({json.dumps(lane)})"
                          ".scrollIntoView({block: 'center'})")
            page.evaluate(NEXT_FRAME)
            ink = _ink(page, lane)
            assert ink > 0.3, (rank, ink)
        lane_id = f"r{RANKS - 1}/other/thread 13"
        where = page.evaluate(f"window.offloadReport.locate({json.dumps(lane_id)}, 3)")
        page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": where["x"],
                                               "y": where["y"]})
        tip = page.wait_for("document.getElementById('tooltip').style.display === 'block' "
                            "&& document.getElementById('tooltip').innerText")
        assert f"r{RANKS - 1} t3 e3" in tip, tip
        assert page.errors == []
    finally:
        page.close()


# -- one page: a step with a read of zero length, a prediction beside its rank -------------------
@pytest.fixture(scope="module")
def page(browser, tmp_path_factory):
    """Rank 0: steps 1 and 2 of 10 ms; in step 1 a read of 4 KiB begun and ended at one
    instant; HOST holds up to 2 MiB of a 4 MiB budget. Its prediction: HOST holds 8 MiB
    of an 8 MiB budget."""
    tmp = tmp_path_factory.mktemp("view")
    measured = _write(tmp / "run.trace.json", [
        _x("step", 0, 10_000, step=1), _x("step", 10_000, 10_000, step=2),
        _x("forward", 0, 4000), _x("forward", 10_000, 4000),
        {"ph": "b", "name": "read", "cat": "io", "ts": 500, "id": 1, "pid": 0, "tid": 2,
         "args": {"bytes": 4096}},
        {"ph": "e", "name": "read", "cat": "io", "ts": 500, "id": 1, "pid": 0, "tid": 2},
        *({"ph": "C", "name": "tier:HOST", "ts": t, "pid": 0, "tid": 3, "args": {"param": v}}
          for t, v in ((0, MiB), (5000, 2 * MiB), (15_000, MiB)))],
        {"info": {"0": {"tier_budgets": {"HOST": 4 * MiB}}}})
    predicted = _write(tmp / "plan.predicted.trace.json", [
        _x("step", 0, 9000, step=1),
        *({"ph": "C", "name": "tier:HOST", "ts": t, "pid": 0, "tid": 3, "args": {"param": v}}
          for t, v in ((0, 4 * MiB), (3000, 8 * MiB)))],
        {"kind": "predicted", "info": {"0": {"tier_budgets": {"HOST": 8 * MiB}}}})
    page = _open(browser, write_report([measured, predicted], tmp / "r.html"))
    yield page
    page.close()


def test_a_sideways_wheel_pans_and_does_not_zoom(page) -> None:
    """A wheel of deltaX 200, deltaY 0 (a trackpad's swipe) moves the view later by
    200 px of time and keeps its span; -200 moves it back (before, it zoomed in)."""
    x, y = _canvas_center(page)
    t0, t1 = page.evaluate(VIEW)
    width = page.evaluate("document.getElementById('timeline-canvas').clientWidth")
    _wheel(page, x, y, 200, 0)
    a0, a1 = page.wait_for(f"offloadReport.view.t0 !== {t0} && {VIEW}")
    assert a1 - a0 == pytest.approx(t1 - t0)
    assert a0 - t0 == pytest.approx(200 / width * (t1 - t0), rel=0.02)
    _wheel(page, x, y, -200, 0)
    b0, b1 = page.wait_for(f"offloadReport.view.t0 !== {a0} && {VIEW}")
    assert (b0, b1) == (pytest.approx(t0), pytest.approx(t1))
    _wheel(page, x, y, 0, -300)  # upright: zooms in
    page.wait_for(f"offloadReport.view.t1 - offloadReport.view.t0 < {t1 - t0}")
    assert page.errors == []


def test_reads_of_no_measurable_time_are_not_no_reads(page) -> None:
    """Step 1's read of 4 KiB took no time: its rate is not known, and the card says
    why, not "no reads" beside the 4 KiB; step 2 read nothing: "no reads"."""
    subs = page.evaluate("""Array.from(document.querySelectorAll(
        '.card[data-group="r0"] .fig[data-field="read_GBps_busy"]')).map(function (e) {
          return [e.closest('.card').dataset.step, e.dataset.value,
                  e.querySelector('.s').textContent]; })""")
    reads = page.evaluate("""Array.from(document.querySelectorAll(
        '.card[data-group="r0"] .fig[data-field="nvme_read"]')).map(function (e) {
          return +e.dataset.value; })""")
    assert reads == [4096, 0]
    assert subs == [["step 1", "", "reads took no measurable time"],
                    ["step 2", "", "no reads"]]


def test_the_occupancy_heading_reads_the_measured_rank(page) -> None:
    """HOST: the heading's peak and budget are the measured rank's (2 of 4 MiB), not its
    prediction's 8 of 8 MiB, which its own line names."""
    head = page.evaluate("""(function () {
        var h = document.querySelector('.tier-head[data-tier="HOST"]');
        return [+h.dataset.peak, +h.dataset.budget, h.innerText,
                Array.from(h.querySelectorAll('[data-series]')).map(function (s) {
                  return [s.dataset.series, +s.dataset.peak, s.textContent]; })]; })()""")
    peak, budget, text, series = head
    assert (peak, budget) == (2 * MiB, 4 * MiB)
    assert "peak 2.0 MiB" in text and "budget 4.0 MiB (50%)" in text, text
    assert series == [["r0", 2 * MiB, "rank 0 2.0 MiB"],
                      ["r0p", 8 * MiB, "rank 0 (predicted) 8.0 MiB of 8.0 MiB"]]


# -- many steps -----------------------------------------------------------------------------------
def test_the_step_buttons_of_many_steps_are_one_per_name_in_order(browser, tmp_path) -> None:
    """Two ranks of 20,000 steps each, named alike: one button per name, in order (the
    toolbar's de-duplication, once a lookup among all the steps before each, 2 s
    here, is a set: `offloadReport.buildMs.timeline` shows about 70 ms; not asserted,
    a time)."""
    model = build_model(load_traces([_write(tmp_path / "t.json", [_x("step", 0, 10, step=1)])]))
    model["steps"] = [{"group": g, "label": f"step {i}", "start": i * 0.01,
                       "end": i * 0.01 + 0.005} for g in ("r0", "r1") for i in range(20_000)]
    report = tmp_path / "r.html"
    report.write_text(render_html(model), encoding="utf-8")
    page = _open(browser, report)
    try:
        labels = page.evaluate("Array.from(document.querySelectorAll("
                               "'.toolbar button[data-step]')).map(function (b) { "
                               "return b.dataset.step; })")
        assert labels == [f"step {i}" for i in range(20_000)]
        assert page.errors == []
    finally:
        page.close()


# -- times far from the origin (last: a page that hangs would hold up the next ones) -------------
def test_zooming_in_far_from_the_origin_does_not_hang(browser, tmp_path) -> None:
    """A step at 0 and a forward at 1.7e15 us (an epoch's microseconds): zoomed in on
    the forward as far as the wheel goes, the page answers and draws it (before, the
    gridlines' loop stepped by less than the float spacing there and never ended)."""
    trace = _write(tmp_path / "t.json", [_x("step", 0, 100, step=1),
                                         _x("forward", 1.7e15, 100)])
    page = _open(browser, write_report([trace], tmp_path / "r.html"))
    try:
        page.evaluate("offloadReport.zoomTo(1.7e15, 1.7e15 + 0.5)", timeout=10)
        x, y = _canvas_center(page)
        for _ in range(4):
            _wheel(page, x, y, 0, -300)
        t0, t1 = page.evaluate(f"new Promise(function (r) {{ requestAnimationFrame("
                               f"function () {{ r({VIEW}); }}); }})", timeout=10)
        assert t0 < 1.7e15 < t1 and 1 <= t1 - t0 < 1000, (t0, t1)
        assert _ink(page, '.lane[data-label="phases"]') > 0.05
        assert page.errors == []
    finally:
        page.close()
