"""`offload view` as a user runs it: a real process, real files, one clear line on bad input."""

from __future__ import annotations

import gzip
import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from offload.trace import TraceRecorder, write_chrome_trace

VIEW = [sys.executable, "-m", "offload.cli.main", "view"]


def _trace(path: Path, rank: int = 0) -> Path:
    rec = TraceRecorder(enabled=True, rank=rank)
    rec.set_info(tier_budgets={"DEVICE": 1 << 20, "HOST": 2 << 20, "NVME": 0})
    t = rec.now_ns()
    rec.complete("step", t, t + 5_000_000, cat="compute", track="compute", args={"step": 1})
    rec.complete("forward:block", t + 10_000, t + 2_000_000, cat="compute", track="compute")
    tok = rec.async_begin("read", "io", "io:aio", {"bytes": 4096, "path": "/s/x.swap"}, ts_ns=t)
    rec.async_end(tok, ts_ns=t + 100_000)
    rec.counter("tier:HOST", {"param": 4096}, track="tier:HOST", ts_ns=t + 1000)
    return write_chrome_trace(path, rec)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(VIEW + list(args), capture_output=True, text=True, timeout=60,
                          env=env)


def test_writes_the_report_beside_the_trace_and_prints_its_path(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "run.trace.json")
    out = _run(str(trace))
    assert out.returncode == 0, out.stderr
    report = tmp_path / "run.report.html"
    assert out.stdout.strip() == str(report)
    html = report.read_text(encoding="utf-8")
    assert "forward" in html and '"tier_budgets"' not in html  # the model, not the raw trace


def test_several_ranks_gzip_and_an_output_path(tmp_path: Path) -> None:
    r0 = _trace(tmp_path / "r0.json")
    r1 = _trace(tmp_path / "r1.json.gz", rank=1)
    with gzip.open(r1) as f:
        assert json.load(f)["traceEvents"]
    out = _run(str(r0), str(r1), "-o", str(tmp_path / "both.html"), "--title", "two ranks")
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "both.html").read_text(encoding="utf-8")
    assert "<title>two ranks</title>" in html
    assert '"label":"rank 0"' in html and '"label":"rank 1"' in html


def _bad(tmp_path: Path, *args: str) -> str:
    out = _run(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offload view: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_missing_trace(tmp_path: Path) -> None:
    line = _bad(tmp_path, str(tmp_path / "nope.json"))
    assert "nope.json: no such file" in line


def test_corrupt_traces(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    cut = tmp_path / "cut.json"
    cut.write_bytes(trace.read_bytes()[:200])
    assert "cut.json: not valid JSON" in _bad(tmp_path, str(cut))
    other = tmp_path / "other.json"
    other.write_text('{"hello": "world"}')
    assert "other.json: not a Chrome trace" in _bad(tmp_path, str(other))
    gz = tmp_path / "broken.json.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes())[:60])
    assert "broken.json.gz: not a readable gzip file" in _bad(tmp_path, str(gz))
    assert "is a directory" in _bad(tmp_path, str(tmp_path))
    data = json.loads(trace.read_text())  # checked as load_chrome_trace checks it
    for name, meta, why in [("newer", {"format_version": 99}, "written in trace format 99"),
                            ("ranks", {"ranks": ["zero"]}, "ranks")]:
        (tmp_path / f"{name}.json").write_text(json.dumps({**data, "metadata": meta}))
        line = _bad(tmp_path, str(tmp_path / f"{name}.json"))
        assert f"{name}.json" in line and why in line, line
    # nothing was written for any of them
    assert not list(tmp_path.glob("*.html"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    trace.chmod(0)
    try:
        assert "cannot read it" in _bad(tmp_path, str(trace))
    finally:
        trace.chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_bad_output_paths(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    assert "does not exist" in _bad(tmp_path, str(trace), "-o", str(tmp_path / "no" / "r.html"))
    assert "is a directory" in _bad(tmp_path, str(trace), "-o", str(tmp_path))
    afile = tmp_path / "afile"
    afile.write_text("")
    assert "is not a directory" in _bad(tmp_path, str(trace), "-o", str(afile / "r.html"))
    # a directory that refuses new files, even to root
    assert "cannot write the report" in _bad(tmp_path, str(trace), "-o", "/proc/r.html")
    assert "-o: an empty name" in _bad(tmp_path, str(trace), "-o", "")  # not the default
    assert not list(tmp_path.glob("*.report.html"))


def test_open_hands_the_file_to_the_browser(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    seen = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f"#!/bin/sh\necho \"$1\" > {seen}\n")
    browser.chmod(0o755)
    env = {**os.environ, "BROWSER": str(browser)}
    env.pop("DISPLAY", None)
    env.pop("WAYLAND_DISPLAY", None)
    out = _run(str(trace), "--open", env=env)
    assert out.returncode == 0, out.stderr
    assert seen.read_text().strip() == (tmp_path / "t.report.html").as_uri()


def test_help_names_the_options() -> None:
    out = _run("--help")
    assert out.returncode == 0
    for flag in ("TRACE", "--output", "--open", "--title"):
        assert flag in out.stdout


def test_demo_writes_the_report_beside_its_trace_and_prints_its_path(tmp_path: Path) -> None:
    swap, trace = tmp_path / "swap", tmp_path / "run.trace.json"
    swap.mkdir()
    out = subprocess.run([sys.executable, "-m", "offload.cli.main", "demo", "--tiny", "--steps",
                          "2", "--trace-step", "2", "--swap-dir", str(swap), "--trace",
                          str(trace)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = tmp_path / "run.report.html"
    assert f"report: {report}" in out.stdout.replace("\n", "")
    html = report.read_text(encoding="utf-8")
    assert '"title":"offload demo (tiny), step 2"' in html
    info = json.loads(trace.read_text())["metadata"]["info"]["0"]
    assert info["disk"]["read_Bps"] > 0 and info["reference_step_s"] > 0
    assert set(info["tier_budgets"]) == {"DEVICE", "HOST", "NVME"}


def test_a_file_that_is_not_a_report_is_not_replaced(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    notes = tmp_path / "notes.html"
    notes.write_text("<p>my notes</p>")
    line = _bad(tmp_path, str(trace), "-o", str(notes))
    assert f"{notes}: exists and is not a report" in line and "-o" in line
    assert notes.read_text() == "<p>my notes</p>"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "is not a regular file" in _bad(tmp_path, str(trace), "-o", str(fifo))
    assert "is not a regular file" in _bad(tmp_path, str(trace), "-o", "/dev/null")
    assert Path("/dev/null").is_char_device()
    # a report, or an empty file, is replaced
    for out in (tmp_path / "t.report.html", tmp_path / "empty.html"):
        out.touch()
        assert _run(str(trace), "-o", str(out)).returncode == 0
        assert _run(str(trace), "-o", str(out)).returncode == 0
        assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty.html", "notes.html", "pipe", "t.json", "t.report.html"]


def test_the_report_never_replaces_its_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    before = trace.read_bytes()
    line = _bad(tmp_path, str(trace), "-o", str(trace))
    assert f"{trace}: is one of the traces" in line and "t.report.html" in line
    assert trace.read_bytes() == before


def test_numbers_no_trace_holds_are_one_line(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text('{"traceEvents": [{"ph": "X", "ts": 1' + "0" * 400 + ', "pid": 0}]}')
    assert "big.json: event" in _bad(tmp_path, str(big))
    digits = tmp_path / "digits.json"
    digits.write_text('{"traceEvents": [], "x": 1' + "0" * 5000 + "}")
    assert "digits.json: not a trace file" in _bad(tmp_path, str(digits))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert "deep.json: not a trace file" in _bad(tmp_path, str(deep))
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert "empty.json: the file is empty" in _bad(tmp_path, str(empty))
    assert not list(tmp_path.glob("*.html"))


def test_a_trace_whose_name_is_not_utf8(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    odd = os.fsencode(tmp_path) + b"/run\xff.trace.json"
    os.rename(trace, odd)
    out = subprocess.run(VIEW + [odd], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = os.fsencode(tmp_path) + b"/run\xff.report.html"
    assert out.stdout.strip() == report
    assert b"<title>offload trace report: run\xef\xbf\xbd.trace.json</title>" in \
        Path(os.fsdecode(report)).read_bytes()


def test_a_failed_write_leaves_the_old_report_whole_and_no_partial_file(tmp_path: Path) -> None:
    import resource
    import signal

    trace = _trace(tmp_path / "t.json")
    assert _run(str(trace)).returncode == 0
    report = tmp_path / "t.report.html"
    before = report.read_bytes()
    limit = len(before) // 2

    def small_files() -> None:  # the disk fills up half-way through the new report
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = subprocess.run(VIEW + [str(trace), "--title", "new"], capture_output=True, text=True,
                         timeout=60, preexec_fn=small_files)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{report}: cannot write the report" in out.stderr
    assert report.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.report.html"]


def _events(*events: dict) -> str:
    return json.dumps({"traceEvents": list(events), "metadata": {"format_version": 1}})


_STEP = {"name": "step", "cat": "compute", "ph": "X", "ts": 1.0, "dur": 5.0, "pid": 0,
         "tid": 1, "args": {"step": 1}}


@pytest.mark.parametrize("name, events, field", [
    ("tid-list", [{"name": "thread_name", "ph": "M", "pid": 0, "tid": [1],
                   "args": {"name": "compute"}}, _STEP], "tid=[1]"),
    ("tid-object", [{**_STEP, "tid": {"a": 1}}], "tid={'a': 1}"),
    ("pid-list", [{**_STEP, "pid": [0]}], "pid=[0]"),
    ("id-list", [_STEP, {"name": "read", "cat": "io", "ph": "b", "ts": 1.0, "pid": 0,
                         "tid": 1, "id": [7]}], "id=[7]"),
])
def test_an_event_whose_ids_are_lists_or_objects_is_one_line(tmp_path: Path, name: str,
                                                             events: list, field: str) -> None:
    path = tmp_path / f"{name}.json"
    path.write_text(_events(*events))
    line = _bad(tmp_path, str(path), "-o", str(tmp_path / "out.html"))
    assert f"{name}.json: event" in line and field in line, line
    assert not list(tmp_path.glob("*.html"))


def test_a_path_that_is_not_a_regular_file_is_refused_not_read(tmp_path: Path) -> None:
    """A FIFO would block the read until a writer came (none does), /dev/zero never
    ends: each is one line naming it. The address space is capped so that a reader
    that did read /dev/zero fails here instead of calling the OOM killer."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cap = 4 << 30

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for path in (str(fifo), "/dev/zero"):
        out = subprocess.run(VIEW + [path, "-o", str(tmp_path / "out.html")],
                             capture_output=True, text=True, timeout=30, preexec_fn=limit)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr[-2000:])
        assert out.stderr == f"offload view: {path}: is not a regular file (a pipe, device or "\
            "socket); pass the trace file a run wrote\n", out.stderr[-2000:]
    assert not list(tmp_path.glob("*.html"))


def test_looking_at_a_fifo_before_replacing_it_does_not_block(tmp_path: Path) -> None:
    """`regular_file_head` (what a writer reads of a file before it replaces it) opens
    without blocking: an ordinary open of a FIFO waits for a writer that never comes."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = ("import sys; from offload.files import regular_file_head; "
            "print(regular_file_head(sys.argv[1], 64, gunzip=True))")
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "None\n", out.stderr[-2000:]


def test_a_rate_no_float_holds_is_drawn_as_not_known(tmp_path: Path) -> None:
    """A step and a read of 5e-324 us (the least float above 0): bytes over that time is
    no finite number, which the report shows as not known, exit 0; before, a traceback
    of the JSON encoder and exit 1."""
    path = tmp_path / "tiny.json"
    path.write_text(_events(
        {**_STEP, "ts": 0.0, "dur": 5e-324},
        {"name": "read", "cat": "io", "ph": "b", "ts": 0.0, "pid": 0, "tid": 2, "id": 1,
         "args": {"bytes": 1 << 20}},
        {"name": "read", "cat": "io", "ph": "e", "ts": 5e-324, "pid": 0, "tid": 2, "id": 1}))
    out = _run(str(path), "-o", str(tmp_path / "tiny.html"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert '"read_GBps_busy":null' in (tmp_path / "tiny.html").read_text(encoding="utf-8")
