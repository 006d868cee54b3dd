"""`offload view` of a real training run's trace, and of the inputs and outputs a user
gets wrong: the page's figures against the raw events of the file, module names that
hold markup, long names, an output name that ends in a slash, a trace too large for
the memory the process may use.

Browser tests load the page in a headless Chromium and are skipped, saying why,
where there is none (see browser.py); the others need no browser.
"""

from __future__ import annotations

import gzip
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.trace import TraceRecorder, write_chrome_trace
from offload.trace.report import write_report

from .facts import prefetch_outcomes

VIEW = [sys.executable, "-m", "offload.cli.main", "view"]
RENDERED = "document.documentElement.dataset.rendered === 'true'"
# Module names as a model may hold them (ModuleDict keys are any text without a dot):
# each variant, if the page ran it, would set window.pwned
HOSTILE = ("a</script><script>window['pwned']=1</script>",
           "b<img src=x onerror=\"window['pwned']=2\">'\"&<!--",
           "é\u2028ü—中文\U0001f600")


@pytest.fixture(scope="module")
def browser():
    from .browser import start_browser  # skips the test, saying why, where there is none
    b = start_browser()
    yield b
    b.close()


def _open(browser, report: Path):
    page = browser.open(report.as_uri())
    page.wait_for(RENDERED)
    page.settle(0.2)
    return page


def _view(*args: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run(VIEW + list(args), capture_output=True, text=True, timeout=60,
                          preexec_fn=cap if limit_bytes else None)


# -- a real training run ------------------------------------------------------------------------
class _Named(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({name: torch.nn.Linear(64, 64) for name in HOSTILE})
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.blocks.values():
            x = torch.relu(m(x))
        return self.head(x)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """Three steps of a model whose parameters, gradients and optimizer state live on
    NVMe, traced with the engine's recorder; its trace and the report `offload view`
    writes of it."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme", "dtype": "fp32",
                      "group_size": 3000},
           "optim": {"lr": 1e-2, "chunk_elems": 4096},
           "io": {"paths": [str(tmp / "swap")], "buffer_budget": "32MiB", "grow_step": "4MiB"},
           "store": {"host_budget": "1MiB", "device_budget": "1MiB", "device": "cpu"}}
    torch.manual_seed(0)
    rec = TraceRecorder(enabled=True)
    with offload.initialize(_Named(), cfg, recorder=rec) as engine:
        for _ in range(3):
            engine.backward(engine(torch.randn(8, 64)).square().mean())
            engine.step()
    trace = write_chrome_trace(tmp / "run.trace.json", rec)
    out = _view(str(trace))
    assert out.returncode == 0, out.stderr
    report = Path(out.stdout.strip())
    assert report == tmp / "run.report.html"
    return trace, report


class Raw:
    """Plain reads of the trace file, by the definitions in docs/trace.md; nothing
    from offload.trace."""

    def __init__(self, path: Path) -> None:
        doc = json.loads(path.read_text(encoding="utf-8"))
        events = doc["traceEvents"]
        self.tracks = {e["tid"]: e["args"]["name"] for e in events
                       if e["ph"] == "M" and e["name"] == "thread_name"}
        self.events = [e for e in events if e["ph"] != "M"]
        ends = {(e["cat"], e["id"]): e for e in self.events if e["ph"] == "e"}
        self.pairs = [(b, ends[(b["cat"], b["id"])]) for b in self.events
                      if b["ph"] == "b" and (b["cat"], b["id"]) in ends]
        self.steps = sorted(((e["ts"], e["ts"] + e["dur"], e["args"]["step"]) for e in
                             self.spans(name="step")), key=lambda s: s[0])

    def spans(self, name=None, prefix=None, cat=None):
        return [e for e in self.events if e["ph"] == "X" and (name is None or e["name"] == name)
                and (prefix is None or e["name"].startswith(prefix))
                and (cat is None or e["cat"] == cat)]

    def transfers_begun(self, names, cat, a, b):
        """Completed, error-free transfers whose begin lies in [a, b]."""
        return [(x, y) for x, y in self.pairs if x["name"] in names and x["cat"] == cat
                and a <= x["ts"] <= b and not {**x.get("args", {}), **y.get("args", {})}
                .get("error")]

    def exposed_io(self, a, b):
        """Waits of the compute and idle optimizer time, less collective waits, in [a, b],
        by a sweep over every boundary."""
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in self.spans(cat="wait")
                 if e["name"] == "wait:gather" or self.tracks[e["tid"]] == "thread:MainThread"]
        opt = [(e["ts"], e["ts"] + e["dur"]) for e in self.spans(name="optimizer step")]
        upd = [(e["ts"], e["ts"] + e["dur"]) for e in self.spans(name="optim:update")]
        coll = [(e["ts"], e["ts"] + e["dur"]) for e in self.spans(cat="wait")
                if e["name"] in ("wait:all-gather", "wait:reduce-scatter", "wait:all-reduce")]
        cuts = sorted({a, b, *(t for iv in waits + opt + upd + coll for t in iv)})
        total = 0.0
        for lo, hi in zip(cuts, cuts[1:]):
            if lo < a or hi > b:
                continue
            mid = (lo + hi) / 2

            def inside(ivs):
                return any(x <= mid < y for x, y in ivs)
            if (inside(waits) or (inside(opt) and not inside(upd))) and not inside(coll):
                total += hi - lo
        return total

    def outcomes(self, a, b):
        fetches = [(x["args"]["key"], x["ts"], y["ts"], x["args"].get("steps"))
                   for x, y in self.pairs if x["name"] == "fetch" and x["cat"] == "fetch"
                   and not y.get("args", {}).get("error")]
        return prefetch_outcomes(self.spans(name="wait:gather"), fetches, a, b)


def _figures(page) -> list[dict]:
    return page.evaluate("""Array.from(document.querySelectorAll('#summary .card')).map(
        function (c) { var f = {label: c.dataset.step, moves: {}};
          c.querySelectorAll('.fig').forEach(function (e) {
            f[e.dataset.field] = e.dataset.value === '' ? null : +e.dataset.value; });
          c.querySelectorAll('tr[data-move]').forEach(function (e) {
            f.moves[e.dataset.move] = +e.dataset.value; });
          return f; })""")


@pytest.mark.browser
def test_the_page_of_a_real_run_shows_the_figures_of_its_events(run, browser) -> None:
    """One card per step of the run, each with the step time, NVMe bytes, moves,
    exposed I/O and prefetch outcomes computed here from the file's events."""
    trace, report = run
    raw = Raw(trace)
    assert [s for _, _, s in raw.steps] == [1, 2, 3]
    page = _open(browser, report)
    try:
        assert page.errors == [] and page.foreign_requests() == []
        cards = _figures(page)
        assert [c["label"] for c in cards] == ["step 1", "step 2", "step 3"]
        outcomes = page.evaluate("""Array.from(document.querySelectorAll(
            '#prefetch tr[data-outcome][data-count]')).map(function (e) {
              return [e.dataset.step, e.dataset.outcome, +e.dataset.count]; })""")
        read_total = 0
        for (a, b, _), card in zip(raw.steps, cards):
            assert card["step_us"] == pytest.approx(b - a, abs=0.01)
            for op in ("read", "write"):
                n = sum(x["args"]["bytes"] for x, _ in raw.transfers_begun({op}, "io", a, b))
                assert card[f"nvme_{op}"] == n, (card["label"], op)
                read_total += n if op == "read" else 0
            moves = {}
            for x, _ in raw.transfers_begun({x["name"] for x in raw.events if "->" in x["name"]},
                                            "store", a, b):
                moves[x["name"]] = moves.get(x["name"], 0) + x["args"]["bytes"]
            assert card["moves"] == moves, card["label"]
            assert card["exposed_io_us"] == pytest.approx(raw.exposed_io(a, b), abs=0.05)
            shown = {o: n for step, o, n in outcomes if step == card["label"]}
            assert shown == raw.outcomes(a, b), card["label"]
        assert read_total > 0  # the run read its state back from NVMe
    finally:
        page.close()


@pytest.mark.browser
def test_module_names_of_a_real_run_are_text_in_lanes_and_tooltips(run, browser) -> None:
    """Units named with markup, quotes and non-ASCII text: drawn and shown verbatim in
    the tooltip of their slice, and nothing they hold runs."""
    trace, report = run
    page = _open(browser, report)
    try:
        page.evaluate("document.getElementById('timeline').scrollIntoView(); 1")
        model = page.evaluate("JSON.parse(document.getElementById('report-data').textContent)")
        lane = next(la for g in model["groups"] for la in g["lanes"] if la["label"] == "forward")
        names = [model["strings"][n] for n in lane["n"]]
        for name in HOSTILE:
            assert f"blocks.{name}" in names
            i = names.index(f"blocks.{name}")
            page.evaluate(f"window.offloadReport.zoomTo({lane['s'][i]}, "
                          f"{lane['s'][i] + lane['d'][i]}); 1")
            where = page.evaluate(f"window.offloadReport.locate({json.dumps(lane['id'])}, {i})")
            page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": where["x"],
                                                   "y": where["y"]})
            tip = page.wait_for("document.getElementById('tooltip').style.display === "
                                "'block' && document.getElementById('tooltip').textContent")
            assert f"blocks.{name}" in tip
        assert page.evaluate("window.pwned === undefined")
        assert page.evaluate("document.querySelectorAll('img, iframe, object').length") == 0
        assert page.errors == [] and page.foreign_requests() == []
    finally:
        page.close()


# -- long names ----------------------------------------------------------------------------------
@pytest.mark.browser
def test_a_long_name_wraps_inside_the_tooltip_and_the_header(browser, tmp_path: Path) -> None:
    """A unit named with 600 characters and a file name of 200: the tooltip holds the
    whole name inside its box, on screen, and the page does not grow sideways."""
    unit = "layer" + "x" * 600
    rec = TraceRecorder(enabled=True)
    t = rec.now_ns()
    rec.complete("step", t, t + 10_000_000, cat="compute", track="compute", args={"step": 1})
    rec.complete(f"forward:{unit}", t, t + 9_000_000, cat="compute", track="compute")
    trace = write_chrome_trace(tmp_path / ("t" * 200 + ".trace.json"), rec)
    page = _open(browser, write_report([trace], tmp_path / "r.html"))
    try:
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.evaluate("document.getElementById('timeline').scrollIntoView(); 1")
        lane = page.evaluate("document.querySelector('.lane[data-label=\"forward\"]')"
                             ".dataset.lane")
        where = page.evaluate(f"window.offloadReport.locate({json.dumps(lane)}, 0)")
        page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": where["x"],
                                               "y": where["y"]})
        tip = page.wait_for("document.getElementById('tooltip').style.display === 'block' "
                            "&& document.getElementById('tooltip').textContent")
        assert unit in tip
        box = page.evaluate("""(function () { var t = document.getElementById('tooltip'),
            r = t.getBoundingClientRect(); return [t.scrollWidth, t.clientWidth, r.left,
            r.right, window.innerWidth]; })()""")
        scroll, client, left, right, width = box
        assert scroll <= client + 1, box  # the text does not run out of the box
        assert 0 <= left and right <= width, box
        assert page.errors == []
    finally:
        page.close()


# -- output paths --------------------------------------------------------------------------------
def _small_trace(path: Path) -> Path:
    rec = TraceRecorder(enabled=True)
    t = rec.now_ns()
    rec.complete("step", t, t + 1_000_000, cat="compute", track="compute", args={"step": 1})
    return write_chrome_trace(path, rec)


@pytest.mark.parametrize("exists", [False, True], ids=["no such directory", "a file"])
def test_an_output_name_ending_in_a_slash_names_a_directory(tmp_path: Path,
                                                            exists: bool) -> None:
    """`-o reports/` asks for a directory: without one it is a clear error, never a
    file named `reports` (nor a file of that name replaced)."""
    trace = _small_trace(tmp_path / "run.trace.json")
    target = tmp_path / "reports"
    if exists:
        target.write_bytes(b"")  # an empty file, which a report may replace
    out = _view(str(trace), "-o", f"{target}/")
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"{target}/" in out.stderr and "directory" in out.stderr
    assert target.exists() == exists and (not exists or target.read_bytes() == b"")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run.trace.json"] + (["reports"] if exists else []))


# -- traces larger than memory ---------------------------------------------------------------
LIMIT = 200 << 20  # bytes of address space the viewing process may use


def _larger_than_memory(tmp_path: Path, kind: str) -> Path:
    if kind == "gzip":  # 400 MiB of JSON text from a few hundred KB: gzip members of 1 MiB
        path = tmp_path / "big.trace.json.gz"
        member = gzip.compress(b" " * (1 << 20))
        path.write_bytes(gzip.compress(b'{"traceEvents":[') + member * 400)
    else:  # 60 MB of events: several hundred MB as Python objects
        path = tmp_path / "big.trace.json"
        event = json.dumps({"ph": "X", "name": "forward:layer", "cat": "compute", "pid": 0,
                            "tid": 1, "ts": 1.0, "dur": 2.0})
        with open(path, "w") as f:
            f.write('{"traceEvents":[')
            f.write(",".join([event] * 600_000))
            f.write("]}")
    return path


@pytest.mark.parametrize("kind", ["plain", "gzip"])
def test_a_trace_larger_than_memory_is_one_line_and_writes_nothing(tmp_path: Path,
                                                                   kind: str) -> None:
    """A trace whose events do not fit in the memory the process may use: one line
    naming the file, exit code 2, no report and no temporary file; never a traceback
    ending in MemoryError."""
    small = _small_trace(tmp_path / "small.trace.json")
    ok = _view(str(small), "-o", str(tmp_path / "small.html"), limit_bytes=LIMIT)
    if ok.returncode:
        pytest.skip(f"offload view does not start within {LIMIT >> 20} MiB of address "
                    f"space here: {ok.stderr[-300:]}")
    (tmp_path / "small.html").unlink()
    big = _larger_than_memory(tmp_path, kind)
    out = _view(str(big), "-o", str(tmp_path / "big.html"), limit_bytes=LIMIT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr
    assert out.stderr.count("\n") == 1 and str(big) in out.stderr, out.stderr
    assert "memory" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([small.name, big.name])


def test_write_report_says_which_trace_is_larger_than_memory(tmp_path: Path) -> None:
    """In Python, the same trace is a ReportInputError naming the file, as any trace the
    report cannot read is, and nothing is written."""
    big = _larger_than_memory(tmp_path, "gzip")
    script = ("import sys, resource\n"
              f"resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
              "from offload.trace.report import ReportInputError, write_report\n"
              "try:\n"
              "    write_report([sys.argv[1]], sys.argv[2])\n"
              "except ReportInputError as e:\n"
              "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script, str(big), str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=60)
    if "Error" in out.stderr and "MemoryError" not in out.stderr:
        pytest.skip(f"Python does not start within {LIMIT >> 20} MiB here: {out.stderr[-300:]}")
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert out.stdout.startswith(f"{big}: too large to read"), out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [big.name]
