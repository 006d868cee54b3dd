"""TieredStore on real swap files: moves, budgets, policy, pins, accounting, lifecycle."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from offload.io import IoHandle, SwapLockedError
from offload.store import (BudgetExceededError, LruPolicy, Residency, Tier, TieredStore,
                           footprint)

from .conftest import ENGINES, PAGE, page_tensor, store_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype,pages", [(torch.float32, 1), (torch.bfloat16, 2.5),
                                         (torch.int64, 0.3)])
def test_roundtrip_through_every_tier(make_store, engine, dtype, pages):
    s = make_store(engine=engine, device_pages=8, host_pages=8)
    ref = page_tensor(7, pages, dtype)
    s.put("a", ref.view(2, -1) if ref.numel() % 2 == 0 else ref, tier="NVME").wait()
    assert s.info("a").state is Residency.NVME and s.info("a").valid == {N}
    out = s.fetch("a", D).wait()
    assert out.dtype == dtype and out.shape == (ref.numel(),) and torch.equal(out, ref)
    assert torch.equal(s.get("a", D), ref)
    s.evict("a", H).wait()
    assert torch.equal(s.get("a", H), ref) and D not in s.info("a").valid
    s.evict("a").wait()  # home: NVME
    assert s.info("a").valid == {N}
    assert torch.equal(s.fetch("a", H).wait(), ref)
    s.audit()


def test_dirty_copy_is_written_back_clean_copy_dropped(make_store):
    s = make_store()
    ref = page_tensor(1)
    s.put("a", ref, tier="HOST")
    assert s.info("a").dirty
    s.evict("a", N).wait()
    st = s.stats()
    assert st.writes == 1 and st.moves["HOST->NVME"].moves == 1
    s.fetch("a", H).wait()
    assert not s.info("a").dirty
    s.evict("a", N).wait()  # clean: the NVMe copy is still the value
    st = s.stats()
    assert st.writes == 1 and st.moves["HOST->NVME"].moves == 1 and st.drops >= 1
    assert torch.equal(s.fetch("a", H).wait(), ref)


def test_nvme_put_with_cache_keeps_a_clean_host_copy(make_store):
    s = make_store(host_pages=2)
    a, b, c = page_tensor(1), page_tensor(2), page_tensor(3)
    s.put("a", a, tier="NVME", cache=True).wait()
    assert s.info("a").valid == {H, N} and not s.info("a").dirty
    s.put("b", b, tier="NVME").wait()  # without cache: written, then released from HOST
    assert s.info("b").valid == {N}
    reads = s.stats().moves["NVME->HOST"].moves
    assert torch.equal(s.fetch("a", H).wait(), a)
    assert s.stats().moves["NVME->HOST"].moves == reads  # served from memory
    s.put("c", c, tier="NVME", cache=True).wait()
    s.fetch("b", H).wait()  # HOST (2 pages) is full: a clean cached copy is dropped
    assert s.stats().tiers["HOST"].used <= 2 * PAGE
    for k, ref in (("a", a), ("b", b), ("c", c)):
        assert torch.equal(s.fetch(k, H).wait(), ref), k
    s.audit()


def test_budget_is_hard_and_error_lists_residents(make_store):
    s = make_store(device_pages=2, host_pages=4)
    for k in ("a", "b"):
        s.put(k, page_tensor(ord(k)), tier="DEVICE")
        s.pin(k)
    s.put("c", page_tensor(3), tier="HOST")
    with pytest.raises(BudgetExceededError) as e:
        s.fetch("c", D)
    msg = str(e.value)
    assert "DEVICE holds 8192 of 8192 bytes" in msg and "'a'" in msg and "pinned x1" in msg
    assert s.info("c").state is Residency.HOST and s.info("c").valid == {H}
    assert s.stats().tiers["DEVICE"].used == 2 * PAGE
    with pytest.raises(BudgetExceededError, match="more than its whole budget"):
        s.put("huge", page_tensor(0, 3), tier="DEVICE")
    assert "huge" not in s
    s.unpin("a")
    assert torch.equal(s.fetch("c", D).wait(), page_tensor(3))  # evicts a
    assert s.info("a").state is Residency.HOST
    s.audit()


def test_lru_evicts_least_recently_used_and_writes_it_down(make_store):
    s = make_store(host_pages=2)
    s.put("a", page_tensor(1), tier="HOST")
    s.put("b", page_tensor(2), tier="HOST")
    s.get("a", H)  # a is now more recent than b
    s.put("c", page_tensor(3), tier="HOST")
    s.wait_all()
    assert s.info("b").state is Residency.NVME and s.info("a").state is Residency.HOST
    assert s.stats().evictions == 1 and s.stats().writes == 1
    for k, seed in (("a", 1), ("b", 2), ("c", 3)):
        assert torch.equal(s.fetch(k, H).wait(), page_tensor(seed))
    s.audit()


def test_lru_drops_a_clean_copy_before_writing_a_dirty_one_never_used():
    """Copies never used (the clock's -1 for both, e.g. put by initialize) tie on
    recency: the clean one goes first, free, where the dirty one costs a write."""
    from offload.store.policy import Candidate
    cands = [Candidate("dirty", "param", 4096, clean=False),
             Candidate("clean", "param", 4096, clean=True)]
    assert LruPolicy().choose(Tier.HOST, 4096, cands) == ["clean"]
    assert LruPolicy().choose(Tier.HOST, 4096, cands[::-1]) == ["clean"]


class _BiggestKeyFirst(LruPolicy):
    def choose(self, tier, need_bytes, candidates):
        return sorted((c.key for c in candidates), reverse=True)[:1]


def test_policy_is_pluggable(make_store):
    s = make_store(host_pages=2, policy=_BiggestKeyFirst())
    s.put("a", page_tensor(1), tier="HOST")
    s.put("b", page_tensor(2), tier="HOST")
    s.get("b", H)
    s.put("c", page_tensor(3), tier="HOST")
    s.wait_all()
    assert s.info("b").state is Residency.NVME and s.info("a").state is Residency.HOST


class _Liar(LruPolicy):
    def choose(self, tier, need_bytes, candidates):
        return ["nope"]


def test_policy_choosing_a_non_candidate_is_an_error(make_store):
    s = make_store(host_pages=1, policy=_Liar())
    s.put("a", page_tensor(1), tier="HOST")
    with pytest.raises(RuntimeError, match="chose 'nope', not a candidate in HOST"):
        s.put("b", page_tensor(2), tier="HOST")
    assert "b" not in s and s.stats().tiers["HOST"].used == PAGE


def test_cpu_device_hand_over_moves_accounting_not_bytes(make_store):
    s = make_store(device_pages=2, host_pages=2)
    s.put("a", page_tensor(1), tier="HOST")
    addr = s.get("a", H).data_ptr()
    view = s.fetch("a", D).wait()
    assert view.data_ptr() == addr  # the same buffer, handed over
    st = s.stats()
    assert st.tiers["HOST"].used == 0 and st.tiers["DEVICE"].used == PAGE
    assert st.tiers["DEVICE"].by_kind == {"param": PAGE}
    m = st.moves["HOST->DEVICE"]
    assert (m.moves, m.bytes, m.copied_bytes) == (1, page_tensor(1).numel() * 4, 0)
    assert s.info("a").valid == {D}
    s.evict("a", H).wait()
    assert s.get("a", H).data_ptr() == addr and s.stats().moves["DEVICE->HOST"].copied_bytes == 0


def test_pin_blocks_eviction_evict_and_free(make_store):
    s = make_store(host_pages=1)
    s.put("a", page_tensor(1), tier="HOST")
    s.pin("a")
    with pytest.raises(RuntimeError, match="pinned 1 time"):
        s.evict("a", N)
    with pytest.raises(RuntimeError, match="pinned 1 time"):
        s.free("a")
    with pytest.raises(BudgetExceededError, match="pinned x1"):
        s.put("b", page_tensor(2), tier="HOST")
    s.unpin("a")
    with pytest.raises(RuntimeError, match="not pinned"):
        s.unpin("a")
    s.put("b", page_tensor(2), tier="HOST")
    s.wait_all()
    assert s.info("a").state is Residency.NVME


def test_fetch_with_pin_pins_on_success(make_store):
    s = make_store(host_pages=1)
    s.put("a", page_tensor(1), tier="NVME").wait()
    view = s.fetch("a", H, pin=True).wait()
    assert s.info("a").pins == 1 and torch.equal(view, page_tensor(1))
    with pytest.raises(BudgetExceededError):
        s.put("b", page_tensor(2), tier="HOST")
    s.unpin("a")


def test_modify_makes_one_valid_copy_and_frees_stale_extent(make_store):
    s = make_store()
    ref = page_tensor(1)
    s.put("a", ref, tier="NVME").wait()
    s.fetch("a", H).wait()
    assert s.stats().tiers["NVME"].used == PAGE
    with s.modify("a", H) as t:
        with pytest.raises(RuntimeError, match="this thread holds it in a modify block"):
            s.evict("a")
        t += 1
    info = s.info("a")
    assert info.valid == {H} and info.dirty and info.extent is None
    assert s.stats().tiers["NVME"].used == 0
    s.evict("a").wait()
    assert torch.equal(s.fetch("a", D).wait(), ref + 1)
    with pytest.raises(RuntimeError, match="no valid copy in HOST; fetch it there first"):
        with s.modify("a", H):
            pass
    assert not s.info("a").busy


def test_get_needs_a_valid_copy(make_store):
    s = make_store()
    s.put("a", page_tensor(1), tier="NVME").wait()
    with pytest.raises(RuntimeError, match=r"partition 'a' is NVME; its HOST copy is not valid"):
        s.get("a", H)
    with pytest.raises(KeyError, match="not stored"):
        s.get("zz", H)


def test_put_twice_and_free(make_store):
    s = make_store()
    s.put("a", page_tensor(1), tier="HOST")
    with pytest.raises(KeyError, match="already stored"):
        s.put("a", page_tensor(1))
    s.evict("a", N).wait()
    s.fetch("a", D).wait()
    s.free("a")
    assert "a" not in s and len(s) == 0
    st = s.stats()
    assert all(t.used == 0 for t in st.tiers.values())
    s.audit()


def test_dirty_device_victim_goes_down_through_full_host(make_store):
    """DEVICE and HOST full of dirty copies; fetching a third partition to DEVICE must
    write a HOST copy to NVMe, hand the DEVICE copy down, then read the new one."""
    s = make_store(device_pages=1, host_pages=1)
    s.put("a", page_tensor(1), tier="DEVICE")
    s.put("b", page_tensor(2), tier="HOST")
    s.put("c", page_tensor(3), tier="NVME").wait()
    assert torch.equal(s.fetch("c", D).wait(), page_tensor(3))
    s.wait_all()
    s.audit()
    for k, seed in (("a", 1), ("b", 2), ("c", 3)):
        assert torch.equal(s.fetch(k, D).wait(), page_tensor(seed)), k
    s.audit()


def test_evict_waits_for_fetch_in_flight(make_store):
    s = make_store(host_pages=8)
    refs = {i: page_tensor(i, 4) for i in range(2)}
    for i, r in refs.items():
        s.put(i, r, tier="NVME")
    s.wait_all()
    handles = [s.fetch(i, H) for i in refs]
    evicts = [s.evict(i, N) for i in refs]  # each waits for its fetch, then drops clean
    for h, e in zip(handles, evicts):
        assert h.done() and e.wait() is None
    assert all(s.info(i).valid == {N} for i in refs)
    assert s.stats().writes == 2  # the puts only
    s.audit()


def test_swap_files_locked_named_and_removed(tmp_path):
    cfg = store_config(tmp_path / "swap")
    s = TieredStore(cfg, rank=3)
    path = s.swap_paths("param")[0]
    assert os.path.basename(path) == "offload-r3-param.swap" and os.path.exists(path)
    with pytest.raises(SwapLockedError, match="already open in this process"):
        TieredStore(cfg, rank=3)
    s.put("x", page_tensor(1), kind="grad", tier="NVME").wait()
    grad = s.swap_paths("grad")[0]
    assert os.path.basename(grad) == "offload-r3-grad.swap"
    s.close()
    assert not os.listdir(tmp_path / "swap")
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.put("y", page_tensor(1))
    k = TieredStore(cfg, rank=3)
    k.put("x", page_tensor(1), tier="NVME").wait()
    k.close(keep_files=True)
    assert os.path.getsize(os.path.join(tmp_path / "swap", "offload-r3-param.swap")) > 0


def test_a_ctrl_c_after_any_call_of_the_stores_start_leaves_nothing_open(tmp_path):
    """A KeyboardInterrupt right after each call TieredStore's constructor makes returns
    (where a Ctrl-C's handler runs): no store thread stays, and the same swap path opens
    again (no swap file left locked). Before, one in the worker thread's start, outside
    the `try` that closes the swap files, left them locked for the process."""
    import sys

    cfg = store_config(tmp_path / "swap")
    init = TieredStore.__init__.__code__

    def after(n, fired):
        def profile(frame, event, arg):
            if event == "c_return" and frame.f_code is init or event == "return" \
                    and frame.f_back is not None and frame.f_back.f_code is init:
                fired.append(frame.f_code.co_name if event == "return" else str(arg))
                if len(fired) == n:
                    raise KeyboardInterrupt
        return profile

    n, seen = 1, set()
    while True:
        fired: list[str] = []
        sys.setprofile(after(n, fired))
        try:
            s = TieredStore(cfg)
        except KeyboardInterrupt:
            s = None
        finally:
            sys.setprofile(None)
        if s is not None:  # the constructor ended before its n-th call
            s.close()
            break
        seen.add(fired[-1])
        assert not [t for t in threading.enumerate() if t.name.startswith("offload-store")]
        TieredStore(cfg).close()  # not locked
        n += 1
    assert "start" in seen and n > 10


def test_stats_snapshot_and_log(make_store, caplog):
    s = make_store(host_pages=2)
    s.put("p", page_tensor(1), kind="param", tier="HOST")
    s.put("g", page_tensor(2), kind="grad", tier="HOST")
    st = s.stats()
    assert st.tiers["HOST"].by_kind == {"param": PAGE, "grad": PAGE}
    assert st.partitions == 2 and st.by_state == {"HOST": 2}
    s.evict("g", N).wait()
    with caplog.at_level(logging.INFO, logger="offload.store"):
        s.log_stats()
    assert "2 partitions" in caplog.text and "HOST->NVME 1 x" in caplog.text
    assert s.stats().wait_seconds >= 0 and footprint(1) == PAGE


def test_take_peaks_counts_a_copy_held_for_a_moment(make_store):
    """take_peaks gives each tier's most bytes since its last call, a copy charged
    and given back in between included, then starts from what each holds now."""
    s = make_store(host_pages=4)
    s.put("p", page_tensor(1), kind="param", tier="HOST")
    assert s.take_peaks()["HOST"] == PAGE
    s.put("q", page_tensor(2, 2), kind="param", tier="HOST")
    s.evict("q", N).wait()  # held for a moment, back to one page
    assert s.take_peaks()["HOST"] == 3 * PAGE
    assert s.take_peaks()["HOST"] == PAGE and s.stats().tiers["HOST"].peak == 3 * PAGE


@pytest.mark.parametrize("engine", ENGINES)
def test_close_waits_for_moves_in_flight_and_releases_all(tmp_path, engine):
    s = TieredStore(store_config(tmp_path / "swap", engine=engine, host_pages=64,
                                 device_pages=8))
    for i in range(8):
        s.put(i, page_tensor(i, 8), tier="HOST")
    handles = [s.evict(i, N) for i in range(8)] + [s.fetch(0, D)]
    s.close()
    assert all(h.done() and h.error is None for h in handles)
    assert not os.listdir(tmp_path / "swap")
    st = s.stats()
    assert st.partitions == 0 and all(t.used == 0 for t in st.tiers.values())
    assert st.moves["HOST->NVME"].moves == 8


def test_moves_finish_even_if_an_io_callback_is_lost(make_store, monkeypatch):
    """IoHandle can drop a callback added while it finishes (see [Note: lost callbacks]);
    here every callback of the store is dropped: the completion thread's sweep must
    still finish each move."""
    original = IoHandle.add_done_callback

    def drop_store_callbacks(self, fn):
        if "MoveExecutor" not in getattr(fn, "__qualname__", ""):
            original(self, fn)

    monkeypatch.setattr(IoHandle, "add_done_callback", drop_store_callbacks)
    s = make_store(host_pages=8)
    for i in range(4):
        s.put(i, page_tensor(i), tier="NVME")
    for i in range(4):
        assert torch.equal(s.fetch(i, D if i % 2 else H).wait(timeout=10), page_tensor(i))
    s.audit()


def test_split_moves_a_clean_copy_to_a_new_record_without_charge_or_copy(make_store):
    """[Note: split]: the memory of a clean copy changes owner; the old record keeps its
    NVMe copy (the value), the new one is dirty in that tier, budgets unchanged."""
    s = make_store(host_pages=1, device_pages=1)
    ref = page_tensor(5)
    s.put("a", ref, tier="NVME").wait()
    view = s.fetch("a", H).wait()
    used = {t: v.used for t, v in s.stats().tiers.items()}
    assert s.split("a", "b", H)
    assert s.info("a").valid == {N} and s.info("b").valid == {H} and s.info("b").dirty
    assert s.get("b", H).data_ptr() == view.data_ptr()  # the same memory, no copy
    assert {t: v.used for t, v in s.stats().tiers.items()} == used
    with s.modify("b", H) as t:
        t.add_(1)
    assert torch.equal(s.get("b", H), ref + 1)
    s.free("b")  # the failed step's path: the old record still reads the old value
    assert torch.equal(s.fetch("a", H).wait(), ref)
    s.audit()


def test_split_refuses_a_dirty_copy_and_another_threads_pin(make_store):
    s = make_store()
    ref = page_tensor(6)
    s.put("a", ref, tier="HOST")  # dirty: its only copy
    assert not s.split("a", "b", H) and "b" not in s
    s.put("c", ref, tier="NVME").wait()
    s.fetch("c", H).wait()
    assert not s.split("c", "d", D)  # no copy there
    t = threading.Thread(target=s.pin, args=("c",))
    t.start()
    t.join()
    assert not s.split("c", "d", H) and s.info("c").valid == {H, N}
    s.unpin("c")
    s.pin("c")  # the caller's own pin stays with the old record
    assert s.split("c", "d", H)
    assert s.info("c").pins == 1 and s.info("c").valid == {N}
    s.unpin("c")
    with pytest.raises(KeyError, match="already stored"):
        s.split("c", "d", H)
    with pytest.raises(ValueError, match="DEVICE or HOST"):
        s.split("c", "e", N)
    s.audit()


def test_split_with_pin_keeps_the_new_record_where_it_is(make_store):
    """split(pin=True): the new record is born pinned by the caller, so a fetch that
    needs its tier's room cannot move it out before the caller modifies it there
    (an update in place: [Note: the update in the old copy's memory] in
    offload/engine/step.py); unpinned, the same fetch hands it down."""
    for pin in (True, False):
        s = make_store(host_pages=2, device_pages=1, wait_timeout=0.5)
        s.put("a", page_tensor(1), tier="NVME").wait()
        s.put("c", page_tensor(2), tier="NVME").wait()
        s.fetch("a", D).wait()
        assert s.split("a", "b", D, pin=pin)
        assert s.info("b").pins == int(pin)
        if pin:
            with pytest.raises(BudgetExceededError):
                s.fetch("c", D).wait()
            with s.modify("b", D) as t:
                t.add_(1)
            s.unpin("b")
            assert torch.equal(s.get("b", D), page_tensor(1) + 1)
        else:
            s.fetch("c", D).wait()
            assert s.info("b").valid == {H}
        s.audit()
        s.close()


def test_a_read_to_the_cpu_device_needs_no_host_room(make_store):
    """On a CPU device a fetch from NVMe to DEVICE reads straight into DEVICE memory
    ([Note: CPU device tier]): with HOST full of dirty copies it evicts none of them,
    writes nothing, and counts the read as NVME->DEVICE."""
    s = make_store(host_pages=2, device_pages=2)
    if s.device.type != "cpu":
        pytest.skip("a read lands in DEVICE memory only where it is host memory")
    s.put("c", page_tensor(3), tier="NVME").wait()  # written from HOST, then released
    s.put("a", page_tensor(1), tier="HOST").wait()
    s.put("b", page_tensor(2), tier="HOST").wait()  # HOST full, both dirty
    writes = s.stats().moves["HOST->NVME"].moves
    assert torch.equal(s.fetch("c", D).wait(), page_tensor(3))
    assert s.info("a").valid == {H} and s.info("b").valid == {H}
    assert s.info("c").valid == {D, N}
    st = s.stats()
    assert st.moves["HOST->NVME"].moves == writes
    assert st.moves["NVME->DEVICE"].moves == 1 and st.moves["NVME->HOST"].moves == 0
    assert st.tiers["HOST"].used == 2 * PAGE and st.tiers["DEVICE"].used == PAGE
    s.evict("c", H).wait()  # handed down: HOST must make room now, by writing one back
    assert torch.equal(s.get("c", H), page_tensor(3))
    s.audit()


def test_a_fetch_up_from_a_full_host_swaps_with_the_device_copy_it_displaces(make_store):
    """On a CPU device, DEVICE and HOST full of only copies: fetching the HOST one to
    DEVICE hands it up and the DEVICE one down into its room at once ([Note: a
    hand-over swaps]): nothing is written, no byte is copied."""
    s = make_store(device_pages=1, host_pages=1)
    if s.device.type != "cpu":
        pytest.skip("hand-overs happen where DEVICE memory is host memory")
    for key, seed, tier in (("v", 1, D), ("x", 2, H)):
        s.put(key, page_tensor(seed), tier="NVME").wait()
        s.fetch(key, tier).wait()
        with s.modify(key, tier) as t:  # its only copy
            t += 1
    before = s.stats()
    assert torch.equal(s.fetch("x", D).wait(), page_tensor(2) + 1)
    assert s.info("x").valid == {D} and s.info("v").valid == {H}
    assert torch.equal(s.get("v", H), page_tensor(1) + 1)
    st = s.stats()
    assert st.writes == before.writes
    assert st.evictions == before.evictions + 1  # the copy handed down counts
    for d in ("HOST->DEVICE", "DEVICE->HOST"):
        assert st.moves[d].moves == before.moves[d].moves + 1
        assert st.moves[d].copied_bytes == before.moves[d].copied_bytes
    s.audit()


def test_a_clean_device_copy_needed_sooner_goes_down_and_the_host_one_leaves(make_store):
    """On a CPU device, DEVICE and HOST are one memory: making DEVICE room, a clean copy
    there needed sooner than a HOST one goes down to HOST (no copy), and the HOST one,
    needed last, leaves (written: it is dirty) instead of the clean one dropped."""
    from offload.store import NextUsePolicy

    policy = NextUsePolicy()
    policy.follow({"c": 1, "h": 5, "y": 0}.get)
    s = make_store(device_pages=1, host_pages=1, policy=policy)
    if s.device.type != "cpu":
        pytest.skip("hand-overs happen where DEVICE memory is host memory")
    s.put("c", page_tensor(1), tier="NVME").wait()
    s.fetch("c", D).wait()  # clean: NVMe holds it too
    s.put("y", page_tensor(3), tier="NVME").wait()
    s.put("h", page_tensor(2), tier="NVME").wait()
    s.fetch("h", H).wait()
    with s.modify("h", H) as t:  # dirty
        t += 1
    writes = s.stats().writes
    assert torch.equal(s.fetch("y", D).wait(), page_tensor(3))
    s.wait_all()
    assert s.info("c").valid == {H, N} and torch.equal(s.get("c", H), page_tensor(1))
    assert s.info("h").valid == {N} and s.stats().writes == writes + 1
    assert torch.equal(s.fetch("h", H).wait(), page_tensor(2) + 1)
    s.audit()


def test_prefetch_never_waits(make_store):
    """`prefetch` starts a fetch that needs no wait and otherwise returns None at once:
    where its room needs a dirty copy written first (that write is started, and a
    later call finds the room), and for a partition whose move is in flight."""
    pages = 4096  # 16 MiB: its write takes milliseconds
    s = make_store(device_pages=pages, host_pages=pages)
    s.put("c", page_tensor(3, pages), tier="NVME").wait()
    s.put("a", page_tensor(1, pages), tier="NVME").wait()
    s.fetch("a", H).wait()
    with s.modify("a", H) as t:  # HOST full of a dirty copy
        t += 1
    writes = s.stats().writes
    assert s.prefetch("c", H) is None  # room: a written first, not waited for
    assert s.info("a").busy and s.prefetch("a", H) is None  # in flight: on its way
    s.wait_all()
    assert s.stats().writes == writes + 1 and s.info("a").valid == {N}
    assert torch.equal(s.prefetch("c", H).wait(), page_tensor(3, pages))
    assert s.prefetch("c", H).wait() is not None  # there already: nothing to move
    assert torch.equal(s.fetch("a", D).wait(), page_tensor(1, pages) + 1)
    s.audit()
