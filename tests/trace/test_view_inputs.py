"""Trace files whose events name a process, thread or async pair with a list or an
object, and paths that are not regular files: each reader of trace files refuses them
with a TraceFormatError naming the file, never a TypeError (unhashable type) or a read
that blocks or never ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.trace import (TraceFormatError, TraceRecorder, load_chrome_trace,
                           merge_chrome_traces, summarize, write_chrome_trace)
from offload.trace.analysis import parse_trace


def _trace(path: Path) -> Path:
    rec = TraceRecorder(enabled=True, rank=0)
    t = rec.now_ns()
    rec.complete("step", t, t + 5_000_000, cat="compute", track="compute", args={"step": 1})
    tok = rec.async_begin("read", "io", "io:aio", {"bytes": 4096}, ts_ns=t)
    rec.async_end(tok, ts_ns=t + 100_000)
    return write_chrome_trace(path, rec)


@pytest.mark.parametrize("field, value", [("pid", [0]), ("tid", {"a": 1}), ("id", [7]),
                                          ("cat", ["io"]), ("name", {"n": 1})])
def test_an_event_naming_its_owner_with_a_list_or_object_is_refused(tmp_path: Path,
                                                                   field: str,
                                                                   value: object) -> None:
    good = _trace(tmp_path / "good.json")
    trace = json.loads(good.read_text())
    event = next(e for e in trace["traceEvents"] if e.get("ph") == "b")
    event[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(trace))
    want = rf"bad\.json: event .* has {field}=.*, expected a number or a string"
    for read in (load_chrome_trace, summarize, lambda p: merge_chrome_traces([good, p])):
        with pytest.raises(TraceFormatError, match=want):
            read(bad)
    with pytest.raises(TraceFormatError, match=r"<dict>: event .* expected a number"):
        parse_trace(trace, "<dict>")
    with pytest.raises(TraceFormatError, match=r"<trace>: event .* expected a number"):
        summarize(trace)
    assert summarize(good)["async"]["read"]["count"] == 1  # a good one still reads


def test_a_device_is_not_read(tmp_path: Path) -> None:
    """/dev/null here; a FIFO (whose read would block) and /dev/zero (whose read never
    ends) are run in a process of their own, with a timeout and a memory cap, in
    tests/cli/test_view.py."""
    with pytest.raises(TraceFormatError, match=r"^/dev/null: is not a regular file"):
        load_chrome_trace("/dev/null")
    with pytest.raises(IsADirectoryError):
        load_chrome_trace(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_chrome_trace(tmp_path / "none.json")
