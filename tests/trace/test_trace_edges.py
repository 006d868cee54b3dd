"""Tests of the trace readers outside the report: `load_chrome_trace` and
`merge_chrome_traces` on files that are truncated, corrupted, not traces or from a
newer format say which file and what is wrong, as a ValueError, not a traceback from
deep inside json, gzip or the merge."""

import gzip
import json
from pathlib import Path

import pytest

from offload.trace import (TraceRecorder, load_chrome_trace, merge_chrome_traces,
                           write_chrome_trace)
from offload.trace.analysis import TraceFormatError


def _trace(tmp_path: Path) -> bytes:
    rec = TraceRecorder(enabled=True)
    with rec.span("forward", cat="compute", track="compute"):
        pass
    tok = rec.async_begin("read", cat="io", track="io:aio", args={"bytes": 4096})
    rec.async_end(tok)
    return write_chrome_trace(tmp_path / "good.trace.json", rec).read_bytes()


def _bad_files(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    raw = _trace(tmp_path)
    return {
        "truncated.trace.json": (raw[: len(raw) // 2], "not valid JSON"),
        "truncated.trace.json.gz": (gzip.compress(raw)[:40], "gzip"),
        "latin1.trace.json": (b"\xff\xfe{}", "UTF-8"),
        "empty.trace.json": (b"", "empty"),
        "events.trace.json": (json.dumps({"traceEvents": [1, 2]}).encode(), "not an object"),
        "counts.trace.json": (json.dumps({"traceEvents": [], "metadata": {
            "dropped_events": "many"}}).encode(), "dropped_events"),
        "ranks.trace.json": (json.dumps({"traceEvents": [], "metadata": {
            "ranks": 3}}).encode(), "ranks"),
        "newer.trace.json": (json.dumps({"traceEvents": [], "metadata": {
            "generator": "offload.trace", "format_version": 99}}).encode(), "format 99"),
    }


@pytest.mark.parametrize("name", ["truncated.trace.json", "truncated.trace.json.gz",
                                  "latin1.trace.json", "empty.trace.json",
                                  "newer.trace.json"])
def test_loading_a_broken_file_names_it(tmp_path: Path, name: str) -> None:
    content, why = _bad_files(tmp_path)[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=why) as e:
        load_chrome_trace(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name", sorted(["truncated.trace.json", "truncated.trace.json.gz",
                                         "latin1.trace.json", "events.trace.json",
                                         "counts.trace.json", "ranks.trace.json",
                                         "newer.trace.json"]))
def test_merging_a_broken_file_names_it(tmp_path: Path, name: str) -> None:
    """The good file first, then the broken one: the error names the broken one."""
    content, why = _bad_files(tmp_path)[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=why) as e:
        merge_chrome_traces([tmp_path / "good.trace.json", path])
    assert str(path) in str(e.value)


def test_good_files_and_predictions_still_load_and_merge(tmp_path: Path) -> None:
    """A file of this format, one without a format version (the simulator's
    prediction, `Prediction.to_trace`) and a gzipped one load and merge."""
    from offload.planner import Rates, RecordSpec, Use, make_plan, simulate
    from offload.trace import write_trace_dict

    _trace(tmp_path)
    uses = [Use(("a",), compute_s=1.0)]
    pred = simulate(make_plan(uses, {"a": RecordSpec(8)}, 8), uses, Rates(8.0, 8.0))
    predicted = write_trace_dict(tmp_path / "p.trace.json.gz", pred.to_trace(budget=8))
    assert "format_version" not in load_chrome_trace(predicted)["metadata"]
    merged = merge_chrome_traces([tmp_path / "good.trace.json", predicted])
    assert merged["metadata"]["format_version"] == 1
    assert any(e.get("name") == "read" for e in merged["traceEvents"])
