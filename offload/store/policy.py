"""Eviction policies: which copies leave a full tier. The store executes, the policy decides.

When a tier lacks room, the store calls `policy.choose(tier, need_bytes,
candidates)` with every copy it may move out of that tier now (resting, not
pinned, not claimed by another move) and evicts the keys returned, in order:
a clean copy is dropped, a dirty one is written to the next tier down first.
A policy that returns too little leaves the store waiting for in-flight
transfers or failing with `BudgetExceededError`; one that returns a key not
among the candidates is an error. The planner supplies its own policy object
(e.g. "evict what is used furthest in the future"); `LruPolicy` is the default.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

from .record import Tier

__all__ = ["Candidate", "EvictionPolicy", "LruPolicy", "NextUsePolicy"]


@dataclass(frozen=True)
class Candidate:
    """A copy the store can evict from `tier` now."""

    key: Hashable
    kind: str
    nbytes: int      # bytes the eviction frees in the tier (the copy's footprint)
    clean: bool      # True: another tier holds the value, eviction drops without writing


@runtime_checkable
class EvictionPolicy(Protocol):
    """Decides evictions; told about uses. Called under the store's lock: keep it quick,
    and never call back into the store."""

    def touched(self, key: Hashable, tier: Tier) -> None:
        """`key` was used (put, fetched, read or modified) in `tier`."""

    def forgotten(self, key: Hashable) -> None:
        """`key` was freed."""

    def choose(self, tier: Tier, need_bytes: int,
               candidates: Sequence[Candidate]) -> Sequence[Hashable]:
        """Keys to evict from `tier`, in order, to free at least `need_bytes` bytes."""


def _enough(order: Sequence[Candidate], need_bytes: int) -> list[Hashable]:
    """The first keys of `order` that free at least `need_bytes` (all, if they do not)."""
    chosen, freed = [], 0
    for c in order:
        if freed >= need_bytes:
            break
        chosen.append(c.key)
        freed += c.nbytes
    return chosen


class LruPolicy:
    """Least recently used first; among copies used equally long ago, clean ones first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # policies may be shared by several stores
        self._clock = itertools.count()
        self._last: dict[Hashable, int] = {}

    def touched(self, key: Hashable, tier: Tier) -> None:
        with self._lock:
            self._last[key] = next(self._clock)

    def last(self, key: Hashable) -> int:
        """When `key` was last used (a logical clock; -1: never)."""
        return self._last.get(key, -1)

    def forgotten(self, key: Hashable) -> None:
        with self._lock:
            self._last.pop(key, None)

    def choose(self, tier: Tier, need_bytes: int,
               candidates: Sequence[Candidate]) -> list[Hashable]:
        with self._lock:
            order = sorted(candidates, key=lambda c: (self._last.get(c.key, -1), not c.clean))
        return _enough(order, need_bytes)


class NextUsePolicy:
    """Farthest next use first (Belady's choice: the fewest fetches for what the step
    uses next), as a function given by `follow` says: `next_use(key)` is how many
    uses of the step's access trace come before `key` is used again (None: not
    known). Among copies used equally far ahead, clean ones first. Copies of no
    known next use go first (the trace does not use them); while no candidate
    has one (no trace yet, or the step left it), least recently used first, as
    `LruPolicy`."""

    def __init__(self) -> None:
        self._lru = LruPolicy()
        self._next_use: Callable[[Hashable], int | None] | None = None

    def follow(self, next_use: Callable[[Hashable], int | None]) -> None:
        """Ranks candidates by `next_use` from now on (called under the store's lock:
        it must be quick and must not call into the store)."""
        self._next_use = next_use

    def touched(self, key: Hashable, tier: Tier) -> None:
        self._lru.touched(key, tier)

    def forgotten(self, key: Hashable) -> None:
        self._lru.forgotten(key)

    def choose(self, tier: Tier, need_bytes: int,
               candidates: Sequence[Candidate]) -> list[Hashable]:
        fn = self._next_use
        ahead = {c.key: fn(c.key) for c in candidates} if fn is not None else {}
        if not any(d is not None for d in ahead.values()):
            return self._lru.choose(tier, need_bytes, candidates)
        far = float("inf")
        order = sorted(candidates, key=lambda c: (
            -(far if ahead[c.key] is None else ahead[c.key]), not c.clean, self._lru.last(c.key)))
        return _enough(order, need_bytes)
