"""Facts of this process and machine that every layer reads: the host memory there
is, and whether the calling process is the one that made a resource (a forked child
inherits the parent's objects and their finalizers: [Note: forked children] in
swap.py)."""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["available_memory", "in_owner", "physical_memory"]


def available_memory() -> int | None:
    """Bytes of memory the machine can give a new allocation now (MemAvailable), or
    None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def physical_memory() -> int | None:
    """Bytes of the machine's memory (all of it, not what is free now), or None where
    that cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def in_owner(pid: int, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` in process `pid` only: the finalizer of a resource (swap files, pinned
    buffers, an AIO context) that process made, which a forked child inherits with the
    object and must leave to the parent ([Note: forked children] in swap.py)."""
    if os.getpid() == pid:
        fn(*args)
