"""The least memory a tier must have for a model and placement to train at all.

[Note: minimum working set]
Above these budgets a step only waits for room (the store evicts, and waits
for moves and for other threads' pins); below them some move could never
find room, so `initialize` refuses the budget up front. Gathered full weights
live in the compute device's own allocator, outside the store's budgets (with
one rank on a CPU device they are the pinned DEVICE records themselves, where
the device budget has room for three units' partitions beyond this minimum:
[Note: gathered weights borrow the record] in warm.py). What
one thread must hold at once, per rank (threads wait for each other's pins,
so each need must fit on its own):
  * a gather: the largest parameter partition arriving in DEVICE, through
    HOST when it comes from NVMe, while a partition that makes room in a full
    DEVICE (a parameter, or a gradient homed there) is written down through
    HOST; on several ranks with a look-ahead (engine.prefetch_depth), beside
    the next group's partition the look-ahead's all-gather holds in DEVICE
    (the same thread's pin: it cannot wait for it; a budget of one partition
    failed the first backward on two ranks);
  * an update: the group's current parameter partition (pinned: it is the
    master in fp32) and its new version being written, in DEVICE for
    parameters homed there (making room there writes one partition down
    through HOST), else in HOST; and its gradient partition pinned
    beside them, in the gradient's tier (HOST when the home is NVMe), unless
    updates run early (NVMe optimizer state, no clipping, no loss scale, no
    accumulation: the gradient goes straight to the update, never stored);
  * gradients homed on DEVICE stay there from backward to step: all of them.
Everything else a step keeps (cached parameters, staged new versions,
accumulated gradients) can be written one tier down when room is short.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from typing import Iterable

import torch

from ..config import ConfigError, OffloadConfig, format_bytes
from ..files import existing_ancestor
from ..io import SwapPathError
from ..io.process import available_memory, memory_limit_note
from ..optim import resolve_chunk_elems
from ..planner.sizes import keeps_master, moment_bytes, nvme_state_bytes
from ..store import footprint
from ..store.copy import resolve_device
from .grads import _DTYPES
from .units import Group

log = logging.getLogger(__name__)

__all__ = ["DiskShare", "WorkingSet", "check_budgets", "check_disk", "check_memory",
           "disk_share", "memory_bytes_placed", "nvme_bytes_placed", "this_host",
           "working_set"]


@dataclass(frozen=True)
class WorkingSet:
    """Bytes per rank each memory tier needs at least, and why (one line each)."""

    device: int
    host: int
    device_why: str
    host_why: str


def _early_updates(cfg: OffloadConfig) -> bool:
    """Whether a group's update may run as soon as its gradient is reduced, the gradient
    never stored ([Note: early update] in updates.py)."""
    e = cfg.engine
    return (e.optimizer == "nvme" and cfg.optim.max_grad_norm == 0 and e.dtype != "fp16"
            and e.grad_accum_steps == 1)


def working_set(cfg: OffloadConfig, groups: list[Group],
                dtype: torch.dtype | None = None) -> WorkingSet:
    """The minimum working set of DEVICE and HOST ([Note: minimum working set]); `dtype`:
    the compute dtype (default: engine.dtype's)."""
    dtype = dtype or _DTYPES[cfg.engine.dtype]
    e = cfg.engine
    early = _early_updates(cfg)
    trainable = [g for g in groups if g.requires_grad]
    param = max((footprint(g.shard * dtype.itemsize) for g in groups), default=0)
    grad = max((footprint(g.shard * 4) for g in trainable), default=0)
    grads_on_device = e.grads == "device"
    all_grads = sum(footprint(g.shard * 4) for g in trainable) if grads_on_device else 0
    pinned_grad = grad if trainable and not early and not grads_on_device else 0
    pair = 2 * param if trainable else 0  # an update's current and new parameters
    victim = max(param, grad) if grads_on_device else param
    world = groups[0].world if groups else 1
    ahead = param if world > 1 and e.prefetch_depth > 0 else 0  # a look-ahead's all-gather
    # an update on DEVICE makes its room there by writing one partition down through HOST
    gather_host, update_host = param + victim, pinned_grad + (pair if e.params != "device"
                                                              else victim)
    device = max(param + ahead, pair if e.params == "device" else 0) + all_grads
    host = max(gather_host, update_host)
    p, gr = format_bytes(param), format_bytes(grad)
    upd = f"an update's current and new parameter partitions (2 x {p})"
    device_why = upd if e.params == "device" and pair > param + ahead else (
        f"the largest parameter partition ({p})" + (
            f" and the next group's, which the look-ahead all-gather across ranks holds "
            f"({p})" if ahead else ""))
    if all_grads:
        device_why += f" and every gradient partition ({format_bytes(all_grads)})"
    if update_host > gather_host:
        host_why = (upd if e.params != "device" else f"a partition written down from DEVICE "
                    f"({format_bytes(victim)})") + (
            f" and the gradient partition pinned beside the update ({gr})" if pinned_grad
            else "")
    else:
        host_why = (f"the largest parameter partition arriving ({p}) and one written down "
                    f"from DEVICE ({format_bytes(victim)})")
    return WorkingSet(device, host, device_why, host_why)


def check_budgets(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype) -> WorkingSet:
    """Raises `ConfigError` naming the key, its value and the minimum when a memory
    budget is below the working set, or when the optimizer's NVMe chunk buffers do
    not fit `io.buffer_budget`; returns the working set."""
    if cfg.engine.optimizer == "nvme":
        resolve_chunk_elems(cfg.optim, cfg.io.buffer_budget, keeps_master(
            cfg.engine.dtype, cfg.engine.params, resolve_device(cfg.store.device).type))
    need = working_set(cfg, groups, dtype)
    largest = max(groups, key=lambda g: g.shard, default=None)
    big = max(largest.slots, key=lambda t: t.numel) if largest is not None else None
    smaller = ("lower engine.group_size to make partitions smaller"
               if big is None or big.numel < 0.9 * largest.numel else
               f"run on more ranks: the largest partition is mostly one parameter "
               f"({big.fqn}), which no engine.group_size splits")
    for key, have, want, why in (
            ("store.device_budget", cfg.store.device_budget, need.device, need.device_why),
            ("store.host_budget", cfg.store.host_budget, need.host, need.host_why)):
        if have < want:
            raise ConfigError(
                f"{key}: {format_bytes(have)} ({have} bytes) is below this model's minimum "
                f"working set of {format_bytes(want, up=True)} ({want} bytes) per rank for "
                f"engine.params={cfg.engine.params}, engine.grads={cfg.engine.grads}: it "
                f"must hold {why} at once; raise {key} to at least {want} bytes, or "
                f"{smaller}")
    return need


def memory_bytes_placed(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype,
                        device_type: str) -> dict[str, int]:
    """Bytes per rank of training state that `initialize` puts in this machine's memory
    and keeps there, by where (a lower bound of what training holds in memory): the
    host optimizer's moments (and its fp32 masters where they are apart), which no
    budget covers, and the parameter partitions of engine.params "host" (or "device"
    on a CPU device) up to that tier's budget, beyond which the store writes them to
    NVMe."""
    out: dict[str, int] = {}
    params = sum(footprint(g.shard * dtype.itemsize) for g in groups)
    if cfg.engine.params == "host":
        out["engine.params = \"host\" (up to store.host_budget)"] = min(
            params, cfg.store.host_budget)
    elif cfg.engine.params == "device" and device_type == "cpu":
        out["engine.params = \"device\" (up to store.device_budget)"] = min(
            params, cfg.store.device_budget)
    if cfg.engine.optimizer == "host":
        master = keeps_master(cfg.engine.dtype, cfg.engine.params, device_type)
        out["engine.optimizer = \"host\""] = sum(
            moment_bytes(cfg.optim.state_dtype, g.shard) + (4 * g.shard if master else 0)
            for g in groups if g.requires_grad)
    return {k: v for k, v in out.items() if v}


def check_memory(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype) -> None:
    """Refuses, before anything is placed, a placement whose state in memory
    (`memory_bytes_placed`, times the ranks the launcher started on this machine)
    exceeds the memory available now, a container's limit included ([Note: container
    memory limits] in offload/io/process.py): it would end in the OOM killer part way
    through `initialize` or the first step, with no message."""
    free = available_memory()
    placed = memory_bytes_placed(cfg, groups, dtype, resolve_device(cfg.store.device).type)
    ranks = _ranks_from_launcher()
    need = sum(placed.values()) * ranks
    if free is None or need <= free:
        return
    parts = ", ".join(f"{format_bytes(v)} for {k}" for k, v in placed.items())
    per = f" per rank, x {ranks} ranks on this machine" if ranks > 1 else ""
    raise ConfigError(
        f"this placement keeps {format_bytes(need)} of training state in memory ({parts}"
        f"{per}), more than the {format_bytes(free)} available now{memory_limit_note()}; "
        "nothing was placed. Lower store.host_budget (parameters beyond it go to NVMe), put "
        "the optimizer state on NVMe (engine.optimizer = \"nvme\", or optim.state_dtype "
        "\"bf16\" or \"int8\" to shrink it), or free memory")


def nvme_bytes_placed(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype,
                      device_type: str) -> dict[str, int]:
    """Bytes per rank that `initialize` writes to NVMe, by swap space ("param",
    "optim"): parameter partitions where engine.params is nvme, moments (and fp32
    masters where they are apart) where engine.optimizer is, each partition's state in
    the optimizer's 4 KiB-rounded chunks."""
    out: dict[str, int] = {}
    if cfg.engine.params == "nvme":
        out["param"] = sum(footprint(g.shard * dtype.itemsize) for g in groups)
    if cfg.engine.optimizer == "nvme":
        out["optim"] = sum(_optim_state(cfg, groups, device_type))
    return {k: v for k, v in out.items() if v}


def _optim_state(cfg: OffloadConfig, groups: list[Group], device_type: str) -> list[int]:
    """Bytes of each trainable group's optimizer state per rank on NVMe: its moments,
    and its fp32 master where that is apart from the parameter, in the optimizer's
    chunks, each a 4 KiB-rounded extent (`nvme_state_bytes`)."""
    master = keeps_master(cfg.engine.dtype, cfg.engine.params, device_type)
    chunk = resolve_chunk_elems(cfg.optim, cfg.io.buffer_budget, master)
    return [nvme_state_bytes(g.shard, master, cfg.optim.state_dtype, chunk)
            for g in groups if g.requires_grad]


@dataclass(frozen=True)
class DiskShare:
    """What one rank places on the file systems of its `io.paths` at `initialize`.

    `host`: the kernel the rank runs on (its boot id: the same in every container of
    one machine, different on another; the host name where there is none).
    `placed`: per `io.paths` entry, (the `st_dev` of its file system, bytes placed
    there): the rank's NVMe state striped evenly over its paths."""

    host: str
    placed: tuple[tuple[int, int], ...]


def this_host() -> str:
    """The kernel this process runs on: its boot id (the same in every container of
    one machine, different on another), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def disk_share(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype) -> DiskShare:
    """This rank's `DiskShare`: bytes `nvme_bytes_placed` puts in each `io.paths` entry,
    in the whole stripes its swap files take there ([Note: swap files grow by whole
    stripes])."""
    placed = nvme_bytes_placed(cfg, groups, dtype, resolve_device(cfg.store.device).type)
    share = _striped(cfg, placed.values())
    return DiskShare(this_host(), tuple((os.stat(existing_ancestor(p)).st_dev, share)
                                         for p in cfg.io.paths))


def _striped(cfg: OffloadConfig, kinds: Iterable[int]) -> int:
    """[Note: swap files grow by whole stripes]
    Bytes each `io.paths` entry takes for swap files holding `kinds` bytes (one file per
    kind of state, striped over the paths). A swap file grows by whole rows of
    io.stripe_size on every path (by io.grow_step where that leaves room, by only what
    it needs where not: [Note: growth on a nearly full disk] in offload/io/swap.py), so
    a few KiB of state take a whole stripe (1 MiB by default) on each path: a disk
    with room for the KiB but not for the stripe passed the free-space check, and
    the rank failed while placing its partitions."""
    row = cfg.io.stripe_size * len(cfg.io.paths)
    return sum(-(-n // row) for n in kinds if n) * cfg.io.stripe_size


def _ranks_from_launcher() -> int:
    """Ranks on this node as the launcher says (torchrun, Open MPI), else 1."""
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        try:
            return max(1, int(os.environ.get(var, "")))
        except ValueError:
            continue
    return 1


def _demand(me: DiskShare, i: int, peers: list[DiskShare] | None) -> tuple[int, int]:
    """(bytes placed at `initialize` on the file system of this rank's io.paths[i], by
    how many ranks). [Note: ranks sharing a disk]"""
    dev, share = me.placed[i]
    if peers is None:  # this rank's paths on that file system together, each rank alike
        ranks = _ranks_from_launcher()
        return sum(b for d, b in me.placed if d == dev) * ranks, ranks
    here = [[b for d, b in p.placed if d == dev and b] for p in peers if p.host == me.host]
    return sum(map(sum, here)), max(1, sum(1 for parts in here if parts))


def check_disk(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype,
               peers: list[DiskShare] | None = None) -> None:
    """Refuses, before any file is made, a placement whose NVMe state at `initialize`
    cannot fit `store.nvme_budget`, `io.max_swap_size` (per swap space) or the free
    space of each `io.paths` directory (its share of the stripes, and every other
    rank's on the same file system); warns where a step's second version of it may
    not fit ([Note: all or nothing] in step.py).

    `peers`: every rank's `DiskShare` (this one's included), gathered by
    `initialize` where the job has several ranks; None: one rank.

    [Note: ranks sharing a disk]
    Ranks of one machine may swap to one file system (one directory, or one
    directory each on the same disk), or each to its own disk (one NVMe drive per
    GPU). With `peers`, the state on a file system is what every rank on this
    kernel (boot id) places on that `st_dev`, whatever launched them (torchrun,
    torch.multiprocessing, srun, mpirun) and whether or not they share a disk. With
    one rank in the process group (or none), this process may still be one of
    several on the node that a launcher started to train apart: LOCAL_WORLD_SIZE
    (torchrun), else OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI), else 1, counted as
    sharing every path. Containers on one machine with their own overlay file
    systems have distinct `st_dev`s and are counted apart."""
    device_type = resolve_device(cfg.store.device).type
    placed = nvme_bytes_placed(cfg, groups, dtype, device_type)
    total = sum(placed.values())
    # in a step also the optimizer state's new version beside the old ([Note: all or
    # nothing] in step.py) and the gradients homed on NVMe: the budget's ledger counts both
    kinds = {**placed, "optim": 2 * placed.get("optim", 0)}  # by swap space
    if cfg.engine.grads == "nvme" and not _early_updates(cfg):
        kinds["grad"] = sum(footprint(g.shard * 4) for g in groups if g.requires_grad)
    step = sum(kinds.values())
    if not step:
        return
    how = ("keep less on NVMe (engine.params, engine.grads or engine.optimizer \"host\", "
           "or optim.state_dtype \"bf16\" or \"int8\")")
    if cfg.store.nvme_budget and step > cfg.store.nvme_budget:
        raise ConfigError(
            f"store.nvme_budget: {format_bytes(cfg.store.nvme_budget)} is below the "
            f"{format_bytes(step)} ({step} bytes) per rank this model keeps on NVMe during "
            f"a step ({format_bytes(total)} of state placed at initialize, the optimizer "
            "state's new version beside the old while a step is open, gradients homed on "
            f"NVMe); raise it to at least {step} bytes (0: no limit), or {how}")
    # the limit is each kind's swap space (over io.paths): the optimizer's holds both
    # versions, and its freed extents are holes a later chunk may not fit (one
    # partition's worth)
    files = {**kinds, "optim": kinds["optim"] + max(_optim_state(cfg, groups, device_type),
                                                    default=0) if kinds["optim"] else 0}
    kind, n = max(files.items(), key=lambda kv: kv[1])
    if cfg.io.max_swap_size and n > cfg.io.max_swap_size:
        raise ConfigError(
            f"io.max_swap_size: {format_bytes(cfg.io.max_swap_size)} is below the "
            f"{format_bytes(n)} ({n} bytes) of {kind} state per rank this model keeps "
            f"on NVMe during a step{' (both versions)' if kind == 'optim' else ''}; raise "
            f"it to at least {n} bytes (0: no limit), or {how}")
    me = disk_share(cfg, groups, dtype)
    for i, path in enumerate(cfg.io.paths):
        usage = shutil.disk_usage(existing_ancestor(path))
        if not usage.total:  # no size reported (ramfs): nothing to judge it by
            continue
        free = usage.free
        need, ranks = _demand(me, i, peers)
        if free < need:
            # the state itself, where whole stripes are what does not fit
            raw = -(-total // len(cfg.io.paths))
            stripes = (f"; swap files grow by whole stripes of io.stripe_size, "
                       f"{format_bytes(cfg.io.stripe_size)} on each path, so this rank's "
                       f"{format_bytes(raw)} of state take {format_bytes(me.placed[i][1])} "
                       "here" if me.placed[i][1] > raw else "")
            lower = "lower io.stripe_size, " if stripes else ""
            raise SwapPathError(
                errno.ENOSPC,
                f"io.paths[{i}]: {path} has {format_bytes(free)} free, and this model places "
                f"at least {format_bytes(need)} of state on NVMe on its file system ({ranks} "
                f"rank(s) of this node write there{stripes}); free disk space, add a "
                f"directory on another disk to io.paths, {lower}or {how}", path)
        if free < 2 * need:
            log.warning(
                "io.paths[%d]: %s has %s free for %s of NVMe state (%d rank(s) of this node): "
                "a step keeps the previous version of what it updates until it commits, so a "
                "step may fail for want of space (the state stays as it was)", i, path,
                format_bytes(free), format_bytes(need), ranks)
