"""The report's figures and files: time waited in the prefetch totals, a page of the
user's own not replaced, the report readable by everyone, each rank's host named."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from offload.trace import TraceRecorder, write_chrome_trace
from offload.trace.report import ReportInputError, build_model, is_report, load_traces, \
    write_report

US = 1000


def _trace(tmp_path: Path) -> Path:
    """One step: ('k', 0) fetched ahead at 100 -> 700 and used at 500..700 (late, waited
    200); ('k', 1) used at 1000..1300 and fetched inside it (on demand, waited 300)."""
    rec = TraceRecorder(enabled=True)
    rec.complete("step", 0, 10_000 * US, cat="compute", track="compute", args={"step": 1})
    for key, (a, b) in (("('k', 0)", (100, 700)), ("('k', 1)", (1100, 1250))):
        tok = rec.async_begin("fetch", "fetch", "fetch", {"key": key, "steps": "READ",
                                                          "bytes": 64}, ts_ns=a * US)
        rec.async_end(tok, ts_ns=b * US)
    for key, (a, b) in (("('k', 0)", (500, 700)), ("('k', 1)", (1000, 1300))):
        rec.complete("wait:gather", a * US, b * US, cat="wait", track="compute",
                     args={"key": key})
    return write_chrome_trace(tmp_path / "run.trace.json", rec)


def test_prefetch_totals_sum_the_time_waited(tmp_path: Path) -> None:
    model = build_model(load_traces([_trace(tmp_path)]))
    (totals,) = model["prefetch"][0]["totals"]
    assert totals["late"]["count"] == 1 and totals["late"]["waited_us"] == pytest.approx(200)
    assert totals["on demand"]["count"] == 1
    assert totals["on demand"]["waited_us"] == pytest.approx(300)


def test_a_page_of_the_users_own_is_not_replaced(tmp_path: Path) -> None:
    """An HTML file that offload did not write is the user's, even if it is HTML."""
    trace = _trace(tmp_path)
    mine = tmp_path / "notes.html"
    text = "<!DOCTYPE html>\n<html><head><title>my notes</title></head><body>x</body></html>\n"
    mine.write_text(text)
    assert not is_report(mine)
    with pytest.raises(ReportInputError, match="not a report"):
        write_report([trace], mine, replace_only_reports=True)
    assert mine.read_text() == text
    out = write_report([trace], tmp_path / "r.html")  # a report of ours may be replaced
    assert is_report(out) and write_report([trace], out, replace_only_reports=True) == out


def test_the_report_is_readable_by_everyone(tmp_path: Path) -> None:
    out = write_report([_trace(tmp_path)], tmp_path / "r.html")
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_the_host_of_each_rank_is_named(tmp_path: Path) -> None:
    model = build_model(load_traces([_trace(tmp_path)]))
    assert model["groups"][0]["host"] == socket.gethostname()
