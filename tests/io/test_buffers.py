"""BufferPool / HostBuffer: alignment, reuse, budget, waiting, eviction, views, pinning."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest
import torch

from offload.io.buffers import BufferPool, HostBuffer, PoolStats
from offload.io.errors import PoolExhaustedError
from offload.io.hugepages import kernel_mode as hugepages_mode

KIB = 1024
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def pool():
    p = BufferPool(64 * KIB, pin=False)
    yield p
    p.close(force=True)


@pytest.mark.parametrize("nbytes", [1, 100, 4095, 4096, 4097, 10_000, 65_536])
def test_alignment_and_rounding(pool, nbytes):
    buf = pool.alloc(nbytes)
    assert buf.nbytes == nbytes
    assert buf.capacity == -(-nbytes // 4096) * 4096
    assert buf.address % 4096 == 0
    t = buf.tensor
    assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == buf.capacity
    assert t.data_ptr() == buf.address and t.is_contiguous()
    buf.release()


def test_larger_alignment():
    with BufferPool(1 << 20, pin=False, alignment=64 * KIB) as p:
        bufs = [p.alloc(n) for n in (1, 5000, 70_000)]
        assert [b.capacity for b in bufs] == [64 * KIB, 64 * KIB, 128 * KIB]
        assert all(b.address % (64 * KIB) == 0 for b in bufs)
        for b in bufs:
            b.release()


def test_reuse_returns_same_memory(pool):
    a = pool.alloc(5000, tag="a")
    addr = a.address
    a.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    a.release()
    b = pool.alloc(8000, tag="b")  # same rounded size (8 KiB)
    assert b.address == addr and b.nbytes == 8000
    assert b.tensor[:4].tolist() == [1, 2, 3, 4]  # reused, not zeroed
    s = pool.stats()
    assert (s.allocs, s.reuses, s.held_bytes, s.cached_bytes) == (2, 1, 8 * KIB, 0)
    b.release()
    assert pool.stats().cached_bytes == 8 * KIB


def test_never_hands_out_a_buffer_twice(pool):
    bufs = [pool.alloc(4 * KIB) for _ in range(8)]
    assert len({b.address for b in bufs}) == 8
    for b in bufs[::2]:
        b.release()
    again = [pool.alloc(4 * KIB) for _ in range(4)]
    live = bufs[1::2] + again
    assert len({b.address for b in live}) == 8
    for b in live:
        b.release()


def test_exhaustion_raises_quickly_and_names_tags(pool):
    held = [pool.alloc(16 * KIB, tag="params") for _ in range(3)] + [pool.alloc(8 * KIB, tag="grads")]
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError) as err:
        pool.alloc(16 * KIB, tag="exp_avg", timeout=0)
    assert time.monotonic() - t0 < 0.5
    msg = str(err.value)
    for part in ("65536", "budget", "held 57344 bytes", "'params': 3 buffer(s), 49152 bytes",
                 "'grads': 1 buffer(s)", "'exp_avg'", "io.buffer_budget", "chunk sizes"):
        assert part in msg, (part, msg)
    assert pool.stats().held_bytes == 56 * KIB  # the failed call changed nothing
    for b in held:
        b.release()


def test_request_larger_than_budget(pool):
    with pytest.raises(PoolExhaustedError, match="alone exceeds the budget of 65536"):
        pool.alloc(64 * KIB + 1, timeout=None)  # would otherwise wait forever


def test_timeout_expires(pool):
    held = pool.alloc(64 * KIB, tag="hog")
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="'hog'"):
        pool.alloc(4 * KIB, timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 2.0
    assert pool.stats().waits == 1
    held.release()


def test_release_in_other_thread_unblocks_waiter(pool):
    held = pool.alloc(64 * KIB, tag="hog")
    timer = threading.Timer(0.2, held.release)
    timer.start()
    t0 = time.monotonic()
    buf = pool.alloc(64 * KIB, tag="next", timeout=10.0)
    elapsed = time.monotonic() - t0
    timer.join()
    assert 0.1 <= elapsed < 5.0
    s = pool.stats()
    assert s.waits == 1 and s.reuses == 1 and s.held_bytes == 64 * KIB
    buf.release()


def test_evicts_cached_buffers_of_other_sizes():
    with BufferPool(20 * KIB, pin=False) as p:
        small, mid = p.alloc(4 * KIB), p.alloc(8 * KIB)
        mid_addr = mid.address
        small.release()
        mid.release()  # 12 KiB cached, 8 KiB free
        big = p.alloc(12 * KIB, timeout=0)  # evicts the oldest cached (4 KiB) only
        s = p.stats()
        assert (s.evictions, s.cached_bytes, s.held_bytes) == (1, 8 * KIB, 12 * KIB)
        again = p.alloc(8 * KIB, timeout=0)
        assert again.address == mid_addr
        big.release()
        again.release()
        huge = p.alloc(20 * KIB, timeout=0)  # evicts both
        assert p.stats().evictions == 3 and p.stats().cached_bytes == 0
        huge.release()
        assert p.stats().peak_held_bytes == 20 * KIB


def test_the_peak_is_the_most_held_at_once_not_the_last(pool):
    a, b = pool.alloc(12 * KIB), pool.alloc(8 * KIB)
    a.release()
    b.release()
    c = pool.alloc(4 * KIB)
    s = pool.stats()
    assert (s.held_bytes, s.peak_held_bytes) == (4 * KIB, 20 * KIB)
    c.release()


def test_views_share_memory(pool):
    buf = pool.alloc(4 * KIB)
    arr = buf.numpy()
    assert arr.dtype == np.uint8 and arr.shape == (4096,)
    assert arr.ctypes.data == buf.address
    arr[:8] = 7
    assert buf.tensor[:8].tolist() == [7] * 8
    f32 = buf.as_tensor(torch.float32, 16)
    assert f32.shape == (16,) and f32.data_ptr() == buf.address
    f32[0] = 1.5
    assert np.frombuffer(arr[:4].tobytes(), np.float32)[0] == 1.5
    assert buf.as_tensor(torch.bfloat16).numel() == 2048  # default: all of nbytes
    with pytest.raises(ValueError, match="do not fit"):
        buf.as_tensor(torch.float64, 513)
    mv = buf.memoryview()
    assert not mv.readonly and mv.nbytes == 4096 and mv.format == "B"
    c = (ctypes.c_char * 4096).from_buffer(mv)
    assert ctypes.addressof(c) == buf.address
    del c, mv
    buf.release()


def test_memoryview_with_preadv(pool, tmp_path):
    path = tmp_path / "data.bin"
    payload = os.urandom(8192)
    path.write_bytes(payload)
    buf = pool.alloc(8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [buf.memoryview()], 0) == 8192
    finally:
        os.close(fd)
    assert bytes(buf.tensor.numpy()) == payload
    buf.release()


def test_double_release_and_use_after_release(pool):
    buf = pool.alloc(100, tag="x")
    buf.release()
    with pytest.raises(ValueError, match="released twice"):
        buf.release()
    with pytest.raises(ValueError, match="'x'.*released"):
        buf.tensor
    with pool.alloc(100) as b2:
        assert isinstance(b2, HostBuffer) and not b2.released
    assert b2.released and pool.stats().held_bytes == 0


def test_close_names_held_buffers():
    p = BufferPool(64 * KIB, pin=False)
    buf = p.alloc(4 * KIB, tag="optimizer")
    with pytest.raises(RuntimeError, match="'optimizer': 1 buffer"):
        p.close()
    view = buf.tensor
    p.close(force=True)
    view.fill_(3)  # a stale view still points at mapped memory
    assert buf.released
    with pytest.raises(ValueError):
        buf.release()
    with pytest.raises(RuntimeError, match="closed"):
        p.alloc(10)
    p.close()  # idempotent


def test_stats_and_unpinned_without_cuda(pool):
    s = pool.stats()
    assert isinstance(s, PoolStats) and s.budget == 64 * KIB
    with pytest.raises(Exception):
        s.budget = 1  # frozen
    assert pool.pinned is False
    buf = pool.alloc(10)
    assert buf.pinned is False and not buf.tensor.is_pinned()
    buf.release()
    if not torch.cuda.is_available():
        assert BufferPool(KIB * 4).pinned is False
        with pytest.raises(ValueError, match="CUDA is absent"):
            BufferPool(KIB * 4, pin=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        BufferPool(0)
    with pytest.raises(ValueError, match="power of two"):
        BufferPool(4096, alignment=1000)
    with BufferPool(4096, pin=False) as p, pytest.raises(ValueError, match="positive"):
        p.alloc(0)


def test_many_threads_respect_budget():
    p = BufferPool(48 * KIB, pin=False)
    sizes = [4 * KIB, 8 * KIB, 12 * KIB, 16 * KIB]
    errors: list[BaseException] = []
    seen_over_budget = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                buf = p.alloc(int(rng.choice(sizes)), tag=f"t{seed}", timeout=10.0)
                buf.tensor[0] = seed
                st = p.stats()
                if st.held_bytes + st.cached_bytes > st.budget:
                    seen_over_budget.append(st)
                assert buf.tensor[0].item() == seed  # nobody else holds this memory
                buf.release()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not seen_over_budget
    s = p.stats()
    assert s.held_bytes == 0 and s.allocs == 1200 and s.peak_held_bytes <= 48 * KIB
    p.close()


@pytest.mark.gpu
@requires_cuda
def test_pinned_buffers_copy_non_blocking():
    with BufferPool(64 << 20, pin=None) as p:
        assert p.pinned
        buf = p.alloc((16 << 20) + 123, tag="h2d")
        assert buf.pinned and buf.tensor.is_pinned() and buf.address % 4096 == 0
        src = buf.as_tensor(torch.float32)
        src.copy_(torch.arange(src.numel(), dtype=torch.float32))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dev = src.to("cuda", non_blocking=True)
            back = torch.empty_like(src, device="cuda")
            back.copy_(dev * 2, non_blocking=True)
            out = p.alloc(buf.capacity, tag="d2h")
            out.as_tensor(torch.float32, src.numel()).copy_(back, non_blocking=True)
        stream.synchronize()
        assert torch.equal(out.as_tensor(torch.float32, src.numel()), src * 2)
        buf.release()
        out.release()
    with pytest.raises(RuntimeError, match="closed"):
        p.alloc(1)


def test_populate_faults_pages_in_and_keeps_the_bytes():
    """populate() prefaults a tensor's pages ([Note: populating ahead]): the data is
    unchanged, and fresh pages are resident afterwards without being written."""
    import mmap as _mmap
    from offload.io.buffers import mapped_empty, populate
    x = torch.arange(3 << 20, dtype=torch.float32)
    before = x.clone()
    assert populate(x) and torch.equal(x, before)
    fresh = mapped_empty(64 << 20, torch.uint8)
    assert fresh.data_ptr() % _mmap.PAGESIZE == 0 and fresh.numel() == 64 << 20

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _mmap.PAGESIZE
    r0 = rss()
    assert populate(fresh)
    assert rss() - r0 >= 60 << 20  # resident now, though nothing wrote it
    assert int(fresh.sum()) == 0  # anonymous memory: zeros, untouched by populate


def _vma(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.skipif(hugepages_mode() in ("never", "unavailable"),
                    reason="the kernel's transparent huge pages are off")
def test_large_buffers_ask_for_huge_pages_without_counting_the_alignment():
    """A block of 2 MiB or more is 2 MiB aligned and advised MADV_HUGEPAGE
    ([Note: huge-page buffers]); the pool counts its page-rounded size, not the
    alignment's slack, so a budget of exactly the buffer still fits it."""
    pool = BufferPool(6 << 20, pin=False)
    try:
        big = pool.alloc(6 << 20)
        assert big.address % (2 << 20) == 0
        big.tensor.fill_(7)
        assert "hg" in _vma(big.address)["VmFlags"].split()
        assert pool.stats().held_bytes == 6 << 20
        big.release()
        exact = pool.alloc(2 << 20)  # the boundary itself is large
        assert "hg" in _vma(exact.address)["VmFlags"].split()
        exact.release()
        small = pool.alloc(64 * KIB)
        assert "hg" not in _vma(small.address)["VmFlags"].split()
        small.release()
    finally:
        pool.close(force=True)


def test_host_copy_of_a_conjugate_or_negative_view_copies_its_value():
    from offload.io import host_copy
    z = torch.complex(torch.randn(1000), torch.randn(1000))
    for src in (z.conj(), torch._neg_view(z)):
        dst = torch.empty_like(z)
        host_copy(dst, src)
        assert torch.equal(dst, src.resolve_conj().resolve_neg())
    dst = torch.zeros_like(z).conj()  # into a conjugate view: its value is written
    host_copy(dst, z)
    assert torch.equal(dst, z)


@pytest.mark.parametrize("nbytes", [4096.5, True, "4096", 0, -1])
def test_a_size_that_is_not_a_positive_integer_is_refused(pool, nbytes):
    """A float failed deep inside mmap on a fresh pool, and from the cache handed out a
    buffer whose nbytes exceeded its capacity; True was taken for 1 byte."""
    held = pool.alloc(4096)
    held.release()  # a cached block of that size, which 4096.5 used to reuse
    before = pool.stats()
    with pytest.raises(ValueError, match=r"buffer size must be a positive number of bytes"):
        pool.alloc(nbytes)
    assert pool.stats() == before


def test_a_transfer_size_that_is_a_bool_is_refused(pool, tmp_path):
    from offload.io import SwapSpace, ThreadEngine
    engine = ThreadEngine()
    try:
        with SwapSpace([str(tmp_path)], "t", engine, grow_step=1 << 20) as sw:
            buf, ext = pool.alloc(4096), sw.alloc(4096)
            for bad in (True, 4096.0):
                with pytest.raises(ValueError, match="a transfer's size must be a positive"):
                    sw.write(ext, buf, bad)
            with pytest.raises(ValueError, match="swap extent size must be a positive"):
                sw.alloc(True)
    finally:
        engine.close()


def test_two_threads_mapping_at_once_stay_within_the_budget(monkeypatch):
    """A block is mapped outside the pool's lock: two threads allocating at the same
    moment must count each other's mapping in flight, or the pool holds twice its
    budget. One of the two gets the budget's bytes, the other is refused."""
    from offload.io import buffers
    init = buffers._Block.__init__

    def slow(self, *args, **kwargs):  # a mapping that takes a while, as a large one does
        time.sleep(0.3)
        init(self, *args, **kwargs)
    monkeypatch.setattr(buffers._Block, "__init__", slow)
    pool = BufferPool(64 << 10, pin=False)
    held, refused = [], []

    def alloc():
        try:
            held.append(pool.alloc(64 << 10, timeout=0.0))
        except PoolExhaustedError:
            refused.append(True)
    threads = [threading.Thread(target=alloc) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(held), len(refused)) == (1, 1)
    assert sum(b.footprint for b in pool._blocks.values()) <= pool.budget
    pool.close(force=True)
