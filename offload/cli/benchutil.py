"""What every benchmark command shares: a scratch directory, its output, the
process counters (peak RSS, storage bytes) read from /proc, and the disk probes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, NamedTuple

from ..config import IoConfig
from ..io.process import available_memory, memory_limit_note

__all__ = ["scratch_dir", "emit", "progress_printer", "vm_hwm", "reset_hwm", "proc_io",
           "swap_rates", "DiskProbe", "forced_param_reads", "check_memory"]


@contextlib.contextmanager
def scratch_dir(path: str | None) -> Iterator[str]:
    """`path`, made where it is missing, or a temporary directory under the current
    one; either way what this made is removed after (`path`'s directories while they
    are empty: the run removes its own files)."""
    if path is not None:
        from .args import UsageError, missing_directories, remove_directories

        made = missing_directories(path)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            remove_directories(made)
            raise UsageError(f"--path: {path!r} cannot be created ({e.strerror}); give "
                             "--path on a writable disk") from None
        try:
            yield path
        finally:
            remove_directories(made)
        return
    try:
        tmp = tempfile.mkdtemp(prefix=".offload-bench-", dir=os.getcwd())
    except OSError as e:
        from .args import UsageError

        raise UsageError(f"--path: not given, and no scratch directory can be made in "
                         f"{os.getcwd()} ({e.strerror}); give --path on a writable disk") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def progress_printer(quiet: bool) -> Callable[[str], None] | None:
    """Progress lines go to stderr (stdout is kept for the table or the JSON)."""
    return None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def emit(result: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> int:
    """Prints `result` as one JSON object or through `render`; returns the exit code."""
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        render(result)
    return 0


def vm_hwm() -> int:
    """Peak resident set size (bytes) since the start or the last `reset_hwm`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def check_memory(prog: str, flag: str, value: str, need: int) -> None:
    """Refuses a run whose arrays need more memory than is available, before it starts:
    one line naming the flag and the fix, exit code 1 (a condition of the machine)."""
    from ..config import format_bytes

    free = available_memory()
    if free is not None and need > free:
        raise SystemExit(f"{prog}: {flag}: {value!r} needs about {format_bytes(need)} of "
                         f"memory, {format_bytes(free)} is available here"
                         f"{memory_limit_note()}; lower {flag}")


def reset_hwm() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where it is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused at the storage layer."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


STEADY_STEPS = 16  # steps `forced_param_reads` runs: the first warms up, the rest count


def forced_param_reads(order: list, sizes: dict, memory: int) -> int:
    """Parameter bytes any system must read per step when `memory` bytes hold what it
    keeps across uses, the records of `sizes` (key -> bytes) used in `order` (a
    step's uses: forward, then backward), in a loop of steps.

    Farthest-next-use eviction byte by byte (a record may stay in part), which is
    optimal for pages of one size, and a byte is such a page, over `STEADY_STEPS`
    steps: the mean of the steps after the first. A use's bytes are asked for one
    after another, which only lowers the figure where a use needs its whole record
    at once. Where each record's uses in the backward mirror the forward's (the
    benchmarks' orders), every step after the first reads 2 x (bytes - memory),
    the fewest any system can: at most `memory` bytes are held as the forward
    starts and as the backward starts. Whole records evicted instead
    (`offload.planner`) read 1.6x that for `bench step`'s nvme placement: the
    figure was then the best schedule's of that partitioning, not any system's.
    Other orders may settle into a cycle of several steps, which the mean over
    the steps follows."""
    uses = list(order) * STEADY_STEPS
    after: dict = {}
    next_use = [0] * len(uses)
    for i in range(len(uses) - 1, -1, -1):
        next_use[i] = after.get(uses[i], len(uses))
        after[uses[i]] = i
    held: dict = {}  # key -> bytes of it in memory
    due: dict = {}  # key -> the index of its next use
    reads = total = 0  # total: bytes held
    for i, key in enumerate(uses):
        if sizes[key] > memory:
            raise ValueError(f"record {key!r} ({sizes[key]} bytes) does not fit "
                             f"{memory} bytes of memory")
        missing = sizes[key] - held.get(key, 0)
        over = total + missing - memory
        for k in sorted((k for k in held if k != key and held[k]), key=lambda k: -due[k]):
            if over <= 0:
                break
            gone = min(over, held[k])
            held[k] -= gone
            over -= gone
            total -= gone
        if i >= len(order):
            reads += missing
        held[key], due[key] = sizes[key], next_use[i]
        total += missing
    return reads // (STEADY_STEPS - 1)


class SwapRates(NamedTuple):
    write_Bps: float
    read_Bps: float
    nbytes: int      # bytes written, then read
    engine: str      # the I/O engine's name
    direct: bool     # O_DIRECT


def swap_rates(io: dict[str, Any], nbytes: int, request: int, grow_step: int,
               name: str) -> SwapRates:
    """Write and read bytes/s and the bytes moved: `nbytes` (at least one request)
    written, then read, through offload's I/O engine and a swap space of its own
    (`io`: the run's io section, so its engine, O_DIRECT and io.sync_writes), in
    `request`-byte transfers, four in flight."""
    from ..io import BufferPool, make_engine, open_swap

    cfg = IoConfig(**{**io, "grow_step": grow_step})
    n = max(1, nbytes // request)
    eng = make_engine(cfg)
    pool = BufferPool(4 * request)
    swap = open_swap(cfg, name, eng)
    bufs = [pool.alloc(request, tag="probe") for _ in range(4)]
    try:
        for b in bufs:
            b.numpy()[:] = 7
        extents = [swap.alloc(request) for _ in range(n)]
        rates = []
        for call in (swap.write, swap.read):
            t = time.perf_counter()
            inflight: list[Any] = []
            for i in range(n):
                if len(inflight) == 4:
                    inflight.pop(0).wait()
                inflight.append(call(extents[i], bufs[i % 4], request))
            for h in inflight:
                h.wait()
            rates.append(n * request / (time.perf_counter() - t))
    finally:
        for b in bufs:
            b.release()
        swap.close()
        pool.close(force=True)
        eng.close()
    return SwapRates(rates[0], rates[1], n * request, eng.name, eng.direct)


class DiskProbe:
    """Times a write and then a read of `nbytes` through offload's I/O engine with
    O_DIRECT (and io.sync_writes, off by default), as the runs' swap traffic goes."""

    def __init__(self, io_cfg: IoConfig, directory: str, nbytes: int) -> None:
        import torch

        from ..io import BufferPool, make_engine

        self.engine = make_engine(io_cfg)
        self.n = max(4096, nbytes // 4096 * 4096)
        self.pool = BufferPool(self.n, pin=None)
        self.buf = self.pool.alloc(self.n, tag="bench-step-disk")
        # incompressible bytes: virtual disks turn zero writes into unmaps (see bench io)
        self.buf.tensor[:] = torch.randint(0, 256, (self.n,), dtype=torch.uint8)
        self.path = os.path.join(directory, "offload-bench-step-disk.dat")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT
                          | (os.O_DIRECT if self.engine.direct else 0), 0o600)
        os.posix_fallocate(self.fd, 0, self.n)

    def measure(self) -> tuple[float, float]:
        """(write, read) bandwidth in bytes/s."""
        t = time.perf_counter()
        self.engine.write(self.fd, self.path, 0, self.buf.address, self.n,
                          keepalive=self.buf).wait()
        w = time.perf_counter() - t
        t = time.perf_counter()
        self.engine.read(self.fd, self.path, 0, self.buf.address, self.n,
                         keepalive=self.buf).wait()
        return self.n / w, self.n / (time.perf_counter() - t)

    def measure_mixed(self, request: int, depth: int, seconds: float) -> float:
        """Bytes/s of reads and writes together: `depth` requests of `request` bytes
        each way kept in flight for `seconds` (reads from the first half of the file,
        writes to the second), the traffic of the optimizer's chunk pipeline."""
        request = max(4096, min(request, self.n // (4 * depth)) // 4096 * 4096)
        half = self.n // 2 // 4096 * 4096  # O_DIRECT offsets: the file may be 4 KiB x odd
        span = half // request * request
        offsets = {"read": 0, "write": 0}
        moved = 0

        def issue(op: str, k: int):
            off = offsets[op]
            offsets[op] = (off + request) % span
            addr = self.buf.address + k * request  # distinct slices of the probe buffer
            if op == "read":
                return self.engine.read(self.fd, self.path, off, addr, request,
                                        keepalive=self.buf)
            return self.engine.write(self.fd, self.path, half + off, addr, request,
                                     keepalive=self.buf)
        inflight = [(op, k, issue(op, k)) for k, op in enumerate(["read", "write"] * depth)]
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            op, k, h = inflight.pop(0)
            h.wait()
            moved += request
            inflight.append((op, k, issue(op, k)))
        elapsed = time.perf_counter() - t0
        for _, _, h in inflight:
            h.wait()
        return moved / elapsed

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.buf.release()
        self.pool.close()
        self.engine.close()
