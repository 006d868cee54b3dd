"""Block I/O to files: Linux AIO and thread-pool engines, an aligned (pinned
with CUDA) host buffer pool, and striped, locked, checksummed swap files."""

from __future__ import annotations

import logging

from ..config import ConfigError, IoConfig
from ..trace import NULL_RECORDER, TraceRecorder
from . import hugepages
from .buffers import BufferPool, HostBuffer, host_copy
from .engine import AioEngine, IoEngine, Segment, ThreadEngine, libaio_status
from .errors import (AioSetupError, CorruptionError, IoError, PoolExhaustedError, SwapFullError,
                     SwapLockedError, SwapPathError)
from .extents import Extent, ExtentAllocator
from .handle import IoHandle, gather
from .paths import SwapDir, check_swap_dirs, probe_direct
from .swap import ReadHandle, SwapExtent, SwapSpace
from .switch import SwitchIntervalHold, hold_switch_interval

log = logging.getLogger(__name__)

__all__ = [
    "AioEngine", "AioSetupError", "BufferPool", "CorruptionError", "Extent", "ExtentAllocator",
    "HostBuffer", "IoEngine", "IoError", "IoHandle", "PoolExhaustedError", "ReadHandle", "Segment",
    "SwapDir", "SwapExtent", "SwapFullError", "SwapLockedError", "SwapPathError", "SwapSpace",
    "SwitchIntervalHold", "ThreadEngine", "check_swap_dirs", "gather", "hold_switch_interval",
    "host_copy", "libaio_status", "make_engine", "open_swap", "probe_direct",
]


def choose_engine(cfg: IoConfig) -> tuple[str, bool, str]:
    """(engine name, use O_DIRECT, why) for `cfg` on this machine's paths.

    Checks the swap directories first (offload/io/paths.py): a path that cannot
    hold swap files raises `SwapPathError` before anything else is made."""
    direct_ok, direct_why = True, "O_DIRECT accepted"
    for d in check_swap_dirs(cfg.paths, direct=cfg.direct):
        if cfg.direct and not d.direct:
            direct_ok, direct_why = False, d.why
            break
    aio_ok, aio_why = libaio_status()
    if cfg.engine == "aio":
        if not aio_ok:
            raise ConfigError(f"io.engine = 'aio' but {aio_why}; or set io.engine = 'threads'")
        if cfg.direct and not direct_ok:
            raise ConfigError(f"io.engine = 'aio' needs O_DIRECT but {direct_why}; point io.paths "
                              "at a disk-backed file system, or set io.direct = false")
        return "aio", cfg.direct, "io.engine = 'aio'"
    if cfg.engine == "threads":
        if cfg.direct and not direct_ok:
            raise ConfigError(f"io.direct = true but {direct_why}; point io.paths at a "
                              "disk-backed file system, or set io.direct = false")
        return "threads", cfg.direct, "io.engine = 'threads'"
    if not aio_ok:
        return "threads", cfg.direct and direct_ok, f"auto: {aio_why}; using the thread engine"
    if not cfg.direct:
        return "threads", False, "auto: io.direct = false, and Linux AIO is only " \
            "asynchronous with O_DIRECT; using the thread engine"
    if not direct_ok:
        return "threads", False, f"auto: {direct_why}; using the thread engine with buffered I/O"
    return "aio", True, "auto: libaio loaded and O_DIRECT accepted; using Linux AIO"


def make_engine(cfg: IoConfig, recorder: TraceRecorder = NULL_RECORDER) -> IoEngine:
    """Builds the engine `cfg.engine` asks for; `auto` logs why it chose what it chose."""
    name, direct, why = choose_engine(cfg)
    fell_back = cfg.engine == "auto" and name == "threads"
    log.log(logging.WARNING if fell_back else logging.INFO, why)
    kw = dict(block_size=cfg.block_size, queue_depth=cfg.queue_depth,
              sync_writes=cfg.sync_writes, direct=direct, recorder=recorder)
    if name == "aio":
        try:
            return AioEngine(**kw)
        except AioSetupError as e:
            if cfg.engine != "auto":
                raise
            log.warning("auto: %s; using the thread engine", e)
    return ThreadEngine(threads=cfg.threads, **kw)


def open_swap(cfg: IoConfig, name: str, engine: IoEngine) -> SwapSpace:
    """Opens the swap files `offload-<name>.swap` under every `cfg.paths` directory."""
    return SwapSpace(cfg.paths, name, engine, stripe_size=cfg.stripe_size,
                     grow_step=cfg.grow_step, max_size=cfg.max_swap_size, checksum=cfg.checksum)
