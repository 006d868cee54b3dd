"""The DEVICE tier's memory and the copies between HOST and DEVICE.

[Note: CPU device tier]
On a host without a GPU the CPU acts as the compute device, and DEVICE and
HOST are the same memory. The DEVICE tier keeps its own budget (so the same
limits and evictions are exercised as on a GPU), but a move between HOST and
DEVICE *hands the buffer over* instead of copying it: the record's HostBuffer
changes tier, HOST's accounting gives its bytes to DEVICE's, and no byte is
copied. A copy would spend memory bandwidth and, for a moment, both budgets on
two identical copies of bytes that live in one RAM, and it would buy nothing:
on CPU there is no faster memory to copy into. The price is that the HOST copy
stops being valid (a later eviction hands it back, again without a copy). The
accounting shows it: such moves count their `bytes` but 0 `copied_bytes` in
`StoreStats.moves["HOST->DEVICE"]` and `["DEVICE->HOST"]`. Since DEVICE
buffers then come from the store's BufferPool, that pool's budget is the HOST
and DEVICE budgets together. For the same reason a fetch from NVMe to DEVICE
reads straight into DEVICE memory (`Step.READ_DEVICE`, counted in
`moves["NVME->DEVICE"]`) instead of reading into HOST and handing over: it
needs room in DEVICE only, where the hand-over needed room in both tiers for
the read's length, and a full HOST tier made the fetch evict a HOST copy that
was not in the way.

[Note: copy streams]
On CUDA, HOST->DEVICE copies run on one dedicated stream and DEVICE->HOST
copies on another, so a prefetch, a write-back and the compute stream overlap
each other. A copy waits for the event its device buffer travels with
(`DeviceBuffer`: recorded on the stream it was allocated on), so a copy started
later from another thread still waits for that allocation. A DEVICE->HOST copy
also waits for the stream the caller computes on (the current stream of the
thread that issues it), so it sees the compute's writes to its source; a
HOST->DEVICE copy does not: its source is host memory, written by the CPU or
by a copy the store has finished, and its destination is a fresh buffer
whose allocation it waits for. A fetch from NVMe takes its DEVICE memory when
it starts and copies once the read is done, from the store's completion
thread (whose current stream is the default one): waiting for that stream
then would hold the copy back behind all the compute queued during the read,
kernels it does not touch.
Each copy then records an event, and the store's completion thread waits for
that event before it marks the destination valid or frees the source. Device buffers are
allocated on the caller's current stream: compute that uses a DEVICE view
should run on that stream (or order itself after it).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..config import ConfigError
from ..io import BufferPool, HostBuffer
from .budget import BudgetExceededError
from .record import footprint

__all__ = ["DeviceBuffer", "DeviceTier", "bind_thread", "rank_gpu", "resolve_device",
           "start_cpu_threads"]


def resolve_device(name: str) -> torch.device:
    """`store.device` as a torch.device: auto is cuda when available, else cpu; a cuda
    device without an index is this rank's GPU (`rank_gpu`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"store.device = {name!r} but CUDA is not available "
                               "(torch.cuda.is_available() is False); use 'auto' or 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", rank_gpu(os.environ.get("LOCAL_RANK"),
                                                torch.cuda.current_device(),
                                                torch.cuda.device_count()))
    elif dev.type != "cpu":
        raise ConfigError(f"store.device {name!r}: only cpu and cuda are supported")
    return dev


def rank_gpu(local_rank: str | None, current: int, count: int) -> int:
    """The GPU of a process whose `store.device` names none.

    [Note: a GPU per rank] torchrun starts one process per GPU and sets LOCAL_RANK,
    but every process's current CUDA device is 0 until something sets it: NCCL then
    finds two ranks on one GPU. A process still on device 0 takes GPU LOCAL_RANK when
    that many are visible; one whose current device was set keeps it, and so does one
    that sees fewer GPUs (CUDA_VISIBLE_DEVICES giving each rank its own GPU, seen as
    0). `initialize` makes the choice the process's current device
    (`torch.cuda.set_device`) before its first collective, and the engine's own
    threads take it too (`bind_thread`)."""
    if current == 0 and local_rank is not None and local_rank.isdigit() and (
            int(local_rank) < count):
        return int(local_rank)
    return current


def bind_thread(device: torch.device) -> None:
    """Makes `device` the calling thread's CUDA device (nothing on a CPU device). A new
    thread starts on GPU 0, where its first CUDA call would make a context on a GPU
    the rank does not use: each engine thread that may touch CUDA calls this first."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


_forked = False  # this process is a fork of one that imported this module


def _in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_in_child)


def start_cpu_threads() -> None:
    """Starts the calling thread's CPU thread pool (OpenMP's team: one per thread that
    runs torch's parallel ops). Left to the first step, a thread the pool could not
    create (an address-space limit, `ulimit -v`, with no room for its stack) ended
    the process there through libgomp's exit(1): no Python unwinding, so swap files
    and locks were left. `initialize` calls this before it makes any (and the update
    thread as it starts); once made, a pool's threads stay. Not in a forked child:
    there a parallel region of a pool the parent had started waits forever (libgomp
    is not fork-safe), and what the child does with torch is its own affair."""
    if not _forked:
        torch.ones(1 << 16).add_(1)  # above at::internal::GRAIN_SIZE: a parallel region


class DeviceBuffer(NamedTuple):
    """CUDA memory of one DEVICE copy and the event after its allocation on `stream`."""

    tensor: torch.Tensor   # uint8, footprint bytes
    ready: torch.cuda.Event


class DeviceTier:
    """Allocates DEVICE memory, gives views of any tier's memory, and moves bytes
    between HOST and DEVICE (copies on CUDA, hand-over on CPU)."""

    def __init__(self, device: torch.device, pool: BufferPool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.hand_over = not self.cuda  # see [Note: CPU device tier]
        self._pool = pool
        if self.cuda:
            # See [Note: copy streams]: one stream per direction.
            self._h2d = torch.cuda.Stream(device)
            self._d2h = torch.cuda.Stream(device)

    def alloc(self, nbytes: int, tag: str) -> HostBuffer | DeviceBuffer:
        """Memory for one DEVICE copy of `nbytes` bytes (the budget is charged by the caller)."""
        if not self.cuda:
            return self._pool.alloc(nbytes, tag=tag)
        try:
            with torch.inference_mode(False):  # as the pool's blocks (offload/io/buffers.py)
                tensor = torch.empty(footprint(nbytes), dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as e:
            # the budget counts partitions only: activations, gathered weights and the
            # allocator's own blocks share the GPU, and a prefetch meeting them skips
            raise BudgetExceededError(
                f"the GPU ran out of memory for {tag} ({nbytes} B) inside "
                "store.device_budget: what else the GPU holds (activations, gathered "
                f"weights) leaves less than the budget; lower store.device_budget ({e})") from e
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return DeviceBuffer(tensor, ready)

    @staticmethod
    def view(memory: HostBuffer | DeviceBuffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D `dtype` tensor of `numel` elements over `memory` (no copy)."""
        if isinstance(memory, DeviceBuffer):
            return memory.tensor[:numel * dtype.itemsize].view(dtype)
        return memory.as_tensor(dtype, numel)

    @staticmethod
    def release(memory: HostBuffer | DeviceBuffer) -> None:
        """Gives DEVICE or HOST memory back (its transfers must be complete)."""
        if isinstance(memory, HostBuffer):
            memory.release()
        # A DeviceBuffer goes back to the caching allocator when its last reference dies.

    def copy_h2d(self, src: HostBuffer, dst: DeviceBuffer, nbytes: int) -> torch.cuda.Event:
        """Starts the copy of `nbytes` host bytes to `dst` on the H2D stream; returns its event."""
        return self._copy(self._h2d, dst.tensor, src.tensor, nbytes, dst.ready,
                          after_compute=False)

    def copy_d2h(self, src: DeviceBuffer, dst: HostBuffer, nbytes: int) -> torch.cuda.Event:
        """Starts the copy of `nbytes` device bytes to `dst` on the D2H stream; returns its
        event."""
        return self._copy(self._d2h, dst.tensor, src.tensor, nbytes, src.ready,
                          after_compute=True)

    def _copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
              nbytes: int, ready: torch.cuda.Event, *, after_compute: bool
              ) -> torch.cuda.Event:
        n = footprint(nbytes)
        # on this device: a stream context entered on a thread still on GPU 0 would put
        # GPU 0's stream back at its exit, making a context there ([Note: a GPU per rank])
        with torch.cuda.device(self.device):
            if after_compute:  # [Note: copy streams]
                stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                dst[:n].copy_(src[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        return done
