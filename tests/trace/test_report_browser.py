"""The report of a real demo run, loaded in a real headless Chromium.

The page must load with no console error and no request besides itself, and its
DOM must hold the lanes, the occupancy curves and the summary figures the trace
holds: every expected number is computed here from the trace file, by code of
its own, not taken from the report's model. Skipped, saying why, where no
Chromium is installed (`make test` installs it: scripts/install-chromium.sh).

With OFFLOAD_SCREENSHOT_TO=path set, the screenshot of the demo report taken
here is also copied there (docs/view-report.png is made that way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


from .browser import RENDERED, browser  # noqa: F401 (a fixture)
from .facts import prefetch_outcomes

pytestmark = pytest.mark.browser



def run_demo(tmp: Path, *extra: str) -> dict:
    swap, trace = tmp / "swap", tmp / "demo.trace.json"
    swap.mkdir()
    out = subprocess.run([sys.executable, "-m", "offload.cli.main", "demo", "--tiny", "--steps",
                          "3", "--swap-dir", str(swap), "--trace", str(trace), "--json", *extra],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")][-1]
    assert summary["event"] == "summary"
    return summary


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    summary = run_demo(tmp)
    report = Path(summary["report"])
    assert report.parent == Path(summary["trace"]).parent and report.exists()
    return Path(summary["trace"]), report


@pytest.fixture(scope="module")
def page(demo, browser):  # the demo first: a browser starting meanwhile would slow its probes
    _, report = demo
    page = browser.open(report.as_uri())
    page.wait_for(RENDERED)
    page.settle(0.3)
    yield page
    page.close()


# -- what the trace holds, computed here ---------------------------------------------------------
class TraceFacts:
    """Plain reads of the Chrome-trace JSON (rank 0), independent of offload.trace."""

    def __init__(self, path: Path) -> None:
        self.trace = json.loads(path.read_text())
        self.events = [e for e in self.trace["traceEvents"] if e["ph"] != "M" and e["pid"] == 0]
        self.info = self.trace["metadata"]["info"]["0"]
        self.tracks = {e["tid"]: e["args"]["name"] for e in self.trace["traceEvents"]
                       if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 0}
        # the demo's mark of its traced step, and the engine's own inside it: the outer
        # one is the step the report reads
        marks = [e for e in self.events if e["ph"] == "X" and e["name"] == "step"]
        assert len(marks) == 2, marks
        self.marks = marks
        self.step = max(marks, key=lambda e: e["dur"])
        ends = {(e["cat"], e["id"]): e for e in self.events if e["ph"] == "e"}
        self.pairs = [(b, ends[(b["cat"], b["id"])]) for b in self.events
                      if b["ph"] == "b" and (b["cat"], b["id"]) in ends]

    def spans(self, name=None, prefix=None, cat=None):
        return [e for e in self.events if e["ph"] == "X"
                and (name is None or e["name"] == name)
                and (prefix is None or e["name"].startswith(prefix))
                and (cat is None or e["cat"] == cat)]

    def transfers(self, name, cat):
        return [(b, e) for b, e in self.pairs if b["name"] == name and b["cat"] == cat]

    def begins(self, name, cat):
        return [b for b in self.events if b["ph"] == "b" and b["name"] == name and b["cat"] == cat]

    def tier_peak(self, tier):
        samples = [sum(v for k, v in e["args"].items()) for e in self.events
                   if e["ph"] == "C" and e["name"] == f"tier:{tier}"]
        return max(samples) if samples else None

    def exposed_io_us(self, resolution=0.02):
        """Exposed I/O by painting time bins: gathers, main-thread store waits and the
        optimizer phase outside CPU Adam updates, less collective waits."""
        t0, t1 = self.step["ts"], self.step["ts"] + self.step["dur"]
        n = int((t1 - t0) / resolution) + 1

        def paint(bins, a, b, value=True):
            i, j = int(max(0, (a - t0) / resolution)), int(min(n, (b - t0) / resolution))
            if j > i:
                bins[i:j] = value
        waits, idle = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for e in self.spans(cat="wait"):
            if e["name"] == "wait:gather" or (self.tracks[e["tid"]] == "thread:MainThread"):
                paint(waits, e["ts"], e["ts"] + e["dur"])
        for opt in self.spans(name="optimizer step"):
            paint(idle, opt["ts"], opt["ts"] + opt["dur"])
        for u in self.spans(name="optim:update"):
            paint(idle, u["ts"], u["ts"] + u["dur"], False)
        exposed = waits | idle
        for e in self.spans(cat="wait"):
            if e["name"] in ("wait:all-gather", "wait:reduce-scatter", "wait:all-reduce"):
                paint(exposed, e["ts"], e["ts"] + e["dur"], False)
        return exposed.sum() * resolution

    def prefetch_counts(self):
        """In time / late / on demand / resident per use, by the rule in docs/trace.md."""
        fetches = [(b["args"]["key"], b["ts"], e["ts"], b["args"]["steps"])
                   for b, e in self.transfers("fetch", "fetch")]
        return prefetch_outcomes(self.spans(name="wait:gather"), fetches)


def dom(page, expression):
    return page.evaluate(f"(function () {{ {expression} }})()")


def lane_counts(page):
    return dom(page, """return Array.from(document.querySelectorAll('.lane')).map(function (e) {
        return [e.dataset.section, e.dataset.label, +e.dataset.count]; });""")


# -- the tests ------------------------------------------------------------------------------------
def test_demo_report_loads_with_no_error_and_no_request(page) -> None:
    assert page.errors == []
    assert page.foreign_requests() == []
    assert page.requests == [page.url]
    assert page.evaluate("window.offloadReport.renderedAt") > 0


def test_lanes_hold_the_events_of_the_trace(page, demo) -> None:
    facts = TraceFacts(demo[0])
    lanes = {(sec, label): n for sec, label, n in lane_counts(page)}
    reads = facts.begins("read", "io")
    writes = facts.begins("write", "io")
    swap_dir = os.path.basename(os.path.dirname(reads[0]["args"]["path"]))
    expected = {
        ("compute", "step"): len(facts.marks),  # both drawn, the engine's inside the demo's
        ("compute", "forward"): len(facts.spans(prefix="forward:")),
        ("compute", "backward"): len(facts.spans(prefix="backward:")),
        ("waits", "weights (gather)"): len(facts.spans(name="wait:gather")),
        ("waits", "optimizer I/O"): len(facts.spans(prefix="optim:wait")),
        ("nvme", f"read {swap_dir}"): len(reads),
        ("nvme", f"write {swap_dir}"): len(writes),
        ("copies", "HOST->DEVICE"): len(facts.begins("HOST->DEVICE", "store")),
        ("copies", "DEVICE->HOST"): len(facts.begins("DEVICE->HOST", "store")),
        ("fetches", "issue -> arrival"): len(facts.begins("fetch", "fetch")),
        ("optimizer", "update"): len(facts.spans(name="optim:update")),
    }
    for lane, count in expected.items():
        assert count > 0, f"the demo's trace has no {lane} events"
        assert lanes.get(lane) == count, (lane, lanes)
    # the canvas drew them: a good share of its pixels are not background
    inked = dom(page, """var c = document.getElementById('timeline-canvas');
        var d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, n = 0;
        for (var i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i] + d[i + 1] + d[i + 2] < 600) n++;
        return n / (c.width * c.height);""")
    assert inked > 0.02


def _time_text(us: float) -> str:
    """The report's own formatting of a time (report.js's fmtTime; toFixed rounds an
    exact tie up, where Python's format rounds it to even)."""
    from decimal import ROUND_HALF_UP, Decimal

    def fixed(x: float, places: int) -> str:
        return str(Decimal(x).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP))
    a = abs(us)
    if a >= 1e6:
        return f"{fixed(us / 1e6, 1 if a >= 1e7 else 2)} s"
    if a >= 1e3:
        return f"{fixed(us / 1e3, 0 if a >= 1e5 else 1 if a >= 1e4 else 2)} ms"
    return f"{fixed(us, 0 if a >= 100 else 1)} µs"


def test_summary_figures_are_those_of_the_trace(page, demo) -> None:
    facts = TraceFacts(demo[0])
    fig = {f: v for f, v in dom(page, """return Array.from(document.querySelectorAll(
        '.fig[data-group="r0"]')).map(function (e) { return [e.dataset.field,
        e.dataset.value === '' ? null : +e.dataset.value]; });""")}
    assert fig["step_us"] == pytest.approx(facts.step["dur"], abs=0.01)
    # requests still in flight when the trace ended (the next step's read-ahead) do not count
    assert fig["nvme_read"] == sum(b["args"]["bytes"] for b, _ in facts.transfers("read", "io"))
    assert fig["nvme_write"] == sum(b["args"]["bytes"] for b, _ in facts.transfers("write", "io"))
    assert fig["reference_step_us"] == pytest.approx(facts.info["reference_step_s"] * 1e6)
    assert fig["reference_ratio"] == pytest.approx(
        facts.step["dur"] / (facts.info["reference_step_s"] * 1e6), rel=1e-6)
    assert fig["exposed_comm_us"] == 0  # one rank: no collective ran
    assert fig["exposed_io_us"] == pytest.approx(facts.exposed_io_us(), abs=2.0)
    shown = {f: t for f, t in dom(page, """return Array.from(document.querySelectorAll(
        '.fig[data-group="r0"]')).map(function (e) { return [e.dataset.field,
        e.querySelector('.v').textContent]; });""")}
    for field in ("step_us", "exposed_io_us", "exposed_comm_us"):  # what the reader sees
        assert shown[field] == _time_text(fig[field]), (field, shown[field], fig[field])
    reads = facts.transfers("read", "io")
    read_bytes = sum(b["args"]["bytes"] for b, _ in reads)
    covered, last = 0.0, float("-inf")
    for b, e in sorted(reads, key=lambda p: p[0]["ts"]):
        start, end = max(b["ts"], last), e["ts"]
        covered += max(0.0, end - start)
        last = max(last, end)
    assert fig["read_GBps_busy"] == pytest.approx(read_bytes / covered / 1e3, rel=1e-3)
    text = dom(page, "return document.getElementById('summary').innerText;")
    disk = facts.info["disk"]["read_Bps"] / 1e9
    assert f"{disk:.2f} GB/s" in text
    moves = {m: v for m, v in dom(page, """return Array.from(document.querySelectorAll(
        'tr[data-move]')).map(function (e) { return [e.dataset.move, +e.dataset.value]; });""")}
    expected = {}
    for b, _ in facts.pairs:
        if b["cat"] == "store" and "->" in b["name"]:
            expected[b["name"]] = expected.get(b["name"], 0) + b["args"]["bytes"]
    assert moves == expected and moves


def test_occupancy_curves_and_budgets_are_those_of_the_trace(page, demo) -> None:
    facts = TraceFacts(demo[0])
    heads = dom(page, """return Array.from(document.querySelectorAll('.tier-head')).map(
        function (e) { return [e.dataset.tier, +e.dataset.peak, e.dataset.budget]; });""")
    tiers = {t: (peak, budget) for t, peak, budget in heads}
    expected = [t for t in ("DEVICE", "HOST", "NVME") if facts.tier_peak(t) is not None]
    assert list(tiers) == expected and expected
    for tier in expected:
        peak, budget = tiers[tier]
        assert peak == facts.tier_peak(tier)
        assert float(budget or 0) == facts.info["tier_budgets"][tier]  # 0: none (NVME)
    # every tier's curve is drawn, and its budget line (red) too
    drawn = dom(page, """return Array.from(document.querySelectorAll('#occupancy canvas')).map(
        function (c) { var d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          var ink = 0, red = 0;
          for (var i = 0; i < d.length; i += 4) { if (d[i + 3] === 0) continue;
            if (d[i] > 150 && d[i + 1] < 100 && d[i + 2] < 100) red++;
            else if (d[i + 2] > d[i] + 40) ink++; }
          return [ink, red]; });""")
    assert len(drawn) == len(expected)
    for tier, (ink, red) in zip(expected, drawn):
        assert ink > 100, (tier, drawn)
        assert (red > 50) == (facts.info["tier_budgets"][tier] > 0), (tier, drawn)


def test_prefetch_outcomes_are_those_of_the_trace(page, demo) -> None:
    facts = TraceFacts(demo[0])
    rows = dom(page, """return Array.from(document.querySelectorAll(
        '#prefetch tr[data-outcome][data-count]')).map(function (e) {
          return [e.dataset.outcome, +e.dataset.count]; });""")
    assert dict(rows) == facts.prefetch_counts()
    assert sum(n for _, n in rows) == len(facts.spans(name="wait:gather")) > 0
    uses = dom(page, "return document.querySelectorAll('#prefetch tr[data-use]').length;")
    assert uses == len(facts.spans(name="wait:gather"))


def test_tooltip_zoom_and_pan(page, demo) -> None:
    facts = TraceFacts(demo[0])
    dom(page, "document.getElementById('timeline').scrollIntoView(); return 1;")
    lane = dom(page, """return document.querySelector('.lane[data-label="forward"]').dataset.lane;""")
    first = min(facts.spans(prefix="forward:"), key=lambda e: e["ts"])
    where = page.evaluate(f"window.offloadReport.locate({json.dumps(lane)}, 0)")
    page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": where["x"], "y": where["y"]})
    tip = page.wait_for("document.getElementById('tooltip').style.display === 'block' && "
                        "document.getElementById('tooltip').innerText")
    assert first["name"].split(":", 1)[1] in tip and "duration" in tip
    before = page.evaluate("[window.offloadReport.view.t0, window.offloadReport.view.t1]")
    page.send("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": where["x"],
                                           "y": where["y"], "deltaX": 0, "deltaY": -300})
    page.wait_for(f"window.offloadReport.view.t1 - window.offloadReport.view.t0 < "
                  f"{before[1] - before[0]}")
    zoomed = page.evaluate("[window.offloadReport.view.t0, window.offloadReport.view.t1]")
    for kind, x in (("mousePressed", where["x"]), ("mouseMoved", where["x"] + 200),
                    ("mouseReleased", where["x"] + 200)):
        page.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": where["y"],
                                               "button": "left", "clickCount": 1})
    panned = page.wait_for(f"window.offloadReport.view.t0 < {zoomed[0]} && "
                           "[window.offloadReport.view.t0, window.offloadReport.view.t1]")
    assert panned[1] - panned[0] == pytest.approx(zoomed[1] - zoomed[0])
    assert page.errors == []


def test_screenshot(page, tmp_path) -> None:
    dom(page, "window.scrollTo(0, 0); window.offloadReport.zoomTo(0, 1e15); return 1;")
    dom(page, """var s = document.querySelector('.toolbar button[data-step]');
        if (s) s.click(); return 1;""")
    page.settle(0.3)
    shot = page.screenshot(tmp_path / "report.png", clip_height=1500)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data)
    target = os.environ.get("OFFLOAD_SCREENSHOT_TO")
    if target:
        shutil.copyfile(shot, target)


def test_the_checks_catch_a_request_and_an_error(browser, demo, tmp_path) -> None:
    """The same checks on a report changed to load an image and log an error must fail."""
    html = demo[1].read_text(encoding="utf-8")
    bad = html.replace("<div id=\"app\"></div>", "<div id=\"app\"></div><img alt=\"\" "
                       "src=\"http://127.0.0.1:9/pixel.png\"><script>console.error('broken')"
                       "</script>", 1)
    bad = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", bad)
    path = tmp_path / "bad.html"
    path.write_text(bad, encoding="utf-8")
    page = browser.open(path.as_uri())
    try:
        page.wait_for(RENDERED)
        page.settle(0.5)
        assert page.foreign_requests() == ["http://127.0.0.1:9/pixel.png"]
        assert any("broken" in e for e in page.errors)
    finally:
        page.close()


@pytest.mark.slow  # a torchrun job and a browser: 23 s of the default suite
@pytest.mark.distributed
def test_two_ranks_of_a_torchrun_job_share_one_aligned_timeline(browser, tmp_path) -> None:
    summary = run_demo(tmp_path, "--nproc", "2")
    report = Path(summary["report"])
    traces = sorted(report.parent.glob("*.json"))
    assert [t.name for t in traces] == ["demo.rank1.trace.json", "demo.trace.json"]
    page = browser.open(report.as_uri())
    try:
        page.wait_for(RENDERED)
        page.settle(0.2)
        assert page.errors == [] and page.foreign_requests() == []
        groups = dom(page, """return Array.from(document.querySelectorAll('.group-head')).map(
            function (e) { return e.dataset.group; });""")
        assert groups == ["r0", "r1"]
        lanes = dom(page, """return Array.from(document.querySelectorAll('.lane')).map(
            function (e) { return [e.dataset.group, e.dataset.label, +e.dataset.count]; });""")
        for rank, path in ((0, report.parent / "demo.trace.json"),
                           (1, report.parent / "demo.rank1.trace.json")):
            trace = json.loads(path.read_text())
            gathers = sum(1 for e in trace["traceEvents"] if e.get("name") == "wait:gather")
            collectives = sum(1 for e in trace["traceEvents"] if e.get("cat") == "comm"
                              and e["ph"] == "b")
            mine = {label: n for g, label, n in lanes if g == f"r{rank}"}
            assert mine["weights (gather)"] == gathers > 0
            assert collectives > 0 and sum(n for label, n in mine.items() if label in (
                "all-gather", "reduce-scatter", "all-reduce")) == collectives
        # the ranks end each step together (the loss is all-reduced): their step spans,
        # drawn on one clock, end within a few milliseconds of each other
        steps = page.evaluate("JSON.parse(document.getElementById('report-data').textContent)"
                              ".steps")
        ends = [s["end"] for s in steps]
        assert len(ends) == 2 and abs(ends[0] - ends[1]) < 20_000
    finally:
        page.close()
