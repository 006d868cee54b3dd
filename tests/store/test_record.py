"""PartitionRecord transitions and move planning: pure, no I/O."""

from __future__ import annotations

import pytest
import torch

from offload.store import PartitionRecord, Residency, Step, Tier, plan_evict, plan_fetch
from offload.store.moves import needs_of

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def _rec(tier=Tier.NVME) -> PartitionRecord:
    r = PartitionRecord("k", "param", torch.float32, 1000, home=tier)
    r.place(tier, object())
    return r


def test_fields_and_footprint():
    r = _rec()
    assert (r.nbytes, r.footprint, r.state, r.valid, r.dirty) == (4000, 4096, Residency.NVME,
                                                                  {N}, False)
    with pytest.raises(ValueError, match="numel must be positive"):
        PartitionRecord("z", "param", torch.float32, 0, home=H)


def test_read_then_copy_then_drops():
    r = _rec()
    r.begin_read("hostbuf")
    assert r.state is Residency.READING and r.valid == {N} and set(r.copies) == {N, H}
    r.finish_read()
    assert r.state is Residency.HOST and r.valid == {H, N} and not r.dirty
    r.begin_copy(D, "devbuf")
    assert r.state is Residency.COPYING_H2D
    r.finish_copy()
    assert r.state is Residency.DEVICE and r.valid == {D, H, N}
    assert r.drop(H) == "hostbuf" and r.state is Residency.DEVICE
    assert r.drop(D) == "devbuf" and r.state is Residency.NVME
    with pytest.raises(RuntimeError, match=r"cannot drop NVME: valid copies are \['NVME'\]"):
        r.drop(N)


def test_a_read_into_device_memory():
    """On a CPU device a read lands in DEVICE memory ([Note: CPU device tier])."""
    r = _rec()
    r.begin_read("devbuf", D)
    assert r.state is Residency.READING and r.reading_into is D and set(r.copies) == {N, D}
    assert r.abort_read() == "devbuf" and r.state is Residency.NVME and r.copies.keys() == {N}
    r.begin_read("devbuf", D)
    r.finish_read()
    assert r.state is Residency.DEVICE and r.valid == {D, N} and not r.dirty
    with pytest.raises(ValueError, match="HOST or DEVICE"):
        _rec().begin_read("buf", N)


def test_wrong_start_state_raises_with_values():
    r = _rec(Tier.HOST)
    with pytest.raises(RuntimeError, match="partition 'k' is HOST, expected NVME"):
        r.begin_read("buf")
    with pytest.raises(RuntimeError, match="partition 'k' is HOST, expected READING"):
        r.finish_read()
    r.begin_write("ext")
    with pytest.raises(RuntimeError, match="is WRITING, expected DEVICE, HOST or NVME"):
        r.modify(H)
    with pytest.raises(RuntimeError, match="is WRITING, expected DEVICE, HOST or NVME"):
        r.drop(H)
    assert r.abort_write() == "ext" and r.state is Residency.HOST and r.valid == {H}


def test_write_keeps_host_until_durable_and_modify_releases_stale():
    r = _rec(Tier.HOST)
    assert r.dirty
    r.begin_write("ext")
    assert r.valid == {H} and r.state is Residency.WRITING
    r.finish_write()
    assert r.valid == {H, N} and not r.dirty
    stale = r.modify(H)
    assert stale == {N: "ext"} and r.valid == {H} and r.dirty and set(r.copies) == {H}


def test_hand_over_moves_memory_between_tiers():
    r = _rec(Tier.HOST)
    buf = r.copies[H]
    r.hand_over(D)
    assert r.state is Residency.DEVICE and r.valid == {D} and r.copies == {D: buf}
    with pytest.raises(RuntimeError, match="cannot hand over to NVME"):
        r.hand_over(N)
    r.hand_over(H)
    assert r.copies == {H: buf} and r.state is Residency.HOST


def test_release_all_and_freed():
    r = _rec(Tier.HOST)
    r.release_all()
    assert r.state is Residency.FREED and not r.copies
    with pytest.raises(RuntimeError, match="is FREED"):
        r.drop(H)


@pytest.mark.parametrize("valid,to,hand_over,steps", [
    ({N}, D, False, [Step.READ, Step.H2D]),
    ({N}, D, True, [Step.READ_DEVICE]),  # into DEVICE memory: [Note: CPU device tier]
    ({H, N}, D, False, [Step.H2D]),
    ({D}, H, False, [Step.D2H]),
    ({D}, H, True, [Step.HAND_D2H]),
    ({H}, H, False, []),
])
def test_plan_fetch(valid, to, hand_over, steps):
    assert plan_fetch(valid, to, hand_over) == steps


@pytest.mark.parametrize("valid,to,hand_over,steps", [
    ({D}, N, False, [Step.D2H, Step.DROP_DEVICE, Step.WRITE, Step.DROP_HOST]),
    ({D}, N, True, [Step.HAND_D2H, Step.WRITE, Step.DROP_HOST]),
    ({D, N}, N, False, [Step.DROP_DEVICE]),          # clean: dropped, not written
    ({D, H, N}, N, False, [Step.DROP_DEVICE, Step.DROP_HOST]),
    ({D, H}, H, False, [Step.DROP_DEVICE]),
    ({H}, N, False, [Step.WRITE, Step.DROP_HOST]),
    ({N}, H, False, []),                            # already below: eviction never reads up
    ({D}, D, False, []),
])
def test_plan_evict(valid, to, hand_over, steps):
    assert plan_evict(valid, to, hand_over) == steps


def test_needs_count_each_destination():
    assert needs_of([Step.READ, Step.H2D], 4096) == {H: 4096, D: 4096}
    assert needs_of([Step.DROP_DEVICE, Step.DROP_HOST], 4096) == {}
    with pytest.raises(ValueError, match="use evict"):
        plan_fetch({H}, N, False)
