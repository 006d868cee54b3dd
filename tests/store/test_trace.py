"""The store's events in a Chrome trace: moves as async events with bytes, waits as spans,
per-tier occupancy counters."""

from __future__ import annotations

import torch

from offload.store import Tier
from offload.trace import NULL_RECORDER, TraceRecorder, load_chrome_trace, summarize, \
    write_chrome_trace

from .conftest import page_tensor


def test_moves_waits_and_tier_counters_in_chrome_trace(make_store, tmp_path):
    rec = TraceRecorder(enabled=True, rank=0)
    s = make_store(recorder=rec, device_pages=2, host_pages=2)
    nbytes = page_tensor(0).numel() * 4
    for k in range(3):
        s.put(k, page_tensor(k), tier="NVME").wait()  # blocks on the write: a wait span
    assert torch.equal(s.fetch(0, Tier.DEVICE).wait(), page_tensor(0))
    s.fetch(1, Tier.HOST).wait()
    s.evict(0, Tier.NVME).wait()
    path = write_chrome_trace(tmp_path / "store.trace.json", rec)

    events = load_chrome_trace(path)["traceEvents"]
    begins = {e["id"]: e for e in events if e["ph"] == "b" and e["cat"] == "store"}
    ends = {e["id"]: e for e in events if e["ph"] == "e" and e["cat"] == "store"}
    assert set(begins) == set(ends)  # every move ended
    names = {e["name"] for e in begins.values()}
    to_device = "HOST->DEVICE" if s.device.type == "cuda" else "NVME->DEVICE"  # a read into it
    assert {"HOST->NVME", "NVME->HOST", to_device} <= names
    assert all(e["args"]["bytes"] == nbytes for e in begins.values())
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"tier:DEVICE", "tier:HOST", "tier:NVME"} <= counters
    last_nvme = [e for e in events if e["ph"] == "C" and e["name"] == "tier:NVME"][-1]
    assert last_nvme["args"] == {"param": 3 * 4096}
    waits = [e for e in events if e["ph"] == "X" and e["cat"] == "wait"]
    assert waits and all(e["dur"] >= 0 for e in waits)

    summary = summarize(rec)
    assert summary["async"]["HOST->NVME"]["total_bytes"] == 3 * nbytes
    assert summary["async"]["HOST->NVME"]["count"] == 3


def test_recorder_off_by_default(make_store):
    s = make_store()
    s.put("a", page_tensor(1), tier="NVME").wait()
    s.fetch("a", Tier.HOST).wait()
    assert s._rec is NULL_RECORDER and len(NULL_RECORDER) == 0
