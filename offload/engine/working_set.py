"""The least memory a tier must have for a model and placement to train at all.

[Note: minimum working set]
Above these budgets a step only waits for room (the store evicts, and waits
for moves and for other threads' pins); below them some move could never
find room, so `initialize` refuses the budget up front. Gathered full weights
live in the compute device's own allocator, outside the store's budgets; what
the store must hold at once, per rank, is:
  * one parameter partition arriving where it is needed (the largest): a
    gather reads it into DEVICE (through HOST when it comes from NVMe), and an
    update stages its new values (HOST for parameters homed on HOST or NVMe);
    HOST holds one more: a partition that makes room in a full DEVICE (a
    parameter, or a gradient homed there) is written down through HOST while
    the arriving one waits there;
  * while one group is updated, its gradient partition pinned beside it, in
    the gradient's tier (HOST when the home is NVMe), unless updates run early
    (NVMe optimizer state, no clipping, no loss scale, no accumulation: the
    gradient goes straight to the update and is never stored); gradients
    homed on DEVICE stay there from backward to step, so DEVICE holds all;
Everything else a step keeps (cached parameters, staged new versions,
accumulated gradients) can be written one tier down when room is short.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, OffloadConfig, format_bytes
from ..store import footprint
from .units import Group

__all__ = ["WorkingSet", "check_budgets", "working_set"]


@dataclass(frozen=True)
class WorkingSet:
    """Bytes per rank each memory tier needs at least, and why (one line each)."""

    device: int
    host: int
    device_why: str
    host_why: str


def working_set(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype) -> WorkingSet:
    """The minimum working set of DEVICE and HOST ([Note: minimum working set])."""
    e = cfg.engine
    early = (e.optimizer == "nvme" and cfg.optim.max_grad_norm == 0 and e.dtype != "fp16"
             and e.grad_accum_steps == 1)
    trainable = [] if early else [g for g in groups if g.requires_grad]
    param = max((footprint(g.shard * dtype.itemsize) for g in groups), default=0)
    grad = max((footprint(g.shard * 4) for g in trainable), default=0)
    grads_on_device = cfg.engine.grads == "device"
    all_grads = sum(footprint(g.shard * 4) for g in trainable)
    device = param + (all_grads if grads_on_device else 0)
    victim = max(param, grad) if grads_on_device else param
    host = param + victim + (0 if grads_on_device or not trainable else grad)
    p, gr = format_bytes(param), format_bytes(grad)
    return WorkingSet(
        device, host,
        f"the largest parameter partition ({p})" + (
            f" and every gradient partition ({format_bytes(all_grads)})"
            if grads_on_device else ""),
        f"the largest parameter partition ({p}) and the largest partition written "
        f"down from DEVICE ({format_bytes(victim)})" + (
            "" if grads_on_device or not trainable else f" and the largest gradient "
                                                        f"partition ({gr})"))


def check_budgets(cfg: OffloadConfig, groups: list[Group], dtype: torch.dtype) -> WorkingSet:
    """Raises `ConfigError` naming the key, its value and the minimum when a memory
    budget is below the working set; returns the working set."""
    need = working_set(cfg, groups, dtype)
    for key, have, want, why in (
            ("store.device_budget", cfg.store.device_budget, need.device, need.device_why),
            ("store.host_budget", cfg.store.host_budget, need.host, need.host_why)):
        if have < want:
            raise ConfigError(
                f"{key}: {format_bytes(have)} ({have} bytes) is below this model's minimum "
                f"working set of {format_bytes(want)} ({want} bytes) per rank for "
                f"engine.params={cfg.engine.params}, engine.grads={cfg.engine.grads}: it "
                f"must hold {why} at once; raise {key} to at least {want} bytes, or lower "
                "engine.group_size to make partitions smaller")
    return need
