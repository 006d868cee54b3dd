"""Closing, claims, pins and bad input at the edges of `TieredStore`'s public API: real
swap files under tmp_path, real threads."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings

import pytest
import torch

from offload.io import libaio_status
from offload.store import BudgetExceededError, Residency, Tier, TieredStore

from .conftest import page_tensor, store_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def _swap_files(path) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


class _Block(threading.Thread):
    """Runs `body(store)` inside a `create` (or `modify`) block on a thread of its own,
    holding the block open until `leave` is set."""

    def __init__(self, store: TieredStore, key: str, *, modify: bool = False,
                 tier: str = "NVME") -> None:
        super().__init__(daemon=True)
        self.store, self.key, self.modify, self.tier = store, key, modify, tier
        self.inside, self.leave = threading.Event(), threading.Event()
        self.handle = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.modify:
                with self.store.modify(self.key, self.tier) as t:
                    self.inside.set()
                    self.leave.wait(10)
                    t.fill_(7)
                return
            with self.store.create(self.key, 1024, torch.float32, tier=self.tier) as t:
                self.inside.set()
                self.leave.wait(10)
                t.copy_(page_tensor(5))
        except BaseException as e:  # reported to the test
            self.error = e


# -- close -----------------------------------------------------------------------------
def _close_waits_for(s, block, why):
    """Closes `s` on another thread while `block` is open: close waits for it to end."""
    block.start()
    assert block.inside.wait(5)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (s.close(), closed.set()), daemon=True)
    closer.start()
    time.sleep(0.3)
    assert not closed.is_set(), why
    block.leave.set()
    block.join(5)
    closer.join(5)
    assert closed.is_set() and block.error is None, block.error


def test_close_waits_for_a_put_still_copying_in_on_another_thread(tmp_path):
    swap = tmp_path / "swap"
    s = TieredStore(store_config(swap, wait_timeout=10.0))
    _close_waits_for(s, _Block(s, "a"), "close returned while a put was still writing")
    assert _swap_files(swap) == []  # nothing reopened after close


def test_close_waits_for_another_threads_modify_block(make_store):
    s = make_store(wait_timeout=10.0)
    s.put("a", page_tensor(1), tier="HOST")
    _close_waits_for(s, _Block(s, "a", modify=True, tier="HOST"),
                     "close released memory under an open modify block")


def test_close_inside_the_callers_own_create_block_stores_nothing_and_reopens_nothing(
        tmp_path):
    swap = tmp_path / "swap"
    s = TieredStore(store_config(swap))
    s.put("a", page_tensor(1), tier="HOST")
    with pytest.raises(RuntimeError, match="'b'.*closed inside its create block"):
        with s.create("b", 1024, torch.float32, tier="NVME") as t:
            s.close()
            t.copy_(page_tensor(2))
    assert _swap_files(swap) == []
    s = TieredStore(store_config(swap))
    with pytest.raises(ValueError, match="bytes refused"):  # the block's own error stays
        with s.create("c", 1024, torch.float32, tier="NVME"):
            s.close()
            raise ValueError("bytes refused")
    assert _swap_files(swap) == []
    s = TieredStore(store_config(swap))
    s.put("a", page_tensor(1), tier="HOST")
    with s.modify("a", "HOST"):
        s.close()  # does not wait for the caller's own block
    assert _swap_files(swap) == []


def test_close_that_timed_out_can_be_called_again_and_then_releases_everything(tmp_path):
    swap = tmp_path / "swap"
    s = TieredStore(store_config(swap, wait_timeout=0.3))
    block = _Block(s, "a")
    block.start()
    assert block.inside.wait(5)
    with pytest.raises(RuntimeError, match="still in flight"):
        s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.put("x", page_tensor(1))  # a closing store takes no new work
    block.leave.set()
    block.join(5)
    assert block.error is None, block.error
    s.close()
    assert _swap_files(swap) == [], "the second close left the swap files behind"
    s.close()  # idempotent once done


# -- claims held by the calling thread ------------------------------------------------
def test_claiming_a_key_inside_its_own_create_block_raises_at_once(make_store):
    s = make_store(wait_timeout=3.0)
    for op in (lambda: s.free("a"), lambda: s.fetch("a", "HOST"), lambda: s.evict("a")):
        t0 = time.monotonic()
        with s.create("a", 1024, torch.float32, tier="HOST") as t:
            with pytest.raises(RuntimeError, match="'a'.*create block"):
                op()
            t.copy_(page_tensor(1))
        assert time.monotonic() - t0 < 1.0, "waited for the calling thread's own block"
        assert torch.equal(s.get("a", "HOST"), page_tensor(1))
        s.free("a")
    s.audit()


def test_room_held_by_the_callers_own_create_block_fails_fast(make_store):
    s = make_store(host_pages=2, wait_timeout=3.0)
    t0 = time.monotonic()
    with s.create("b", 1024, torch.float32, tier="HOST") as t:
        with pytest.raises(BudgetExceededError, match="'b'"):
            s.put("c", page_tensor(2, 2), tier="HOST")
        t.copy_(page_tensor(1))
    assert time.monotonic() - t0 < 1.0, "waited for the calling thread's own put"
    assert "c" not in s and torch.equal(s.get("b", "HOST"), page_tensor(1))
    s.audit()


def test_a_pin_taken_during_a_put_that_fails_leaves_no_trace(make_store):
    s = make_store(host_pages=2, wait_timeout=3.0)
    inside, pinned = threading.Event(), threading.Event()

    def pin_it():
        inside.wait(5)
        s.pin("a")
        pinned.set()

    th = threading.Thread(target=pin_it, daemon=True)
    th.start()
    with pytest.raises(ValueError, match="bytes refused"):
        with s.create("a", 1024, torch.float32, tier="HOST"):
            inside.set()
            assert pinned.wait(5)
            raise ValueError("bytes refused")
    th.join(5)
    s.put("a", page_tensor(1), tier="HOST")
    s.pin("a")
    assert s.info("a").pins == 1
    t0 = time.monotonic()
    with pytest.raises(BudgetExceededError):  # only this thread's pin holds HOST
        s.put("b", page_tensor(2, 2), tier="HOST")
    assert time.monotonic() - t0 < 1.0, "waited for a pin of a put that never happened"
    s.unpin("a")
    s.audit()


# -- pins ------------------------------------------------------------------------------
def test_a_pin_taken_while_an_eviction_is_in_flight_keeps_the_copy(make_store):
    s = make_store(host_pages=600, engine="threads")
    for i in range(30):
        ref = page_tensor(i, 256)
        s.put(i, ref, tier="HOST")
        h = s.evict(i, "NVME")
        s.pin(i)
        if s.info(i).state is not Residency.WRITING:  # the write was already done
            h.wait()
            s.unpin(i)
            s.free(i)
            continue
        view = s.get(i, "HOST")
        h.wait()
        info = s.info(i)
        assert H in info.valid and N in info.valid, info
        s.put("other", page_tensor(99, 256), tier="HOST")  # would reuse a released buffer
        assert torch.equal(view, ref), "a pinned view was handed to another partition"
        s.unpin(i)
        s.audit()
        return
    pytest.skip("no eviction was still writing when the pin came")


# -- bad input -------------------------------------------------------------------------
def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated; users still have them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.rand(1024), 0.1, 0, torch.quint8)


@pytest.mark.parametrize("make, match", [
    (lambda: torch.empty(1024, device="meta"), r"put\('x'\).*meta device"),
    (lambda: torch.eye(8).to_sparse(), r"put\('x'\).*to_dense"),
    (_quantized, r"put\('x'\).*int_repr"),
], ids=["meta", "sparse", "quantized"])
def test_put_refuses_tensors_without_plain_bytes_before_anything_changes(make_store, make,
                                                                          match):
    tensor = make()
    s = make_store()
    for tier in ("HOST", "NVME"):
        with pytest.raises(ValueError, match=match):
            s.put("x", tensor, tier=tier)
        assert "x" not in s and all(t.used == 0 for t in s.stats().tiers.values())
    s.audit()


def test_put_of_a_conjugate_view_stores_its_value(make_store):
    s = make_store()
    c = torch.randn(512, dtype=torch.complex64)
    s.put("c", c.conj(), tier="NVME").wait()
    assert torch.equal(s.fetch("c", "HOST").wait(), c.conj().resolve_conj())


@pytest.mark.parametrize("numel, dtype, match", [
    (10.5, torch.float32, "numel must be an int"),
    (1024, "float32", "torch.dtype"),
    (1024, float, "torch.dtype"),
], ids=["float-numel", "str-dtype", "python-type"])
def test_create_refuses_bad_numel_and_dtype_naming_the_key(make_store, numel, dtype, match):
    s = make_store()
    with pytest.raises(TypeError, match=f"'x'.*{match}"):
        with s.create("x", numel, dtype):
            pass
    stats = s.stats()
    assert "x" not in s and all(type(t.used) is int and t.used == 0
                                for t in stats.tiers.values())
    with s.create("y", torch.tensor(1024), torch.float32) as t:  # an integer tensor counts
        t.zero_()
    s.audit()


def test_a_tier_that_is_not_one_names_the_choices(make_store):
    s = make_store()
    with pytest.raises(ValueError, match="unknown tier 7; use DEVICE, HOST or NVME"):
        s.put("x", page_tensor(1), tier=7)


def test_calls_on_a_closed_store_say_it_is_closed(make_store):
    s = make_store()
    s.put("a", page_tensor(1), tier="HOST")
    s.close()
    for op in (lambda: s.pin("a"), lambda: s.unpin("a"), lambda: s.info("a"),
               lambda: s.fetch("a")):
        with pytest.raises(RuntimeError, match="closed"):
            op()


# -- a policy that raises --------------------------------------------------------------
class _FailingPolicy:
    """An LRU-less policy whose `touched` raises while `armed`."""

    def __init__(self) -> None:
        self.armed = False

    def touched(self, key, tier) -> None:
        if self.armed:
            raise ValueError(f"policy refused {key!r}")

    def forgotten(self, key) -> None:
        pass

    def choose(self, tier, need_bytes, candidates):
        return [c.key for c in candidates]


def test_a_policy_that_raises_fails_the_move_and_leaves_no_pin_or_claim(tmp_path):
    policy = _FailingPolicy()
    s = TieredStore(store_config(tmp_path / "swap", wait_timeout=3.0), policy=policy)
    s.put("a", page_tensor(1), tier="NVME").wait()
    s.put("b", page_tensor(2), tier="HOST")
    policy.armed = True
    for key in ("a", "b"):  # a read in flight, and a fetch with nothing to move
        with pytest.raises(ValueError, match="policy refused"):
            s.fetch(key, "HOST", pin=True).wait(timeout=5)
        assert s.info(key).pins == 0 and not s.info(key).busy
    with pytest.raises(ValueError, match="policy refused"):
        s.put("c", page_tensor(3), tier="NVME")
    s.wait_all(timeout=5)
    assert not s.info("c").busy
    policy.armed = False
    assert torch.equal(s.fetch("c", "HOST").wait(), page_tensor(3))
    s.audit()
    s.close()
    assert _swap_files(tmp_path / "swap") == []


def _offload_threads(before: set) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("offload-") and t not in before)


@pytest.mark.parametrize("engine", ["aio", "threads"])
def test_a_store_dropped_without_close_gives_everything_back(tmp_path, engine):
    """[Note: lost callbacks] A TieredStore (and its I/O engine) dropped unclosed was
    kept alive by its own threads for the life of the process: its threads, swap
    files and AIO context (fs.aio-max-nr slots) were never given back. Now it is
    collected once unreferenced, with a ResourceWarning."""
    if engine == "aio" and not libaio_status()[0]:
        pytest.skip(libaio_status()[1])
    before = set(threading.enumerate())
    swap = tmp_path / "swap"
    s = TieredStore(store_config(swap, engine=engine))
    ref = torch.arange(4096, dtype=torch.float32)
    s.put("a", ref, tier="NVME")
    s.wait_all()
    assert torch.equal(s.fetch("a", "HOST").wait(), ref)
    assert _offload_threads(before) and _swap_files(swap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del s
        deadline = time.monotonic() + 5
        while (_offload_threads(before) or _swap_files(swap)) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
    assert _offload_threads(before) == [] and _swap_files(swap) == []
    assert any(issubclass(w.category, ResourceWarning) and "TieredStore" in str(w.message)
               for w in caught)
    with TieredStore(store_config(swap, engine=engine)) as again:  # the paths are free
        again.put("a", ref, tier="NVME")
