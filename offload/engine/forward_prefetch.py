"""Prefetch for forward passes without autograd (evaluation, each token of `generate`).

[Note: forward-only prefetch]
Such a pass is no part of a training step: it neither records into the access
trace nor follows the plan (whose position belongs to the step). It still
streams: when a unit starts, the parameter partitions of the units declared
after it (module order, which is the order of execution for sequential models
such as transformers' stacks), up to `engine.prefetch_depth` groups, start
moving towards DEVICE, so their NVMe reads run behind this unit's compute. Only
store fetches: no all-gather starts ahead (ranks must issue those in one
order), and a fetch that finds no room is skipped, the use then fetching on
demand. A guess that proves wrong costs bandwidth, never correctness.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable

from ..store import BudgetExceededError, Tier, TieredStore
from .units import Unit

log = logging.getLogger(__name__)

__all__ = ["ForwardOnlyPrefetch", "arriving"]


def arriving(store: TieredStore, key: Hashable) -> bool:
    """True where `key` is valid in DEVICE or has a move in flight (on its way): a
    prefetch of it has nothing to start, and must not wait for the move."""
    info = store.info(key)
    return info.busy or Tier.DEVICE in info.valid


class ForwardOnlyPrefetch:
    """The groups to fetch ahead when each unit starts a forward-only pass."""

    def __init__(self, units: list[Unit], store: TieredStore, depth: int) -> None:
        self._store = store
        self._ahead: dict[int, list[int]] = {}
        for i, unit in enumerate(units):
            ahead: list[int] = []
            for later in units[i + 1:]:
                for gid in later.needs:
                    if gid not in ahead and gid not in unit.needs and len(ahead) < depth:
                        ahead.append(gid)
                if len(ahead) >= depth:
                    break
            self._ahead[id(unit)] = ahead

    def started(self, unit: Unit, busy: Callable[[int], bool]) -> None:
        """`unit` starts a forward-only pass: fetches the groups after it that are not
        `busy` (gathered or being gathered)."""
        for gid in self._ahead.get(id(unit), ()):
            key = ("p", gid)
            if busy(gid):
                continue
            if arriving(self._store, key):  # no waiting
                continue
            try:
                self._store.fetch(key, to=Tier.DEVICE)
            except BudgetExceededError as e:  # no room now: the use fetches on demand
                log.debug("forward-only prefetch of group %d skipped: %s", gid, e)
                return
