"""What the store reports and where it waits: moved bytes and failures in its
statistics (what the benchmarks divide by time), evictions, peaks and waits counted,
a failed fetch's error naming the partition and tiers, pins held per thread, a put
waiting for room below, a budget never exceeded by a byte, kinds kept apart by
replace, wait_all waiting for every move, the NVMe budget of optimizer extents."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from offload.io import CorruptionError
from offload.store import BudgetExceededError, Tier
from offload.store.budget import Accounting
from offload.store.copy import rank_gpu

from ..conftest import flip_byte
from .conftest import PAGE, page_tensor

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


@contextlib.contextmanager
def _pinned_by_another_thread(s, key: str, seconds: float):
    """`key` pinned by a thread of its own for `seconds` from entry; joined at exit."""
    pinned = threading.Event()

    def hold():
        s.pin(key)
        pinned.set()
        time.sleep(seconds)
        s.unpin(key)
    t = threading.Thread(target=hold)
    t.start()
    pinned.wait()
    try:
        yield
    finally:
        t.join()


def test_moved_bytes_are_the_partitions_bytes_not_its_footprint(make_store):
    """StoreStats.moves counts a partition's own bytes (what the benchmarks divide by
    time), not the 4 KiB-rounded footprint its copies take."""
    s = make_store()
    ref = torch.arange(1000, dtype=torch.float32)  # 4000 B: a footprint of 4096
    s.put("a", ref, tier="NVME").wait()
    assert torch.equal(s.fetch("a", H).wait(), ref)
    st = s.stats()
    for d in ("HOST->NVME", "NVME->HOST"):
        m = st.moves[d]
        assert (m.moves, m.bytes, m.copied_bytes) == (1, 4000, 4000), (d, m)
    assert st.tiers["HOST"].used == PAGE  # the budget counts footprints


def test_a_failed_read_counts_as_a_failure_only_and_its_error_names_record_and_tier(
        make_store):
    """A read that fails counts in `failures`, not in `moves`/`bytes`; its error carries
    a note naming the partition, the op and the tiers; settle() says it failed."""
    s = make_store()
    s.put("a", page_tensor(5, 2), tier="NVME").wait()
    offset, _ = s.info("a").extent
    flip_byte(s.swap_paths("param")[0], offset + 100)
    h = s.fetch("a", H)
    assert h.settle() is False
    with pytest.raises(CorruptionError) as e:
        h.wait()
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "fetch of partition 'a' failed at NVME->HOST" in notes, notes
    m = s.stats().moves["NVME->HOST"]
    assert (m.moves, m.bytes, m.copied_bytes, m.failures) == (0, 0, 0, 1), m
    s.audit()


def test_settle_is_true_for_a_fetch_that_succeeded(make_store):
    s = make_store()
    s.put("a", page_tensor(1), tier="NVME").wait()
    h = s.fetch("a", H, pin=True)
    assert h.settle() is True
    s.unpin("a")


def test_clean_copies_dropped_to_make_room_count_as_evictions(make_store):
    """A clean copy the policy gives up counts as an eviction (and a drop), not only a
    dirty one written down."""
    s = make_store(host_pages=1)
    s.put("a", page_tensor(1), tier="NVME", cache=True).wait()  # clean HOST copy
    before = s.stats()
    s.put("b", page_tensor(2), tier="HOST")  # HOST full: a's copy leaves
    st = s.stats()
    assert s.info("a").valid == {N}
    assert st.evictions == before.evictions + 1 and st.drops == before.drops + 1
    assert st.writes == before.writes
    s.audit()


def test_peak_is_the_most_bytes_held_at_once(make_store):
    s = make_store(host_pages=4)
    s.put("a", page_tensor(1, 2), tier="HOST")
    s.put("b", page_tensor(2, 1), tier="HOST")
    s.free("a")
    s.free("b")
    s.put("c", page_tensor(3, 1), tier="HOST")  # a charge after the peak keeps it
    t = s.stats().tiers["HOST"]
    assert (t.used, t.peak) == (PAGE, 3 * PAGE), t


def test_waits_for_room_are_counted(make_store):
    """A fetch that waits for another thread's pin to come back counts the wait in
    stats().waits and wait_seconds."""
    s = make_store(host_pages=1)
    s.put("b", page_tensor(2), tier="NVME").wait()
    s.put("a", page_tensor(1), tier="HOST")
    with _pinned_by_another_thread(s, "a", 0.5):
        before = s.stats()
        assert torch.equal(s.fetch("b", H).wait(), page_tensor(2))
    st = s.stats()
    assert st.waits > before.waits and st.wait_seconds - before.wait_seconds >= 0.1, st


def test_unpin_gives_back_the_callers_own_pin_not_another_threads(make_store):
    """After thread T and the caller pin a key and the caller unpins, T's pin still
    holds: split (which refuses a key another thread pins) refuses it."""
    s = make_store()
    s.put("c", page_tensor(6), tier="NVME").wait()
    s.fetch("c", H).wait()
    t = threading.Thread(target=s.pin, args=("c",))
    t.start()
    t.join()
    s.pin("c")
    s.unpin("c")
    assert not s.split("c", "d", H) and s.info("c").valid == {H, N}
    s.unpin("c")
    assert s.split("c", "d", H)
    s.audit()


def test_a_dirty_device_victim_waits_for_a_pin_on_the_host_room_below(make_store):
    """[Note: room below]: DEVICE's only victim is dirty and must go down to HOST, where
    another thread pins the room: the put waits for that pin and succeeds, it does
    not raise BudgetExceededError."""
    s = make_store(device_pages=1, host_pages=1)
    s.put("h", page_tensor(1), tier="HOST")
    s.put("d", page_tensor(2), tier="DEVICE")  # dirty, its only copy
    with _pinned_by_another_thread(s, "h", 0.3):
        s.put("x", page_tensor(3), tier="DEVICE")
    s.wait_all()
    assert torch.equal(s.get("x", D), page_tensor(3))
    for key, seed in (("d", 2), ("h", 1)):
        assert torch.equal(s.fetch(key, H).wait(), page_tensor(seed)), key
    s.audit()


def test_charge_refuses_to_exceed_a_budget_by_any_amount():
    acct = Accounting({D: 2 * PAGE, H: 2 * PAGE})
    acct.charge(H, "param", 2 * PAGE)  # exactly the budget fits
    with pytest.raises(RuntimeError, match="over its budget"):
        acct.charge(H, "param", 1)
    assert acct.used(H) == 2 * PAGE


def test_local_rank_past_the_visible_gpus_keeps_the_current_device():
    assert rank_gpu("1", 0, 2) == 1
    assert rank_gpu("2", 0, 2) == 0  # only GPUs 0 and 1 are visible


def test_replace_refuses_a_partition_of_another_kind_and_changes_nothing(make_store):
    """Kinds live in different swap files: replace across kinds raises and leaves both."""
    s = make_store()
    s.put("a", page_tensor(1), tier="HOST", kind="param")
    s.put("b", page_tensor(2), tier="HOST", kind="grad")
    with pytest.raises(ValueError, match="different kinds"):
        s.replace("a", by="b")
    assert s.info("a").kind == "param" and s.info("b").kind == "grad"
    assert torch.equal(s.get("a", H), page_tensor(1))
    assert torch.equal(s.get("b", H), page_tensor(2))
    s.free("b")  # usable again: nothing is left claimed
    s.audit()


def test_wait_all_returns_only_once_every_move_is_done(make_store):
    pages = 1024  # 4 MiB each: the writes are still in flight when wait_all starts
    s = make_store(host_pages=8 * pages)
    refs = {k: page_tensor(i, pages) for i, k in enumerate("abcdefgh")}
    handles = [s.put(k, v, tier="NVME") for k, v in refs.items()]
    s.wait_all()
    assert all(h.done() for h in handles)
    assert all(s.info(k).valid == {N} and not s.info(k).busy for k in refs)
    assert s.stats().writes == len(refs) and s.stats().tiers["HOST"].used == 0
    s.audit()


def test_an_optimizer_extent_over_the_nvme_budget_raises_budget_exceeded_naming_the_key(
        make_store):
    s = make_store(nvme_pages=2)
    swap = s.swap_space("optim")
    e = swap.alloc(PAGE)
    with pytest.raises(BudgetExceededError, match=r"store\.nvme_budget: the optim state"):
        swap.alloc(2 * PAGE)
    assert s.stats().tiers["NVME"].by_kind == {"optim": PAGE}
    swap.free(e)
    assert s.stats().tiers["NVME"].used == 0
    s.audit()
