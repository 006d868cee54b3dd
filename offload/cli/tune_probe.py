"""What `offload tune` measures of the machine before it searches: the disk under the
swap directory (read, write and mixed rates for each block size and queue depth,
through offload's I/O engine with O_DIRECT), the host-to-device copy rate, the CPU
Adam rate, and the compute device's matrix-multiply rate at the model's shape."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from ..config import IoConfig
from ..planner import Rates
from .args import missing_directories, remove_directories
from .benchutil import DiskProbe

__all__ = ["DiskRates", "MachineProbe", "probe_adam", "probe_copy", "probe_disk",
           "probe_matmul"]

MiB = 1 << 20
IO_GRID = ((1 * MiB, 8), (1 * MiB, 32), (4 * MiB, 8), (4 * MiB, 32))


@dataclass(frozen=True)
class DiskRates:
    """One (block size, queue depth) of the disk probe, bytes/s."""

    block_size: int
    queue_depth: int
    read_Bps: float
    write_Bps: float
    mixed_Bps: float
    engine: str

    def rates(self) -> Rates:
        return Rates(self.read_Bps, self.write_Bps, self.mixed_Bps)


@dataclass
class MachineProbe:
    """Everything probed (bytes/s, elements/s, FLOP/s; seconds spent)."""

    disk: list[DiskRates]
    disk_free: int
    copy_Bps: float
    adam_eps: float
    flops: float
    seconds: dict[str, float] = field(default_factory=dict)
    adam_eps_by_state: dict[str, float] = field(default_factory=dict)  # compressed moments


def probe_disk(directory: str, nbytes: int, grid=IO_GRID,
               tick: Callable[[], None] | None = None,
               limit: int | None = None) -> list[DiskRates]:
    """Write, read and mixed rates of `nbytes` under `directory` for each (block size,
    queue depth) of `grid`, through offload's I/O engine as the swap traffic goes:
    at least 4 x block size x queue depth bytes, so the queue fills, but at most
    `limit` bytes (a share of the disk's free space). The probe's file lives in a
    folder of its own under `directory`, removed with whatever is in it however the
    probe ends (a full disk, Ctrl-C), as are the directories it creates for it (not
    one that was there before, such as the swap directory itself)."""
    created = missing_directories(directory)
    out = []
    try:
        os.makedirs(directory, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".offload-probe-", dir=directory)
        try:
            for bs, qd in grid:
                size = max(nbytes, 4 * bs * qd)
                if limit is not None:
                    size = max(4096, min(size, limit))
                out.append(_probe_one(scratch, bs, qd, size))
                if tick:
                    tick()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        remove_directories(created)
    return out


def _probe_one(directory: str, bs: int, qd: int, nbytes: int) -> DiskRates:
    probe = DiskProbe(IoConfig(paths=[directory], block_size=bs, queue_depth=qd,
                               buffer_budget=max(bs, IoConfig().buffer_budget)),
                      directory, nbytes)
    try:
        w, r = probe.measure()
        mixed = probe.measure_mixed(bs, max(1, qd // 4), seconds=0.5)
        return DiskRates(bs, qd, r, w, mixed, probe.engine.name)
    finally:
        probe.close()


def probe_copy(device: str, nbytes: int = 64 * MiB) -> float:
    """Host-to-device copy bytes/s from pinned memory; 0 when the device is the CPU (a
    copy up is a hand-over of the same memory)."""
    import torch

    if device == "cpu":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def probe_adam(elems: int = 1 << 22, state_dtype: str = "fp32") -> float:
    """Elements/s of offload's CPU Adam (`CpuAdam.step`, its kernel as configured by
    default) over host state, the moments in `state_dtype`'s form, writing a bf16
    copy as a step does."""
    import torch

    from ..config import OptimConfig
    from ..optim import CpuAdam

    opt = CpuAdam(OptimConfig(state_dtype=state_dtype))
    p, g = torch.randn(elems), torch.randn(elems)
    opt.add_partition("x", p)
    out = torch.empty(elems, dtype=torch.bfloat16)
    times = []
    try:
        for _ in range(7):
            t = time.perf_counter()
            opt.step({"x": g}, params_out={"x": out}, final=True)
            times.append(time.perf_counter() - t)
    finally:
        opt.close()
    return elems / min(times[1:])  # the machine's rate: other load on a shared host is noise


def probe_matmul(rows: int, inner: int, cols: int, dtype: str, device: str) -> float:
    """FLOP/s of a (rows x inner) @ (inner x cols) multiply in the compute dtype on the
    compute device: the shape of the model's largest layer at the batch's positions."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if device == "cpu" and dt == torch.float16:
        dt = torch.float32  # CPU fp16 matmul is not what autocast runs there
    rows, inner, cols = max(rows, 1), max(inner, 1), max(cols, 1)
    a = torch.randn(rows, inner, dtype=dt, device=device)
    b = torch.randn(inner, cols, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times = []
    for _ in range(8):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    return 2.0 * rows * inner * cols / min(times[1:])
