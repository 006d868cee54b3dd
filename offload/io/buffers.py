"""Page-aligned (and, with CUDA, pinned) host buffers under a hard byte budget.

`BufferPool.alloc` hands out a `HostBuffer`: aligned memory seen as a torch
uint8 tensor, a numpy array or a writable memoryview, all over the same bytes.
Released buffers are cached by size and handed out again; when the budget is
reached the pool evicts cached buffers of other sizes, then waits for another
thread to release, then raises `PoolExhaustedError` naming what is held.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from offload.io.errors import PoolExhaustedError
from offload.io.extents import positive_bytes
from offload.io.process import in_owner

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_MAP_FLAGS = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}

# [Note: buffer lifetime]
# A HostBuffer owns its memory from `alloc` until `release`. After `release`
# the pool may give the same bytes to the next `alloc` of that size, or unpin
# and drop them, at once. So a buffer handed to an in-flight transfer (an AIO
# read, a non_blocking copy to the GPU) must not be released until that
# transfer's handle has completed: this is the caller's contract (DESIGN.md,
# Rules), and the pool cannot check it. What the pool does guarantee:
#   * one block of memory is held by at most one live HostBuffer at a time
#     (a block is either in `_cached` or owned by one handle, under the pool's lock);
#   * a released handle refuses further use (its accessors raise ValueError),
#     though views taken from it earlier still alias the memory;
#   * memory is never unmapped under a live view: the mmap object is freed by
#     reference counting, so a stale tensor keeps it mapped (unpinned, and
#     outside the budget) rather than dangling.


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src. Between contiguous CPU tensors of one dtype, one memcpy on the
    calling thread: torch's `copy_` splits a large copy over its intra-op threads,
    which made it 30 times slower on 2 cores busy with other work (0.35 against
    13 GB/s for 4 MiB copies). Anything else goes to `copy_`, as does a conjugate or
    negative view, whose bytes are not its value."""
    if (dst.dtype != src.dtype or dst.device.type != "cpu" or src.device.type != "cpu"
            or not (dst.is_contiguous() and src.is_contiguous())
            or src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg()):
        dst.copy_(src)
        return
    if dst.shape != src.shape:
        raise ValueError(f"host_copy: shapes differ: {tuple(dst.shape)} <- {tuple(src.shape)}")
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


# [Note: populating ahead]
# Memory the process has never touched costs a page fault per page on first
# write; in a virtual machine each fault may also leave to the hypervisor to back
# the page, and landing 2 GB of state in fresh memory ran at 0.6-0.8 GB/s where
# the disk alone did 1-2 GB/s. `populate` asks the kernel to fault a range in
# (madvise MADV_POPULATE_WRITE, Linux 5.14): no per-page trap, no write to the
# data, and, on a thread of its own (ctypes releases the GIL), ahead of the reads
# that will fill the range, so the faults overlap the disk. It never changes the
# bytes, so it is safe beside a transfer into the same pages.
_MADV_POPULATE_WRITE = 23


@functools.lru_cache(maxsize=None)
def _madvise():
    """The C library's madvise, or None where it cannot be called."""
    import ctypes
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def populate(t: torch.Tensor) -> bool:
    """Faults in the whole pages inside CPU tensor `t`'s bytes without changing them
    ([Note: populating ahead]). False where the kernel or C library cannot (nothing
    is done: the first write faults them in as usual)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or not t.is_contiguous():
        return False
    lo = _round_up(t.data_ptr(), _PAGE)
    hi = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
    return hi <= lo or fn(lo, hi - lo, _MADV_POPULATE_WRITE) == 0


def mapped_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor in a private anonymous mapping of its own
    (page-aligned, small pages, unmapped when the last view is gone)."""
    nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
    mapping = mmap.mmap(-1, _round_up(nbytes, _PAGE), **_MAP_FLAGS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:numel * dtype.itemsize].view(dtype)


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _cuda_call(name: str, *args: int) -> None:
    rc = int(getattr(torch.cuda.cudart(), name)(*args))
    if rc != 0:
        raise RuntimeError(f"{name}{args} failed with cudaError {rc}; an earlier asynchronous "
                           "CUDA error may be reported here (rerun with CUDA_LAUNCH_BLOCKING=1)")


# [Note: huge-page buffers]
# A direct read or write of a buffer reaches the virtual disk as a list of
# physically contiguous segments: with 4 KiB pages a 4 MiB request is up to
# 1024 of them, and the block layer splits it wherever it passes the queue's
# segment limit (254 on this project's virtio disk), so how many requests the
# disk sees, and how fast it serves them, depends on how fragmented physical
# memory was when the buffer was faulted in. On 2 MiB transparent huge pages
# the same request is two segments. A 1 GiB O_DIRECT probe, 4 MiB requests at
# queue depth 32, alternating one buffer of each kind in one process
# (benchmarks/hugepage_io.py, all four rounds of its run in docs/benchmarks.md),
# moved writes at 2.58-2.70 GB/s against 1.94-2.06, reads at 2.04-2.12 against
# 1.57-1.62 and mixed traffic at 2.32-2.36 against 1.77-1.82, the disk seeing
# 271 requests per GiB against 654. So a block of a huge page or
# more is aligned to 2 MiB and advised MADV_HUGEPAGE before it is touched
# (kernel THP mode `madvise` or `always`; elsewhere the advice fails and the
# block keeps small pages). The alignment over-maps up to 2 MiB of address
# space that is never touched, so it is not resident and not counted: the
# bytes a block may make resident stay its page-rounded capacity.
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge(address: int, nbytes: int) -> None:
    """Asks for transparent huge pages over [address, address + nbytes); where the
    kernel or C library refuses, the range keeps small pages."""
    fn = _madvise()
    if fn is not None:
        fn(address, nbytes, _MADV_HUGEPAGE)


class _Block:
    """One mapping: `capacity` aligned bytes at `address`, pinned or not."""

    __slots__ = ("mapping", "tensor", "address", "capacity", "footprint", "pinned", "gpu")

    def __init__(self, capacity: int, alignment: int, gpu: int | None) -> None:
        """`gpu`: the CUDA device whose context pins the block, None for no pinning."""
        # mmap returns page-aligned memory; over-map only when alignment exceeds a page.
        pages = _round_up(capacity, _PAGE)
        self.footprint = pages + max(0, alignment - _PAGE)
        huge = capacity >= _HUGE  # [Note: huge-page buffers]: the slack is not counted
        mapped_alignment = max(alignment, _HUGE) if huge else alignment
        self.mapping = mmap.mmap(-1, pages + max(0, mapped_alignment - _PAGE), **_MAP_FLAGS)
        base = torch.frombuffer(self.mapping, dtype=torch.uint8)
        skip = -base.data_ptr() % mapped_alignment
        self.tensor = base[skip:skip + capacity]
        self.address = self.tensor.data_ptr()
        if huge:
            _advise_huge(self.address, pages)
        self.capacity = capacity
        self.pinned = False
        self.gpu = gpu
        if gpu is not None:
            # on the pool's GPU, whichever thread maps the block: a thread still on GPU 0
            # would make a context there ([Note: a GPU per rank] in offload/store/copy.py)
            with torch.cuda.device(gpu):
                _cuda_call("cudaHostRegister", self.address, capacity, 0)
            self.pinned = True

    def destroy(self) -> None:
        """Unpin and drop the pool's reference; views still alive keep the bytes mapped."""
        if self.pinned:
            self.pinned = False
            with torch.cuda.device(self.gpu):
                _cuda_call("cudaHostUnregister", self.address)
        self.tensor = None
        self.mapping = None


def _destroy_all(blocks: dict[int, _Block], strict: bool = False) -> None:
    """Unpin and drop every block a pool still owns; a finaliser (strict=False) only
    logs failures, `close` (strict=True) raises the first after trying all."""
    first: RuntimeError | None = None
    for block in list(blocks.values()):
        try:
            block.destroy()
        except RuntimeError as e:
            logger.exception("unpinning the host buffer at %#x failed", block.address)
            first = first or e
    blocks.clear()
    if strict and first is not None:
        raise first


@dataclass(frozen=True)
class PoolStats:
    """Counters of a `BufferPool`; byte counts include page rounding."""

    budget: int             # bytes the pool may map at once
    held_bytes: int         # bytes in buffers handed out and not yet released
    cached_bytes: int       # bytes in released buffers kept for reuse
    peak_held_bytes: int    # most bytes ever held at once
    allocs: int             # successful alloc() calls
    reuses: int             # of those, served from the cache
    waits: int              # alloc() calls that had to wait for a release
    evictions: int          # cached buffers dropped to make room


class HostBuffer:
    """Aligned host memory lent by a `BufferPool` until `release`.

    `nbytes` is what was asked for, `capacity` (>= nbytes, a multiple of the
    pool's alignment) what the views cover. Lifetime: [Note: buffer lifetime].
    """

    __slots__ = ("_pool", "_block", "nbytes", "tag")

    def __init__(self, pool: BufferPool, block: _Block, nbytes: int, tag: str) -> None:
        self._pool = pool
        self._block: _Block | None = block
        self.nbytes = nbytes
        self.tag = tag

    def _live(self) -> _Block:
        block = self._block
        if block is None:
            raise ValueError(f"host buffer (tag {self.tag!r}, {self.nbytes} bytes) was released")
        return block

    @property
    def released(self) -> bool:
        return self._block is None

    @property
    def capacity(self) -> int:
        """Usable size (bytes): `nbytes` rounded up to the pool's alignment."""
        return self._live().capacity

    @property
    def address(self) -> int:
        """Address of the first byte; a multiple of the pool's alignment."""
        return self._live().address

    @property
    def pinned(self) -> bool:
        """True when the memory is registered with CUDA (page-locked)."""
        return self._live().pinned

    @property
    def tensor(self) -> torch.Tensor:
        """1-D uint8 CPU tensor over all `capacity` bytes."""
        return self._live().tensor

    def as_tensor(self, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """A 1-D `dtype` view of the first `numel` elements (default: all whole
        elements within `nbytes`)."""
        itemsize = dtype.itemsize
        if numel is None:
            numel = self.nbytes // itemsize
        if numel < 0 or numel * itemsize > self.capacity:
            raise ValueError(f"{numel} elements of {dtype} ({numel * itemsize} bytes) do not fit "
                             f"in a host buffer of {self.capacity} bytes")
        return self.tensor[:numel * itemsize].view(dtype)

    def numpy(self) -> np.ndarray:
        """uint8 numpy array over all `capacity` bytes (no copy)."""
        return self.tensor.numpy()

    def memoryview(self) -> memoryview:
        """Writable byte memoryview over `capacity` bytes, for os.preadv/pwritev and
        ``ctypes.c_char.from_buffer``."""
        return memoryview(self.numpy())

    def release(self) -> None:
        """Give the memory back to the pool. A second call raises ValueError."""
        self._pool._release(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._block is not None:
            self.release()

    def __repr__(self) -> str:
        if self._block is None:
            return f"HostBuffer(tag={self.tag!r}, nbytes={self.nbytes}, released)"
        return (f"HostBuffer(tag={self.tag!r}, nbytes={self.nbytes}, capacity={self.capacity}, "
                f"address={self.address:#x}, pinned={self.pinned})")


class BufferPool:
    """Aligned host buffers under a hard byte budget; thread safe.

    Args:
        budget_bytes: most bytes mapped at once, held and cached together
            (pinned memory included: it is host memory).
        pin: register buffers with CUDA so copies to the GPU can be
            non_blocking (for `device`, or the CUDA device current when the
            pool is made). None pins iff ``torch.cuda.is_available()``; True
            without CUDA raises ValueError.
        alignment: address and size granularity (bytes, a power of two);
            4096 suits O_DIRECT.
        device: the CUDA device the pinned buffers are for.
    """

    def __init__(self, budget_bytes: int, pin: bool | None = None, alignment: int = 4096,
                 device: torch.device | None = None) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"buffer pool budget must be positive, got {budget_bytes} bytes")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("pin=True asks for pinned host memory, but CUDA is absent "
                             "(torch.cuda.is_available() is False); use pin=None or pin=False")
        self._pin = cuda if pin is None else bool(pin)
        # the GPU whose context pins the blocks: `device`'s, else the caller's current one
        self._gpu = None if not self._pin else (
            device.index if device is not None and device.type == "cuda"
            and device.index is not None else torch.cuda.current_device())
        self._budget = budget_bytes
        self._alignment = alignment
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._blocks: dict[int, _Block] = {}       # every block mapped, by address
        self._cached: list[_Block] = []            # released blocks, oldest first
        self._out: dict[int, HostBuffer] = {}     # handles out, by id()
        self._held = self._cached_bytes = self._pending = 0
        self._peak = self._allocs = self._reuses = self._waits = self._evictions = 0
        # unpinned in the process that pinned them only: a forked child has no CUDA context
        self._finalizer = weakref.finalize(self, in_owner, os.getpid(), _destroy_all,
                                           self._blocks)

    @property
    def pinned(self) -> bool:
        """True when this pool's buffers are registered with CUDA."""
        return self._pin

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def alignment(self) -> int:
        return self._alignment

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(self._budget, self._held, self._cached_bytes, self._peak,
                             self._allocs, self._reuses, self._waits, self._evictions)

    # -- allocation ---------------------------------------------------------------

    def alloc(self, nbytes: int, *, tag: str = "", timeout: float | None = 0.0) -> HostBuffer:
        """A buffer of at least `nbytes` bytes, rounded up to `alignment`.

        Tries, in order: a cached buffer of the same size; new memory within the
        budget; new memory after evicting cached buffers of other sizes
        (oldest first); waiting up to `timeout` seconds (None: forever) for
        another thread to release. `tag` labels the buffer in error messages.

        Raises:
            PoolExhaustedError: nothing fitted in time; the message lists what is held.
        """
        nbytes = positive_bytes(nbytes, "buffer size")
        capacity = _round_up(nbytes, self._alignment)
        footprint = _round_up(capacity, _PAGE) + max(0, self._alignment - _PAGE)
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        with self._cond:
            while True:
                self._check_open()
                block = self._take_cached(capacity)
                if block is not None:
                    return self._hand_out(block, nbytes, tag, reused=True)
                evict = self._plan_eviction(footprint)
                if evict is not None:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if footprint > self._budget or (remaining is not None and remaining <= 0):
                    raise PoolExhaustedError(
                        self._exhausted_message(nbytes, capacity, footprint, tag, timeout))
                if not waited:
                    waited = True
                    self._waits += 1
                self._cond.wait(remaining)
            for victim in evict:
                self._cached.remove(victim)
                self._blocks.pop(victim.address, None)
                self._cached_bytes -= victim.footprint
                self._evictions += 1
            # Evicted bytes stay counted (as pending) until they are unpinned,
            # and the new block's bytes are reserved before it exists.
            reserved = footprint + sum(v.footprint for v in evict)
            self._pending += reserved
        return self._map_new(evict, reserved, capacity, nbytes, tag)

    def _map_new(self, evict: list[_Block], reserved: int, capacity: int, nbytes: int,
                 tag: str) -> HostBuffer:
        """Drop `evict`, map a new block; `reserved` bytes are counted as pending meanwhile."""
        # Pinning and unpinning take milliseconds per GiB: do them unlocked.
        try:
            for victim in evict:
                victim.destroy()
            block = _Block(capacity, self._alignment, self._gpu)
        except BaseException:
            with self._cond:
                self._pending -= reserved
                self._cond.notify_all()
            raise
        with self._cond:
            self._pending -= reserved
            self._cond.notify_all()
            if self._closed:
                block.destroy()
                self._check_open()
            self._blocks[block.address] = block
            return self._hand_out(block, nbytes, tag, reused=False)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")

    def _take_cached(self, capacity: int) -> _Block | None:
        for i in range(len(self._cached) - 1, -1, -1):  # newest first: warmest memory
            if self._cached[i].capacity == capacity:
                block = self._cached.pop(i)
                self._cached_bytes -= block.footprint
                return block
        return None

    def _plan_eviction(self, footprint: int) -> list[_Block] | None:
        """Cached blocks to drop so `footprint` more bytes fit, or None if that cannot."""
        room = self._budget - self._held - self._cached_bytes - self._pending
        if room >= footprint:
            return []
        if room + self._cached_bytes < footprint:
            return None
        victims = []
        for block in self._cached:  # oldest first
            victims.append(block)
            room += block.footprint
            if room >= footprint:
                return victims
        return None

    def _hand_out(self, block: _Block, nbytes: int, tag: str, *, reused: bool) -> HostBuffer:
        buf = HostBuffer(self, block, nbytes, tag)
        self._out[id(buf)] = buf
        self._held += block.footprint
        self._peak = max(self._peak, self._held)
        self._allocs += 1
        self._reuses += reused
        return buf

    def _release(self, buf: HostBuffer) -> None:
        with self._cond:
            block = buf._block
            if block is None or self._out.get(id(buf)) is not buf:
                raise ValueError(f"host buffer (tag {buf.tag!r}, {buf.nbytes} bytes) released "
                                 "twice, or after its pool was closed")
            del self._out[id(buf)]
            buf._block = None
            self._held -= block.footprint
            self._cached.append(block)
            self._cached_bytes += block.footprint
            self._cond.notify_all()

    # -- reporting and shutdown ----------------------------------------------------

    def _held_by_tag(self) -> str:
        groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for buf in self._out.values():
            g = groups[buf.tag or "<untagged>"]
            g[0] += 1
            g[1] += buf._block.footprint if buf._block is not None else 0
        rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
        return "; ".join(f"{tag!r}: {n} buffer(s), {b} bytes" for tag, (n, b) in rows) or "none"

    def _exhausted_message(self, nbytes: int, capacity: int, footprint: int, tag: str,
                           timeout: float | None) -> str:
        head = (f"host buffer pool cannot allocate {capacity} bytes (asked {nbytes}, "
                f"tag {tag!r})")
        if footprint > self._budget:
            return (f"{head}: the request alone exceeds the budget of {self._budget} bytes. "
                    "Raise io.buffer_budget or lower chunk sizes.")
        return (f"{head} after waiting {timeout} s: budget {self._budget} bytes, "
                f"held {self._held} bytes, cached {self._cached_bytes} bytes, in transition "
                f"{self._pending} bytes. Held by tag: {self._held_by_tag()}. "
                "Raise io.buffer_budget or lower chunk sizes (or release buffers sooner).")

    def close(self, force: bool = False) -> None:
        """Unpin and drop every buffer. Idempotent.

        Raises:
            RuntimeError: buffers are still held and `force` is False (they are
                named). With `force`, their handles are invalidated; views taken
                from them stay valid memory but are no longer pinned.
        """
        with self._cond:
            if self._closed:
                return
            if self._out and not force:
                raise RuntimeError(f"cannot close buffer pool: {len(self._out)} buffer(s) still "
                                   f"held ({self._held_by_tag()}); release them or close(force=True)")
            for buf in self._out.values():
                buf._block = None
            self._out.clear()
            self._cached.clear()
            self._held = self._cached_bytes = 0
            self._closed = True
            self._cond.notify_all()
        self._finalizer.detach()
        _destroy_all(self._blocks, strict=True)

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"BufferPool(budget={s.budget}, held={s.held_bytes}, cached={s.cached_bytes}, "
                f"pinned={self._pin}, closed={self._closed})")
