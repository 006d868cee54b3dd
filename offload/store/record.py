"""One stored partition: its tiers, its residency state and the transitions between states.

[Note: residency]
A partition may hold a copy of its bytes in several tiers at once. `valid` is
the set of tiers whose copy equals the partition's current value; `copies`
maps each tier to the memory the record owns there (a `HostBuffer`, a device
buffer or a `SwapExtent`). A tier is in `copies` and not in `valid` only while
it is the destination of the transfer in flight. The record never keeps a
stale copy: `modify` gives back every other tier's memory at once, so an
extent on disk always holds the current value or is being written with it.

`state` is the top valid tier while nothing is in flight (DEVICE, HOST, NVME),
or the transfer in flight:

    state        valid (top first)        memory in flight
    NVME         {NVME}                   -
    READING      {NVME}                   HOST buffer: destination of an NVMe read
                                          (DEVICE on a CPU device: [Note: CPU device tier])
    HOST         {HOST, [NVME]}           -
    WRITING      {[DEVICE], HOST}         NVME extent: destination of a write
    COPYING_H2D  {HOST, [NVME]}           DEVICE buffer: destination of a copy
    DEVICE       {DEVICE, [HOST], [NVME]} -
    COPYING_D2H  {DEVICE, [NVME]}         HOST buffer: destination of a copy

A record is *dirty* when a single tier holds its value and that tier is not
NVME: dropping that copy needs a write-back first. Otherwise it is clean.

Every transition checks the state it starts from and raises `RuntimeError`
with the values when it is wrong; none of them allocates or frees memory: the
ones that give memory up return it for the caller (the store) to release.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Hashable

import torch

__all__ = ["Tier", "Residency", "PartitionRecord", "RecordInfo", "footprint", "ALIGN"]

ALIGN = 4096  # every copy is a multiple of this many bytes (O_DIRECT, page-aligned buffers)


def footprint(nbytes: int) -> int:
    """Bytes a copy of `nbytes` bytes takes in any tier: rounded up to 4 KiB."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Tier(enum.IntEnum):
    """Where bytes live, fastest first; `lower` is the next tier towards NVMe."""

    DEVICE = 0
    HOST = 1
    NVME = 2

    @property
    def lower(self) -> Tier | None:
        return None if self is Tier.NVME else Tier(self + 1)

    @property
    def upper(self) -> Tier | None:
        return None if self is Tier.DEVICE else Tier(self - 1)

    def __str__(self) -> str:
        return self.name


class Residency(enum.Enum):
    """A record's state: the top valid tier at rest, or the transfer in flight."""

    NVME = "NVME"
    READING = "READING"          # NVME -> HOST (or DEVICE, on a CPU device) in flight
    HOST = "HOST"
    WRITING = "WRITING"          # HOST -> NVME in flight
    COPYING_H2D = "COPYING_H2D"  # HOST -> DEVICE in flight
    DEVICE = "DEVICE"
    COPYING_D2H = "COPYING_D2H"  # DEVICE -> HOST in flight
    FREED = "FREED"

    def __str__(self) -> str:
        return self.value


_RESTING = {Tier.DEVICE: Residency.DEVICE, Tier.HOST: Residency.HOST, Tier.NVME: Residency.NVME}
IN_FLIGHT = frozenset({Residency.READING, Residency.WRITING, Residency.COPYING_H2D,
                       Residency.COPYING_D2H})


@dataclass(frozen=True)
class RecordInfo:
    """A consistent copy of one record's fields, taken under the store's lock.

    `extent` is (logical offset, length) in bytes of the NVMe copy in the swap
    space of `kind`, or None.
    """

    key: Hashable
    kind: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    home: Tier
    state: Residency
    valid: frozenset[Tier]
    held: frozenset[Tier]
    dirty: bool
    pins: int
    busy: bool
    extent: tuple[int, int] | None


class PartitionRecord:
    """The store's bookkeeping of one partition; see [Note: residency].

    Not thread safe: the store mutates records only under its lock.
    """

    __slots__ = ("key", "kind", "dtype", "numel", "nbytes", "home", "state", "valid", "copies",
                 "pins", "claim")

    def __init__(self, key: Hashable, kind: str, dtype: torch.dtype, numel: int,
                 home: Tier) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"partition {key!r}: dtype must be a torch.dtype (e.g. "
                            f"torch.float32), got {dtype!r}")
        try:
            numel = operator.index(numel)
        except TypeError:
            raise TypeError(f"partition {key!r}: numel must be an int, got {numel!r}") from None
        if numel <= 0:
            raise ValueError(f"partition {key!r}: numel must be positive, got {numel}")
        self.key = key
        self.kind = kind
        self.dtype = dtype
        self.numel = numel
        self.nbytes = numel * dtype.itemsize  # bytes of the value; copies take footprint(nbytes)
        self.home = home
        self.state = Residency.FREED  # until `place` gives it its first copy
        self.valid: set[Tier] = set()
        self.copies: dict[Tier, object] = {}
        self.pins = 0
        self.claim: object = None  # the store's move (or modify) owning the record now

    # -- queries --------------------------------------------------------------------
    @property
    def footprint(self) -> int:
        """Bytes one copy takes in any tier."""
        return footprint(self.nbytes)

    @property
    def top(self) -> Tier | None:
        """The fastest tier holding a valid copy, or None (freed)."""
        return min(self.valid) if self.valid else None

    @property
    def dirty(self) -> bool:
        """True when one tier, not NVME, holds the only valid copy."""
        return len(self.valid) == 1 and Tier.NVME not in self.valid

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT

    def info(self) -> RecordInfo:
        ext = self.copies.get(Tier.NVME)
        return RecordInfo(self.key, self.kind, self.dtype, self.numel, self.nbytes, self.home,
                          self.state, frozenset(self.valid), frozenset(self.copies), self.dirty,
                          self.pins, self.claim is not None,
                          (ext.offset, ext.length) if ext is not None else None)

    def __repr__(self) -> str:
        return (f"PartitionRecord({self.key!r}, {self.kind}, {self.dtype}, {self.nbytes} B, "
                f"{self.state}, valid={sorted(t.name for t in self.valid)}, pins={self.pins})")

    # -- checks ---------------------------------------------------------------------
    def _expect(self, *states: Residency) -> None:
        if self.state not in states:
            want = " or ".join(str(s) for s in states)
            raise RuntimeError(f"partition {self.key!r} is {self.state}, expected {want}")

    def _expect_resting(self) -> None:
        if self.state in IN_FLIGHT or self.state is Residency.FREED:
            raise RuntimeError(f"partition {self.key!r} is {self.state}, expected DEVICE, "
                               "HOST or NVME (nothing in flight)")

    def _expect_free_slot(self, tier: Tier) -> None:
        if tier in self.copies:
            raise RuntimeError(f"partition {self.key!r} ({self.state}) already holds memory in "
                               f"{tier}; valid copies: {sorted(t.name for t in self.valid)}")

    def _rest(self) -> None:
        self.state = _RESTING[min(self.valid)]

    # -- transitions -----------------------------------------------------------------
    def place(self, tier: Tier, memory: object) -> None:
        """FREED -> `tier`: the first copy (its bytes were written by `put`)."""
        self._expect(Residency.FREED)
        if self.copies:
            raise RuntimeError(f"partition {self.key!r} is FREED but holds "
                               f"{sorted(t.name for t in self.copies)}")
        self.copies[tier] = memory
        self.valid = {tier}
        self._rest()

    def begin_read(self, buffer: object, to: Tier = Tier.HOST) -> None:
        """NVME -> READING: `buffer` (in `to`: HOST, or DEVICE where the device's memory
        is host memory) is the read's destination."""
        self._expect(Residency.NVME)
        if to is Tier.NVME:
            raise ValueError(f"partition {self.key!r}: a read lands in HOST or DEVICE, not NVME")
        self._expect_free_slot(to)
        self.copies[to] = buffer
        self.state = Residency.READING

    @property
    def reading_into(self) -> Tier:
        """The tier a READING record's read lands in."""
        self._expect(Residency.READING)
        return next(t for t in self.copies if t not in self.valid)

    def finish_read(self) -> None:
        """READING -> HOST (or DEVICE): the read completed and its checksum matched."""
        self.valid.add(self.reading_into)
        self._rest()

    def abort_read(self) -> object:
        """READING -> NVME: the read failed; returns its destination buffer to release."""
        buffer = self.copies.pop(self.reading_into)
        self._rest()
        return buffer

    def begin_write(self, extent: object) -> None:
        """HOST or DEVICE -> WRITING: the HOST copy is written to the new `extent`.

        The HOST copy stays valid (and its buffer held) until the write is
        durable, so a failed write loses nothing.
        """
        self._expect(Residency.HOST, Residency.DEVICE)
        if Tier.HOST not in self.valid:
            raise RuntimeError(f"partition {self.key!r} is {self.state} without a valid HOST "
                               "copy to write from; copy it to HOST first")
        self._expect_free_slot(Tier.NVME)
        self.copies[Tier.NVME] = extent
        self.state = Residency.WRITING

    def finish_write(self) -> None:
        """WRITING -> HOST (or DEVICE): the write is durable; NVME holds a valid copy."""
        self._expect(Residency.WRITING)
        self.valid.add(Tier.NVME)
        self._rest()

    def abort_write(self) -> object:
        """WRITING -> HOST (or DEVICE): the write failed; returns the new extent to free."""
        self._expect(Residency.WRITING)
        extent = self.copies.pop(Tier.NVME)
        self._rest()
        return extent

    def begin_copy(self, to: Tier, buffer: object) -> None:
        """HOST -> COPYING_H2D (`to` DEVICE) or DEVICE -> COPYING_D2H (`to` HOST)."""
        if to is Tier.DEVICE:
            self._expect(Residency.HOST)
            self.state = Residency.COPYING_H2D
        elif to is Tier.HOST:
            self._expect(Residency.DEVICE)
            if Tier.HOST in self.valid:
                raise RuntimeError(f"partition {self.key!r} already has a valid HOST copy")
            self.state = Residency.COPYING_D2H
        else:
            raise ValueError(f"copies go to DEVICE or HOST, not {to}")
        self._expect_free_slot(to)
        self.copies[to] = buffer

    def finish_copy(self) -> None:
        """COPYING_H2D -> DEVICE or COPYING_D2H -> DEVICE: the destination is valid."""
        self._expect(Residency.COPYING_H2D, Residency.COPYING_D2H)
        self.valid.add(Tier.DEVICE if self.state is Residency.COPYING_H2D else Tier.HOST)
        self._rest()

    def abort_copy(self) -> object:
        """Back to the source's state; returns the destination buffer to release."""
        self._expect(Residency.COPYING_H2D, Residency.COPYING_D2H)
        dest = Tier.DEVICE if self.state is Residency.COPYING_H2D else Tier.HOST
        buffer = self.copies.pop(dest)
        self._rest()
        return buffer

    def hand_over(self, to: Tier) -> None:
        """HOST -> DEVICE or DEVICE -> HOST without a copy: the same memory changes tier.

        Only where DEVICE and HOST are one memory (a CPU compute device); see
        [Note: CPU device tier] in copy.py. The source tier stops being valid.
        """
        self._expect_resting()
        src = Tier.HOST if to is Tier.DEVICE else Tier.DEVICE if to is Tier.HOST else None
        if src is None or src not in self.valid:
            raise RuntimeError(f"partition {self.key!r} ({self.state}, valid "
                               f"{sorted(t.name for t in self.valid)}) cannot hand over to {to}")
        self._expect_free_slot(to)
        self.copies[to] = self.copies.pop(src)
        self.valid.discard(src)
        self.valid.add(to)
        self._rest()

    def drop(self, tier: Tier) -> object:
        """Gives up the (clean) copy in `tier`; returns its memory to release.

        Raises when nothing else holds the value: a dirty copy is written back first.
        """
        self._expect_resting()
        if tier not in self.valid or len(self.valid) < 2:
            raise RuntimeError(f"partition {self.key!r} ({self.state}) cannot drop {tier}: "
                               f"valid copies are {sorted(t.name for t in self.valid)}; "
                               "dropping it would lose the value")
        self.valid.discard(tier)
        memory = self.copies.pop(tier)
        self._rest()
        return memory

    def modify(self, tier: Tier) -> dict[Tier, object]:
        """The copy in `tier` becomes the only valid one (it is about to be written).

        Returns the other tiers' memory (now stale) to release.
        """
        self._expect_resting()
        if tier not in self.valid:
            raise RuntimeError(f"partition {self.key!r} is {self.state} and has no valid copy in "
                               f"{tier}; fetch it there first")
        stale = {t: m for t, m in self.copies.items() if t is not tier}
        self.copies = {tier: self.copies[tier]}
        self.valid = {tier}
        self._rest()
        return stale

    def release_all(self) -> dict[Tier, object]:
        """Resting -> FREED; returns all memory to release."""
        self._expect_resting()
        copies, self.copies = self.copies, {}
        self.valid = set()
        self.state = Residency.FREED
        return copies
