"""A step's updates of host optimizer state, in place: no previous version kept.

Where every gradient and parameter partition a step updates fits in memory at
once, pinning them all first is the only part that can fail, so the updates
can change the partitions in place and the step needs no staged copies
([Note: all or nothing] in step.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from ..store import BudgetExceededError
from .step import uninterrupted

if TYPE_CHECKING:
    from .engine import OffloadEngine

log = logging.getLogger(__name__)

__all__ = ["update_in_place"]


def update_in_place(engine: OffloadEngine, gids: list[int], norm: float | None,
                    final: contextlib.ExitStack) -> bool:
    """The step's updates of host optimizer state, in place and final: every gradient
    and parameter partition is made resident and pinned first (what can fail), so
    no previous version is kept ([Note: all or nothing]); from the first update on,
    the step is `uninterrupted` until `final` closes, at its end. False (nothing
    changed; no I/O where the budgets alone cannot hold them) when they do not all
    fit in memory at once: the caller then stages the updates."""
    where = {k: engine._grad_where if k[0] == "g" else engine._memory_tier(k)
             for gid in gids for k in (("g", gid), ("p", gid))}
    if not engine.store.could_hold(where):
        return False
    pinned: list = []
    try:
        for key, to in where.items():
            engine.store.fetch(key, to=to, pin=True).wait()
            pinned.append(key)
    except BaseException as e:
        for key in pinned:
            engine.store.unpin(key)
        if not isinstance(e, BudgetExceededError):
            raise
        log.debug("step: updates staged, the groups do not fit in memory at once (%s)", e)
        return False
    final.enter_context(uninterrupted())
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
        for key in pinned:
            engine.store.unpin(key)
    for gid in gids:
        engine.store.free(("g", gid))
    return True
