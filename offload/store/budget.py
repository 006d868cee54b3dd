"""Per-tier byte accounting under hard budgets, transfer counters, and their snapshot.

`Accounting` is the store's ledger: bytes held per tier and per partition kind
(every copy and every reserved transfer destination, at `footprint` size),
bytes moved per direction, and time spent waiting. `charge` refuses to exceed a
budget (it raises; making room is the store's job, before it charges), so the
numbers in a `StoreStats` are never above the budgets. Not thread safe: the
store calls it under its lock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..config import format_bytes
from .record import Tier

__all__ = ["Accounting", "BudgetExceededError", "DirectionStats", "StoreStats", "TierStats"]


class BudgetExceededError(RuntimeError):
    """A tier cannot make room: everything resident is pinned, busy or cannot move down."""


@dataclass(frozen=True)
class TierStats:
    """One tier's occupancy (bytes). `budget` 0 means unlimited (NVME only)."""

    budget: int
    used: int                   # bytes of copies and reserved destinations held now
    peak: int                   # most bytes held at once
    by_kind: dict[str, int]     # `used` split by partition kind
    releasing: int              # bytes that in-flight evictions will give back


@dataclass(frozen=True)
class DirectionStats:
    """Transfers in one direction, e.g. "HOST->NVME"."""

    moves: int = 0              # completed transfers
    bytes: int = 0              # partition bytes moved between tiers
    copied_bytes: int = 0       # bytes actually copied (0 for a hand-over without memcpy)
    seconds: float = 0.0        # summed transfer time (submission to completion)
    failures: int = 0           # transfers that raised


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's accounting; `summary()` is one log line."""

    tiers: dict[str, TierStats]
    moves: dict[str, DirectionStats]
    wait_seconds: float         # seconds callers were blocked (waits on moves and on budget)
    waits: int                  # blocking waits
    evictions: int              # copies the policy chose to evict to make room
    drops: int                  # clean copies given up (another tier held the value)
    writes: int                 # completed writes to NVMe (dirty copies written down)
    partitions: int             # records stored
    by_state: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        tiers = ", ".join(
            f"{name} {format_bytes(t.used)}/{format_bytes(t.budget) if t.budget else 'unlimited'}"
            f" (peak {format_bytes(t.peak)})" for name, t in self.tiers.items())
        moves = ", ".join(
            f"{d} {m.moves} x {format_bytes(m.bytes)}"
            + (f" ({format_bytes(m.copied_bytes)} copied)" if m.copied_bytes != m.bytes else "")
            + (f" {m.bytes / m.seconds / 1e9:.2f} GB/s" if m.seconds and m.copied_bytes else "")
            for d, m in self.moves.items() if m.moves or m.failures) or "none"
        return (f"{self.partitions} partitions; {tiers}; moves: {moves}; waited "
                f"{self.wait_seconds:.3f} s in {self.waits} waits; {self.evictions} evictions, "
                f"{self.drops} drops, {self.writes} writes")


class _TierAccount:
    __slots__ = ("tier", "budget", "used", "peak", "since", "by_kind", "releasing")

    def __init__(self, tier: Tier, budget: int) -> None:
        self.tier = tier
        self.budget = budget  # 0: unlimited
        self.used = 0
        self.peak = 0
        self.since = 0  # the peak since the last take_peaks()
        self.by_kind: dict[str, int] = defaultdict(int)
        self.releasing = 0

    def room(self) -> int:
        """Bytes that fit now (a large number when unlimited)."""
        return (1 << 62) if self.budget == 0 else self.budget - self.used


class Accounting:
    """Bytes held per tier and kind against hard budgets, plus transfer counters."""

    def __init__(self, budgets: dict[Tier, int]) -> None:
        self._tiers = {t: _TierAccount(t, budgets.get(t, 0)) for t in Tier}
        if self._tiers[Tier.DEVICE].budget <= 0 or self._tiers[Tier.HOST].budget <= 0:
            raise ValueError(f"DEVICE and HOST need positive budgets, got {budgets}")
        self._moves: dict[str, list] = {f"{a}->{b}": [0, 0, 0, 0.0, 0] for a, b in
                                        ((Tier.NVME, Tier.HOST), (Tier.NVME, Tier.DEVICE),
                                         (Tier.HOST, Tier.NVME), (Tier.HOST, Tier.DEVICE),
                                         (Tier.DEVICE, Tier.HOST))}
        self.wait_seconds = 0.0
        self.waits = 0
        self.evictions = self.drops = self.writes = 0

    # -- budgets ----------------------------------------------------------------------
    def budget(self, tier: Tier) -> int:
        return self._tiers[tier].budget

    def used(self, tier: Tier) -> int:
        return self._tiers[tier].used

    def room(self, tier: Tier) -> int:
        return self._tiers[tier].room()

    def releasing(self, tier: Tier) -> int:
        return self._tiers[tier].releasing

    def add_releasing(self, tier: Tier, nbytes: int) -> None:
        acct = self._tiers[tier]
        acct.releasing += nbytes
        if acct.releasing < 0:
            raise RuntimeError(f"{tier}: releasing bytes went negative ({acct.releasing})")

    def fits(self, needs: dict[Tier, int]) -> bool:
        return all(n <= self._tiers[t].room() for t, n in needs.items())

    def charge(self, tier: Tier, kind: str, nbytes: int) -> None:
        """Counts `nbytes` more in `tier`; raises rather than exceed its budget."""
        acct = self._tiers[tier]
        if nbytes > acct.room():
            raise RuntimeError(f"{tier} would hold {acct.used + nbytes} bytes, over its budget "
                               f"of {acct.budget} bytes; the store must make room first")
        acct.used += nbytes
        acct.by_kind[kind] += nbytes
        acct.peak = max(acct.peak, acct.used)
        acct.since = max(acct.since, acct.used)

    def refund(self, tier: Tier, kind: str, nbytes: int) -> None:
        acct = self._tiers[tier]
        if nbytes > acct.by_kind.get(kind, 0):
            raise RuntimeError(f"{tier}: refund of {nbytes} bytes of kind {kind!r} but only "
                               f"{acct.by_kind.get(kind, 0)} are held")
        acct.used -= nbytes
        acct.by_kind[kind] -= nbytes
        if not acct.by_kind[kind]:
            del acct.by_kind[kind]

    def take_peaks(self) -> dict[str, int]:
        """The most bytes each tier held since the last call (the start, the first
        time), every charge counted; the next window starts at what each holds now."""
        peaks = {t.name: a.since for t, a in self._tiers.items()}
        for a in self._tiers.values():
            a.since = a.used
        return peaks

    def by_kind(self, tier: Tier) -> dict[str, int]:
        return dict(self._tiers[tier].by_kind)

    # -- counters ---------------------------------------------------------------------
    def moved(self, src: Tier, dst: Tier, nbytes: int, copied: int, seconds: float,
              failed: bool = False) -> None:
        """Counts one transfer `src`->`dst` of `nbytes` (of which `copied` were copied)."""
        m = self._moves[f"{src}->{dst}"]
        if failed:
            m[4] += 1
            return
        m[0] += 1
        m[1] += nbytes
        m[2] += copied
        m[3] += seconds

    def waited(self, seconds: float) -> None:
        self.wait_seconds += seconds
        self.waits += 1

    def snapshot(self, partitions: int, by_state: dict[str, int]) -> StoreStats:
        tiers = {t.name: TierStats(a.budget, a.used, a.peak, dict(a.by_kind), a.releasing)
                 for t, a in self._tiers.items()}
        moves = {d: DirectionStats(*m) for d, m in self._moves.items()}
        return StoreStats(tiers, moves, self.wait_seconds, self.waits, self.evictions,
                          self.drops, self.writes, partitions, by_state)
