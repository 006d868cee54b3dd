"""Hostile and odd input to the report: numbers JSON allows but no trace holds, text
that cannot be written as UTF-8, an output path that is one of the traces.

Each must end in a clear :class:`ReportInputError` naming the file, or in a report
that leaves the odd value out; never in another exception, and never in a lost file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from offload.trace import TraceRecorder, write_chrome_trace
from offload.trace.report import ReportInputError, load_traces, write_report

BIG = "1" + "0" * 400  # an integer JSON allows and no float holds


def _model(html_path: Path) -> dict:
    html = html_path.read_text(encoding="utf-8")
    return json.loads(html.split('id="report-data">', 1)[1].split("</script>", 1)[0])


def _trace(path: Path, rank: int = 0, host: str = "h") -> Path:
    rec = TraceRecorder(enabled=True, rank=rank)
    rec.set_info(host=host, tier_budgets={"HOST": 1 << 20})
    t = rec.now_ns()
    rec.complete("step", t, t + 5_000_000, cat="compute", track="compute", args={"step": 1})
    rec.counter("tier:HOST", {"param": 4096}, track="tier:HOST", ts_ns=t + 1000)
    return write_chrome_trace(path, rec)


def _event(**fields) -> str:
    base = {"ph": "X", "name": "a", "cat": "compute", "pid": 0, "tid": 1, "ts": 1.0, "dur": 2.0}
    base.update(fields)
    return json.dumps(base)


@pytest.mark.parametrize("event, why", [
    (_event(ts=1.5).replace('"ts": 1.5', f'"ts": {BIG}'), "ts="),
    (_event(dur=2.5).replace('"dur": 2.5', f'"dur": {BIG}'), "dur="),
    (_event(ts=1e308, dur=1e308), "ts="),
    (_event(ts=-1e300), "ts="),
])
def test_a_time_no_clock_gives_says_which_file_and_event(tmp_path: Path, event: str,
                                                         why: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [' + event + "]}")
    with pytest.raises(ReportInputError, match=re.escape(why)) as e:
        write_report([bad], tmp_path / "r.html")
    assert str(bad) in str(e.value) and "microseconds" in str(e.value)
    assert not (tmp_path / "r.html").exists()


def test_numbers_too_large_for_a_float_are_left_out(tmp_path: Path) -> None:
    odd = tmp_path / "odd.json"
    odd.write_text('{"traceEvents": ['
                   '{"ph": "C", "name": "tier:HOST", "ts": 1.0, "pid": 0, "tid": 1, '
                   f'"args": {{"param": {BIG}, "grad": 5, "a": 1e308, "b": 1e308}}}},'
                   '{"ph": "b", "name": "read", "cat": "io", "ts": 2.0, "pid": 0, "tid": 2, '
                   f'"id": "0x1", "args": {{"bytes": {BIG}}}}},'
                   '{"ph": "e", "name": "read", "cat": "io", "ts": 3.0, "pid": 0, "tid": 2, '
                   '"id": "0x1"}],'
                   f'"metadata": {{"info": {{"0": {{"tier_budgets": {{"HOST": {BIG}}}, '
                   f'"reference_step_s": {BIG}, "host": NaN, '
                   f'"disk": {{"read_Bps": {BIG}}}}}}}}}}}')
    data = _model(write_report([odd], tmp_path / "odd.html"))
    assert data["occupancy"][0]["series"][0]["v"] == [5.0]
    assert data["occupancy"][0]["series"][0]["budget"] is None
    assert data["summary"][0]["steps"][0]["nvme_read"] == 0
    assert data["summary"][0]["disk"] == {} and data["summary"][0]["reference_step_s"] is None
    assert data["groups"][0]["host"] is None


def test_a_host_that_is_not_text_is_left_out(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    raw = json.loads(trace.read_text())
    raw["metadata"]["info"]["0"]["host"] = {"name": ["a"]}
    trace.write_text(json.dumps(raw))
    assert _model(write_report([trace], tmp_path / "r.html"))["groups"][0]["host"] is None


def test_a_clock_anchor_no_clock_gives_is_ignored(tmp_path: Path) -> None:
    a = _trace(tmp_path / "a.json", 0, host="one")
    b = _trace(tmp_path / "b.json", 1, host="two")
    raw = json.loads(b.read_text())
    raw["metadata"]["clock_anchors"]["1"]["time_ns"] = int(BIG)
    b.write_text(json.dumps(raw))
    ranks = load_traces([a, b])
    assert ranks[1].anchor_ns is None
    write_report([a, b], tmp_path / "r.html")


def test_a_file_name_that_is_not_utf8_is_written_as_a_replacement_character(
        tmp_path: Path) -> None:
    good = _trace(tmp_path / "t.json")
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/run\xff.trace.json"))
    odd.write_bytes(good.read_bytes())
    out = write_report([odd], tmp_path / "r.html", title="title \udcff")
    html = out.read_text(encoding="utf-8")
    assert "<title>title \ufffd</title>" in html
    assert _model(out)["sources"] == ["run\udcff.trace.json"]


def test_the_report_never_replaces_one_of_its_traces(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    before = trace.read_bytes()
    for out in (trace, tmp_path / "." / "t.json"):
        with pytest.raises(ReportInputError, match="is one of the traces") as e:
            write_report([trace], out)
        assert str(trace) in str(e.value) and "-o" in str(e.value)
    link = tmp_path / "link.html"
    link.symlink_to(trace)
    with pytest.raises(ReportInputError, match="is one of the traces"):
        write_report([trace], link)
    assert trace.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "t.json"]


def test_the_page_runs_its_own_script_and_no_other(tmp_path: Path) -> None:
    """The Content-Security-Policy allows the report's script by its hash: no inline
    event handler (a name smuggled into the DOM) and no other script can run."""
    import base64
    import hashlib

    html = write_report([_trace(tmp_path / "t.json")], tmp_path / "r.html").read_text(
        encoding="utf-8")
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', html).group(1)
    script = html.rsplit("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in policy
    assert "unsafe" not in policy.split("script-src", 1)[1].split(";", 1)[0]


@pytest.mark.parametrize("content, why", [
    (b"", "the file is empty"),
    (b"<!DOCTYPE html>\n<html>", "is HTML or XML (such as a report), not a trace"),
    (b'{"x": 1' + b"0" * 5000 + b"}", "not a trace file (Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, "not a trace file (maximum recursion depth"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1, "pid": "Spans"}]}', "is not an integer rank; "),
])
def test_files_that_are_not_traces_say_so(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with pytest.raises(ReportInputError, match=re.escape(why)) as e:
        write_report([bad], tmp_path / "r.html")
    assert str(e.value).startswith(f"{bad}: ") and "\n" not in str(e.value)
    assert not (tmp_path / "r.html").exists()
