"""Facts of this process and machine that every layer reads: the host memory there
is, and whether the calling process is the one that made a resource (a forked child
inherits the parent's objects and their finalizers: [Note: forked children] in
swap.py)."""

from __future__ import annotations

import os
import re
from typing import Any, Callable, NamedTuple

__all__ = ["CgroupMemory", "available_memory", "cgroup_memory", "in_owner", "memory_limit_note",
           "physical_memory", "usable_cpus"]

PROC_SELF = "/proc/self"

# [Note: container memory limits]
# In a container (Docker --memory, a Kubernetes pod's limits.memory, a systemd
# MemoryMax) /proc/meminfo still shows the host's memory: a check against MemAvailable
# alone passes, and the allocation it let through ends with the cgroup's OOM killer
# (SIGKILL, no message). So what a check compares against is the lower of
# MemAvailable and the headroom of the process's memory cgroup and each cgroup above
# it: limit (v2: memory.max; v1: memory.limit_in_bytes) less usage (memory.current;
# memory.usage_in_bytes), where the usage counts file cache, active and inactive, as
# free, since the kernel reclaims it before it kills (as MemAvailable does). memory.high
# is not a limit here: above it the kernel throttles and reclaims, it does not kill.
# The cgroup is found as the kernel shows it, /proc/self/cgroup under the mounts of
# /proc/self/mountinfo, so it works with and without a cgroup namespace; `proc`
# names another directory laid out like /proc/self.


class CgroupMemory(NamedTuple):
    """The tightest memory limit over a process's cgroup and its ancestors."""
    limit: int  # bytes
    free: int   # bytes: the limit less the usage (file cache counted as free)
    file: str   # the file that sets the limit, to name in errors


def _unescape(field: str) -> str:  # mountinfo writes space, tab, newline, \ as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dirs(proc: str, controller: str) -> list[str]:
    """The directories of the process's cgroups that may hold `controller`'s files: the
    v2 one, and the v1 hierarchy that has `controller` mounted; none where the kernel's
    tables cannot be read or parsed (the checks then use the machine's figures)."""
    try:
        return _parse_cgroup_dirs(proc, controller)
    except Exception:  # noqa: BLE001 - a layout not foreseen: no limit known, not an error
        return []


def _parse_cgroup_dirs(proc: str, controller: str) -> list[str]:
    try:  # mount points may hold any bytes: kept as the file system's names
        with open(os.path.join(proc, "cgroup"), errors="surrogateescape") as f:
            lines = f.read().splitlines()
        with open(os.path.join(proc, "mountinfo"), errors="surrogateescape") as f:
            mounts = f.read().splitlines()
    except (OSError, ValueError):
        return []
    paths: dict[str, str] = {}  # "" (v2) or a v1 controller -> cgroup path
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for c in parts[1].split(",") if parts[1] else [""]:
                paths[c] = parts[2]
    dirs = []
    for m in mounts:
        head, sep, tail = m.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if rest[0] == "cgroup2":
            path = paths.get("")
        elif rest[0] == "cgroup" and controller in rest[2].split(","):
            path = paths.get(controller)
        else:
            continue
        if path is None:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else "."
        d = os.path.normpath(os.path.join(point, rel)) if not rel.startswith("..") else point
        while True:  # the cgroup and each one above it, up to the mount's root
            dirs.append(d)
            if d == point or len(d) <= len(point):
                break
            d = os.path.dirname(d)
    return dirs


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None for "max", a missing or unreadable file."""
    try:
        with open(path) as f:
            text = f.read().split()
        return int(text[0]) if text and text[0] != "max" else None
    except (OSError, ValueError):
        return None


def _file_cache(d: str, keys: tuple[str, ...]) -> int:
    """Bytes of page cache the cgroup's memory.stat reports under `keys`: reclaimed
    before the cgroup's OOM killer runs (MemAvailable counts it as available too)."""
    total = 0
    try:
        with open(os.path.join(d, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    total += int(value)
    except (OSError, ValueError):
        pass
    return total


def cgroup_memory(proc: str = PROC_SELF) -> CgroupMemory | None:
    """The memory limit of the process's cgroups ([Note: container memory limits]), or
    None where none is set or none can be read."""
    best: CgroupMemory | None = None
    unlimited = 1 << 60  # v1 writes "no limit" as a page-rounded LONG_MAX
    for d in _cgroup_dirs(proc, "memory"):
        for limit_file, usage_file, cache in (
                ("memory.max", "memory.current", ("inactive_file", "active_file")),
                ("memory.limit_in_bytes", "memory.usage_in_bytes",
                 ("total_inactive_file", "total_active_file"))):
            limit = _read_int(os.path.join(d, limit_file))
            if limit is None or limit >= unlimited:
                continue
            usage = _read_int(os.path.join(d, usage_file)) or 0
            usage = max(0, usage - _file_cache(d, cache))
            free = max(0, limit - usage)
            if best is None or free < best.free:
                best = CgroupMemory(limit, free, os.path.join(d, limit_file))
    return best


def memory_limit_note(proc: str = PROC_SELF) -> str:
    """A clause to end a memory error with, naming the cgroup limit's file and how to
    raise it; empty where no cgroup limits memory."""
    cg = cgroup_memory(proc)
    if cg is None:
        return ""
    from ..config import format_bytes
    return (f" (this process's cgroup limits its memory to {format_bytes(cg.limit)} in "
            f"{cg.file}, {format_bytes(cg.free)} of it free; a container's limit is raised "
            "with docker run --memory or a pod's resources.limits.memory)")


def available_memory(proc: str = PROC_SELF) -> int | None:
    """Bytes of memory this process can allocate now: the lower of MemAvailable and its
    cgroup's headroom ([Note: container memory limits]); None where neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    cg = cgroup_memory(proc)
    return cg.free if cg is not None and (free is None or cg.free < free) else free


def physical_memory(proc: str = PROC_SELF) -> int | None:
    """Bytes of memory this process may use at all (not what is free now): the machine's,
    or its cgroup's limit where that is lower; None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    cg = cgroup_memory(proc)
    return cg.limit if cg is not None and (total is None or cg.limit < total) else total


def usable_cpus(proc: str = PROC_SELF) -> int:
    """CPUs this process may run on: its affinity mask (taskset, a cpuset), lowered to a
    CPU quota where one is set (v2 cpu.max, v1 cpu.cfs_quota_us; Docker --cpus), at
    least 1. Thread counts come from this, not os.cpu_count(), which counts the host's."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    for d in _cgroup_dirs(proc, "cpu"):
        quota = period = None
        try:
            with open(os.path.join(d, "cpu.max")) as f:
                q, p = f.read().split()[:2]
            quota, period = (None if q == "max" else int(q)), int(p)
        except (OSError, ValueError):
            quota = _read_int(os.path.join(d, "cpu.cfs_quota_us"))
            period = _read_int(os.path.join(d, "cpu.cfs_period_us"))
        if quota is not None and quota > 0 and period:
            n = min(n, max(1, -(-quota // period)))  # 1.5 CPUs: 2 threads
    return max(1, n)


def in_owner(pid: int, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` in process `pid` only: the finalizer of a resource (swap files, pinned
    buffers, an AIO context) that process made, which a forked child inherits with the
    object and must leave to the parent ([Note: forked children] in swap.py)."""
    if os.getpid() == pid:
        fn(*args)
