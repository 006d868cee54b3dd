"""A step's updates of host optimizer state, in place: no previous version kept.

Where every gradient and parameter partition a step updates fits in memory at
once, pinning them all first is the only part that can fail, so the updates
can change the partitions in place and the step needs no staged copies
([Note: all or nothing] in step.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..store import BudgetExceededError

if TYPE_CHECKING:
    from .engine import OffloadEngine

log = logging.getLogger(__name__)

__all__ = ["pin_in_place", "unpin_all", "update_in_place"]


def pin_in_place(engine: OffloadEngine, gids: list[int]) -> list | None:
    """Makes every gradient and parameter partition of `gids` resident and pinned, the
    part of updating in place that can fail; returns the pinned keys for
    `update_in_place`, or None (nothing pinned; no I/O where the budgets alone cannot
    hold them) when they do not all fit in memory at once: the caller then stages
    the updates. Raises (nothing pinned) on another failure."""
    where = {k: engine._grad_where if k[0] == "g" else engine._memory_tier(k)
             for gid in gids for k in (("g", gid), ("p", gid))}
    if not engine.store.could_hold(where):
        return None
    pinned: list = []
    try:
        for key, to in where.items():
            engine.store.fetch(key, to=to, pin=True).wait()
            pinned.append(key)
    except BaseException as e:
        unpin_all(engine, pinned)
        if not isinstance(e, BudgetExceededError):
            raise
        log.debug("step: updates staged, the groups do not fit in memory at once (%s)", e)
        return None
    return pinned


def unpin_all(engine: OffloadEngine, pinned: list) -> None:
    for key in pinned:
        engine.store.unpin(key)


def update_in_place(engine: OffloadEngine, gids: list[int], norm: float | None,
                    pinned: list) -> None:
    """The step's updates of host optimizer state, in place and final, over the
    partitions `pin_in_place` pinned: nothing here can fail, so no previous version
    is kept ([Note: all or nothing]); the caller runs it `uninterrupted`, once every
    rank's step got this far ([Note: ranks agree] in offload/comm/collectives.py)."""
    try:
        scale = engine._grad_divisor
        gpu = engine.device.type != "cpu"
        for gid in gids:
            pkey = ("p", gid)
            engine._update_order.append(gid)
            grad = engine.store.get(("g", gid), engine._grad_where).cpu()
            with engine.store.modify(pkey, engine._memory_tier(pkey)) as p:
                out = torch.empty(p.numel(), dtype=p.dtype) if p.device.type != "cpu" else p
                engine.optimizer.update({gid: grad}, params_out={gid: out}, loss_scale=scale,
                                      grad_norm=norm, found_inf=False, final=True,
                                      active={gid: engine.grad_slots.active(gid)},
                                      schedule_step=engine.global_step)
                if out is not p:  # a GPU-resident partition takes the new values
                    p.copy_(out, non_blocking=gpu)
    finally:
        unpin_all(engine, pinned)
    for gid in gids:
        engine.store.free(("g", gid))
