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
    HOST;
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
    trainable = [g for g in groups if g.requires_grad]
    param = max((footprint(g.shard * dtype.itemsize) for g in groups), default=0)
    grad = max((footprint(g.shard * 4) for g in trainable), default=0)
    grads_on_device = e.grads == "device"
    all_grads = sum(footprint(g.shard * 4) for g in trainable) if grads_on_device else 0
    pinned_grad = grad if trainable and not early and not grads_on_device else 0
    pair = 2 * param if trainable else 0  # an update's current and new parameters
    victim = max(param, grad) if grads_on_device else param
    # an update on DEVICE makes its room there by writing one partition down through HOST
    gather_host, update_host = param + victim, pinned_grad + (pair if e.params != "device"
                                                              else victim)
    device = max(param, pair if e.params == "device" else 0) + all_grads
    host = max(gather_host, update_host)
    p, gr = format_bytes(param), format_bytes(grad)
    upd = f"an update's current and new parameter partitions (2 x {p})"
    device_why = upd if e.params == "device" and pair > param else f"the largest parameter " \
                                                                  f"partition ({p})"
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
