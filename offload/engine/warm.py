"""Freed gather storage kept for reuse on a CPU device.

[Note: warm gather memory]
On a CPU device, memory fresh from the allocator costs a page fault per 4 KiB
on first touch (about 3 GB/s on a small VM) and an munmap when freed; a
group's gathered weights are written twice a step. `WarmMemory` keeps freed
gather storage and hands it to the next gather of a size it fits: its data
pointer is swapped into the group's persistent storage and back
(`UntypedStorage._swap_data_ptr_`), so the storage object autograd's saved
views hold stays the same. CUDA's caching allocator already reuses memory;
there, and where torch lacks the swap, storage is resized as before.

The limit counts the gathered storage and the kept storage together: what a
step has gathered at once (a unit's groups and the next unit's, gathered
before those are freed, and the one gathered ahead across ranks) is all the
memory it needs, and the storage kept beyond it was host memory outside every
budget (at 2B parameters, 128 MiB kept beside 32-64 MiB gathered).

[Note: gathered weights borrow the record]
With one rank on a CPU device, "gathering" a group is a copy of its DEVICE
record, which already is the whole group in host memory. There the engine
does not copy: the group's persistent storage takes the record's memory
itself (`borrow`), and the record stays pinned in DEVICE until the group is
freed, when the storage is emptied (`WarmMemory.vacate`) and the pin dropped. This
saves a copy of every parameter at each forward and backward use (at 2
cores, the gather's copy was about 15% of the main thread's samples in a
`none` step of the bench model) and the gathered memory outside the budgets.
Safe because nothing changes a parameter record while its group is gathered:
updates during backward write a staged new version, in-place updates run in
`step()` after every group was freed, and backward's end frees (and
unpins) every group before the commit switches records in. The storage holds
the record's memory through a NumPy view of the record's tensor, so the
pool's mapping outlives any view autograd or a traceback keeps
([Note: orphaned gathers] in engine.py; once the record is unpinned such a
view may read another record's bytes, never unmapped memory). Pinned records
cannot leave DEVICE to make room, so the engine borrows only within an
allowance: the whole units of the largest unit's partitions that the device
budget holds beyond the minimum working set, at most three, up to those units'
bytes at once (a budget of two units with a working set of one, as in the bench
step's streaming placement, borrows one unit: each forward's gather, and the
first of two gathered at once in backward). Groups gathered beyond it (several
at once in backward: nested units, tied weights, a checkpoint recomputation
that stopped early) and frozen groups (gathered from a unit's start to the end
of backward) are copied as before.
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections import Counter
from typing import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["Borrowing", "WarmMemory", "ZeroPages", "borrow", "empty", "kept_view",
           "unborrow"]

_MAP_NORESERVE = 0x4000  # Linux (x86-64, arm64): no swap space reserved for the mapping


class ZeroPages:
    """Storage that reads as zeros and holds no memory, for freed gathers; see [Note:
    freed gathers read zeros]."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(nbytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, self.nbytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """`nbytes` (at most `self.nbytes`) of the mapping; the storage keeps it mapped."""
        return torch.frombuffer(self._map, dtype=torch.uint8,
                                count=nbytes).untyped_storage()


def empty(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """Takes `storage`'s memory out (returned, as a storage), leaving it with none."""
    out = torch.UntypedStorage(0)
    if storage.nbytes():
        storage._swap_data_ptr_(out)
    return out


class WarmMemory:
    """Freed gather storage kept for reuse on a CPU device; see [Note: warm gather
    memory]. Keeps freed storage while it and the storage handed out stay within
    `limit` bytes; the oldest buffers go first."""

    def __init__(self, device: torch.device, limit: int, largest: int) -> None:
        """`largest`: the bytes of the largest group's storage."""
        self.enabled = (device.type == "cpu"
                        and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
        if device.type == "cpu" and not self.enabled:
            log.info("torch %s has no UntypedStorage._swap_data_ptr_: gathered weights are "
                     "allocated afresh each time", torch.__version__)
        self.zeros = ZeroPages(largest) if self.enabled else None
        self.limit = limit
        self._free: list[torch.UntypedStorage] = []  # oldest first
        self._held = 0  # bytes in _free
        self._out = 0  # bytes handed out by `fill`, not yet drained

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Gives the empty `storage` `nbytes` (or more) of memory."""
        if not self.enabled:
            storage.resize_(nbytes)
            return
        fits = [b for b in self._free if nbytes <= b.nbytes() <= 2 * nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.nbytes())
            self._free.remove(buf)
            self._held -= buf.nbytes()
        else:
            buf = torch.UntypedStorage(nbytes)
        self._out += buf.nbytes()
        empty(storage)  # its window of zero pages
        storage._swap_data_ptr_(buf)  # storage takes the memory, buf the empty pointer

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Takes `storage`'s memory back (keeping it while under the limit)."""
        if not self.enabled:
            storage.resize_(0)
            return
        buf = self.vacate(storage)
        self._out = max(0, self._out - buf.nbytes())
        self._free.append(buf)
        self._held += buf.nbytes()
        while self._free and self._held + self._out > self.limit:
            self._held -= self._free.pop(0).nbytes()

    def vacate(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """Takes `storage`'s memory out (returned) and gives it zero pages of its size in
        its place ([Note: freed gathers read zeros]); where that is off, no memory."""
        if self.zeros is None or not storage.nbytes():
            return empty(storage)
        n = storage.nbytes()
        out = self.zeros.storage(n) if n <= self.zeros.nbytes else torch.UntypedStorage(0)
        storage._swap_data_ptr_(out)
        return out

    def disown(self, nbytes: int) -> None:
        """`nbytes` handed out by `fill` stay with a kept tensor ([Note: kept
        weights]), never to come back."""
        self._out = max(0, self._out - nbytes)

    def clear(self) -> None:
        self._free.clear()
        self._held = 0


def borrow(storage: torch.UntypedStorage, record: torch.Tensor) -> None:
    """The empty `storage` takes `record`'s memory, without a copy ([Note: gathered
    weights borrow the record]); the memory stays mapped while `storage` holds it."""
    held = record.detach().view(torch.uint8).numpy()  # shares the bytes, keeps `record`
    empty(storage)  # its window of zero pages
    storage._swap_data_ptr_(torch.frombuffer(held, dtype=torch.uint8).untyped_storage())


def unborrow(storage: torch.UntypedStorage) -> None:
    """A storage that `borrow` filled takes a copy of the record's memory, its own: the
    record's memory is free to go back (a view of the storage is kept, [Note: kept
    weights])."""
    own = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    own.copy_(storage)
    storage._swap_data_ptr_(own)  # `own` now holds the record's memory: dropped


def kept_view(views: list[torch.Tensor], bound: Iterable[tuple[nn.Module, str]] = ()
              ) -> int | None:
    """[Note: kept weights] A module attribute bound inside a unit (`self.saved =
    self.weight` in a forward, a hook's list) may be kept past it, as torch allows;
    freeing the storage under it would leave it reading zeros, or freed memory
    where the storage is resized. The engine asks, once it unbound the views of a
    group's gather, whether one is still referenced; if so, the storage stays with
    it, with its values, and the group's flat tensor takes a fresh one: the memory
    stays allocated, outside the budgets, until the view goes (a warning names the
    parameter once). Autograd's saved views (`x * self.weight` saves the view
    itself) are not counted: C++ holds them, which torch shows as one reference
    to the Python object however many C++ holders there are (while the tensor's
    use count is above one); they read the weights again when the backward
    gathers them. Tensors derived from a view (a slice, `.t()`) are not seen:
    they read zeros ([Note: freed gathers read zeros]).

    `bound`: module attributes that may hold views themselves (a group still bound),
    not counted as holders.

    Returns the index in `views` of one still referenced elsewhere, or None."""
    binds = Counter(id(module.__dict__.get(name)) for module, name in bound)
    i = -1
    for v in views:  # references: `views`, `v`, getrefcount's argument, C++ holders
        i += 1
        if sys.getrefcount(v) - (v._use_count() > 1) - binds[id(v)] > 3:
            return i
    return None


class Borrowing:
    """The bytes of records gathers may borrow at once, and those borrowed now
    ([Note: gathered weights borrow the record])."""

    def __init__(self, device: torch.device, one_rank: bool, spare: int, unit: int) -> None:
        """`spare`: the device budget beyond the minimum working set; `unit`: the
        largest unit's partitions. Borrowing is on for one rank on a CPU device (a torch
        that swaps storage pointers) where `spare` holds one such unit, for as many
        units' bytes at once as it holds (at most three)."""
        units = min(3, spare // unit) if unit > 0 else 0
        on = (one_rank and device.type == "cpu" and units >= 1
              and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
        self.room = units * unit if on else 0
        self.held = 0

    def take(self, nbytes: int) -> bool:
        """True (and counted) if `nbytes` more fit the allowance."""
        if not self.room or self.held + nbytes > self.room:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
