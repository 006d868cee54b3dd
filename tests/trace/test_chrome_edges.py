"""What the Chrome export, loading, merging and summarize keep: no budget line where a
tier has none, the next format refused before anything is written, merged counts summed,
bytes taken from a span's end before its begin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.trace import (TraceFormatError, TraceRecorder, load_chrome_trace, merge_chrome_traces,
                           summarize, to_chrome_trace, write_chrome_trace)
from offload.trace.chrome import FORMAT_VERSION
from offload.trace.report import ReportInputError, write_report

US = 1000


def test_a_tier_without_budget_gets_no_budget_line() -> None:
    """tier_budgets 0 means no budget (docs/trace.md): occupancy:<TIER> has no budget then."""
    rec = TraceRecorder(enabled=True)
    rec.set_info(tier_budgets={"HOST": 100, "NVME": 0})
    rec.counter("tier:NVME", {"param": 5}, track="tier:NVME", ts_ns=1 * US)
    rec.counter("tier:HOST", {"param": 7}, track="tier:HOST", ts_ns=2 * US)
    occ = {e["name"]: e["args"] for e in to_chrome_trace(rec)["traceEvents"]
           if e.get("name", "").startswith("occupancy:")}
    assert occ == {"occupancy:NVME": {"used": 5.0},
                   "occupancy:HOST": {"used": 7.0, "budget": 100.0}}


def test_the_next_format_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    trace = tmp_path / "new.trace.json"
    trace.write_text(json.dumps({"traceEvents": [], "metadata": {
        "format_version": FORMAT_VERSION + 1}}))
    with pytest.raises(TraceFormatError, match=f"format {FORMAT_VERSION + 1}"):
        load_chrome_trace(trace)
    out = tmp_path / "new.report.html"
    with pytest.raises(ReportInputError, match=f"format {FORMAT_VERSION + 1}"):
        write_report([trace], out)
    assert not out.exists()


def test_merging_sums_the_counts_of_every_file(tmp_path: Path) -> None:
    paths = []
    for rank, drops in ((0, 2), (1, 3)):
        rec = TraceRecorder(enabled=True, rank=rank, max_events=1)
        rec.async_begin("read", "io", "io:aio", {"bytes": 1})  # kept, never ended
        for _ in range(drops):
            rec.instant("x", track="t")  # over the cap: dropped
        paths.append(write_chrome_trace(tmp_path / f"r{rank}.trace.json", rec))
    meta = merge_chrome_traces(paths)["metadata"]
    assert meta["dropped_events"] == 5
    assert meta["dropped_events_by_rank"] == {"0": 2, "1": 3}
    assert meta["unmatched_async_begins"] == 2


def test_summarize_takes_bytes_from_the_end_before_the_begin(tmp_path: Path) -> None:
    rec = TraceRecorder(enabled=True)
    tok = rec.async_begin("write", "io", "io:aio", {"bytes": 10}, ts_ns=1 * US)
    rec.async_end(tok, {"bytes": 30}, ts_ns=2 * US)  # e.g. a short write: the end says
    tok = rec.async_begin("write", "io", "io:aio", {"bytes": 5}, ts_ns=3 * US)
    rec.async_end(tok, ts_ns=4 * US)
    assert summarize(rec)["async"]["write"]["total_bytes"] == 35
    path = write_chrome_trace(tmp_path / "w.trace.json", rec)
    assert summarize(path)["async"]["write"]["total_bytes"] == 35


def test_summarize_counts_bytes_that_are_no_count_as_none(tmp_path: Path) -> None:
    """A `bytes` arg that is no count (null, "4KiB", negative, beyond int64) counts 0 in
    summarize, as in the report: before, summarize raised a bare TypeError or
    ValueError where `offload view` drew the file."""
    events = []
    for i, value in enumerate([None, "4KiB", -1, 2 ** 70, 7]):
        events += [{"ph": "b", "cat": "io", "name": "read", "id": hex(i), "ts": 2 * i,
                    "pid": 0, "tid": 1, "args": {"bytes": value}},
                   {"ph": "e", "cat": "io", "name": "read", "id": hex(i), "ts": 2 * i + 1,
                    "pid": 0, "tid": 1}]
    path = tmp_path / "b.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    read = summarize(path)["async"]["read"]
    assert (read["count"], read["total_bytes"]) == (5, 7)
