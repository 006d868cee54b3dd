"""What every benchmark command shares: a scratch directory, its output, and the
process counters (peak RSS, storage bytes) read from /proc."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator, NamedTuple

__all__ = ["scratch_dir", "emit", "progress_printer", "vm_hwm", "reset_hwm", "proc_io",
           "swap_rates"]


@contextlib.contextmanager
def scratch_dir(path: str | None) -> Iterator[str]:
    """`path`, or a temporary directory under the current one that is removed after."""
    if path is not None:
        yield path
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
    (`io`: the run's io section, so its engine, O_DIRECT and fdatasync), in
    `request`-byte transfers, four in flight."""
    import time

    from ..config import IoConfig
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
