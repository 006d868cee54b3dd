"""The report's figures and files: time waited in the prefetch totals, a page of the
user's own not replaced, the report readable by everyone, each rank's host named,
steps that touch, a rate no float holds."""

from __future__ import annotations

import json
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


def _raw(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _x(name: str, ts: float, dur: float, cat: str = "compute", **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 1,
            "args": args}


def _async(name: str, cat: str, ts: float, end: float, i: int, **args) -> list[dict]:
    return [{"ph": "b", "name": name, "cat": cat, "ts": ts, "id": i, "pid": 0, "tid": 2,
             "args": args},
            {"ph": "e", "name": name, "cat": cat, "ts": end, "id": i, "pid": 0, "tid": 2}]


def test_steps_that_touch_count_what_begins_between_them_once(tmp_path: Path) -> None:
    """Step 1 is [0, 100) and step 2 [100, 200): step 2's phases, read, move and use of
    a record, all begun at 100, are step 2's alone (step 1's card counted them too)."""
    path = _raw(tmp_path / "t.json", [
        _x("step", 0, 100, step=1), _x("step", 100, 100, step=2),
        _x("forward", 0, 40), _x("backward", 40, 60), _x("forward", 100, 40),
        _x("backward", 140, 60), _x("wait:gather", 100, 5, cat="wait", key="k"),
        *_async("read", "io", 100, 120, 1, bytes=1 << 20),
        *_async("HOST->DEVICE", "store", 100, 110, 2, bytes=4096, key="k"),
        *_async("fetch", "fetch", 90, 98, 3, key="k", steps="H2D", bytes=4096)])
    model = build_model(load_traces([path]))
    one, two = model["summary"][0]["steps"]
    for st in (one, two):
        assert st["phases_us"] == {"forward": 40.0, "backward": 60.0, "optimizer step": 0.0}
    assert (one["nvme_read"], two["nvme_read"]) == (0, 1 << 20)
    assert (one["moves"], two["moves"]) == ({}, {"HOST->DEVICE": 4096})
    totals = model["prefetch"][0]["totals"]
    assert [t["in time"]["count"] for t in totals] == [0, 1]


def test_a_rate_over_a_time_too_short_for_a_float_is_not_known(tmp_path: Path) -> None:
    """1 MiB read in 5e-324 us: bytes over that time is no finite float; the rate is
    reported as not known (None) and the page is written (before: a ValueError from the
    JSON encoder, raised out of write_report)."""
    path = _raw(tmp_path / "t.json", [_x("step", 0, 5e-324, step=1),
                                      *_async("read", "io", 0, 5e-324, 1, bytes=1 << 20)])
    model = build_model(load_traces([path]))
    (st,) = model["summary"][0]["steps"]
    assert st["nvme_read"] == 1 << 20 and st["read_busy_us"] > 0
    assert st["read_GBps_busy"] is None and st["read_GBps_step"] is None
    out = write_report([path], tmp_path / "r.html")
    assert is_report(out)
