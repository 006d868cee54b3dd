"""One partition's optimizer state, on the host or on NVMe, and its chunk layout.

[Note: NVMe layout]
A partition of `numel` fp32 elements is cut into chunks of `chunk_elems`
elements (the last one shorter). Chunk i of the three kinds is stored as ONE
swap extent holding `[master | exp_avg | exp_avg_sq]` back to back, rounded up
to 4 KiB: 12 bytes per element with fp32 moments, 8 with bf16, ~6 with int8
(codes, then their scales; [Note: compressed moments] in codec.py). Why one extent per chunk rather than one
extent per kind with chunk offsets:
  * a chunk is one read and one write request (12 bytes/element, large and
    sequential) instead of three, and one checksum;
  * `SwapSpace` checksums and addresses whole extents, and the failure rule
    (see [Note: commit after the writes]) needs a fresh extent per chunk write
    anyway: one extent per kind would need a second whole-partition extent per
    kind during the step;
  * an extent table (a list of extents, one per chunk) swaps atomically: the
    partition's version is whichever table it holds.

[Note: commit after the writes]
A step writes every updated chunk to a fresh extent. Only when all of a
partition's writes are done (durable, after fdatasync with io.sync_writes)
does `commit` install the new table, free the old extents and advance `step`.
A failure (a failed write or read, a full disk) before that frees the new
extents and keeps the old table and step: the partition stays at the previous
version, whole. The swap space therefore holds, during a step, the state plus
the chunks written but not yet committed (about one partition).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from ..io import SwapExtent, SwapSpace
from ..store import Tier
from ..planner.sizes import state_bytes
from .codec import QBLOCK, STATE_DTYPES, Moment, StateDtype, moment_views

__all__ = ["ChunkLayout", "PartitionState", "Segment", "Tier", "BYTES_PER_ELEM", "optim_tier",
           "state_bytes"]

BYTES_PER_ELEM = 12  # fp32 master + exp_avg + exp_avg_sq, as stored per chunk


def optim_tier(value: Tier | str) -> Tier:
    """The home of a partition's optimizer state, fixed when the partition is added:
    the store's `Tier.HOST` (host tensors, updated in place) or `Tier.NVME` (per-chunk
    swap extents, streamed through the pipeline's buffers); "host" / "nvme" accepted."""
    try:
        tier = value if isinstance(value, Tier) else Tier[str(value).upper()]
    except KeyError:
        tier = None
    if tier not in (Tier.HOST, Tier.NVME):
        raise ValueError(f"optimizer state lives on 'host' or 'nvme', not {value!r}")
    return tier


@dataclass(frozen=True)
class ChunkLayout:
    """How `numel` elements split into chunks of at most `chunk_elems` elements."""

    numel: int
    chunk_elems: int
    kinds: int = 3  # kinds stored per chunk: 3 with the master, 2 without
    state_dtype: StateDtype = "fp32"  # form of the moments ([Note: compressed moments])

    def __post_init__(self) -> None:
        if self.kinds not in (2, 3):
            raise ValueError(f"chunk layout kinds {self.kinds} must be 2 or 3")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype {self.state_dtype!r} is not one of {STATE_DTYPES}")
        if self.state_dtype == "int8" and self.chunk_elems % QBLOCK:
            raise ValueError(f"chunk_elems {self.chunk_elems} with int8 moments must be a "
                             f"multiple of {QBLOCK} (a chunk holds whole scale blocks)")
        if self.numel < 1 or self.chunk_elems < 1:
            raise ValueError(f"chunk layout needs numel ({self.numel}) and chunk_elems "
                             f"({self.chunk_elems}) >= 1")

    @property
    def n_chunks(self) -> int:
        return -(-self.numel // self.chunk_elems)

    def chunk(self, i: int) -> tuple[int, int]:
        """(first element, elements) of chunk `i`."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range 0..{self.n_chunks - 1}")
        lo = i * self.chunk_elems
        return lo, min(self.chunk_elems, self.numel - lo)

    def chunk_bytes(self, i: int) -> int:
        """Bytes of chunk `i` on NVMe (its kinds back to back, before 4 KiB rounding)."""
        return state_bytes(self.chunk(i)[1], self.kinds, self.state_dtype)


@dataclass(frozen=True)
class Segment:
    """Elements `[lo, lo + n)` of a partition that share a parameter group and an
    update count: one parameter's elements on this rank, or padding. See [Note:
    segments] in optimizer.py."""

    lo: int
    n: int
    group: int = 0


@dataclass(eq=False)
class PartitionState:
    """The optimizer's record of one partition.

    HOST: `host` holds (master, exp_avg, exp_avg_sq): master 1-D fp32, the
    moments `Moment`s in the layout's state_dtype; master is the caller's tensor, updated in place, or None where the master is the caller's
    parameter partition (`layout.kinds == 2`). NVME: `extents[i]` holds chunk i
    (see [Note: NVMe layout]); `host` is None. `step` counts committed updates
    of the partition; `seg_steps[k]` those in which segment k had a gradient
    (the bias correction's step of its parameter, as torch counts it).
    """

    pid: Hashable
    numel: int
    group: int
    tier: Tier
    layout: ChunkLayout
    step: int = 0
    host: tuple[torch.Tensor | None, Moment, Moment] | None = None
    extents: list[SwapExtent] | None = field(default=None, repr=False)
    segments: tuple[Segment, ...] = ()
    seg_steps: list[int] = field(default_factory=list)
    origin: int = 0  # element 0's index in bf16 moments' rounding ([Note: stochastic rounding])

    def __post_init__(self) -> None:
        if not self.segments:
            self.segments = (Segment(0, self.numel, self.group),)
        if not self.seg_steps:
            self.seg_steps = [self.step] * len(self.segments)
        if (self.tier is Tier.HOST) != (self.host is not None):
            raise ValueError(f"partition {self.pid!r}: tier {self.tier.name} with "
                             f"host={'set' if self.host is not None else 'None'}")

    def check_tier(self, tier: Tier) -> None:
        if self.tier is not tier:
            raise RuntimeError(f"partition {self.pid!r} lives on {self.tier.name}, "
                               f"expected {tier.name}")

    def commit(self, swap: SwapSpace, new_extents: list[SwapExtent], step: int) -> None:
        """Installs a fully written extent table at version `step` and frees the old table.

        The caller guarantees every write to `new_extents` is done and that no
        transfer on the old extents is in flight ([Note: commit after the writes]).
        """
        self.check_tier(Tier.NVME)
        if len(new_extents) != self.layout.n_chunks:
            raise RuntimeError(f"partition {self.pid!r}: commit of {len(new_extents)} extents, "
                               f"the layout has {self.layout.n_chunks} chunks")
        old, self.extents = self.extents, new_extents
        self.step = step
        for ext in old or ():
            swap.free(ext)

    @property
    def master_is_param(self) -> bool:
        """The master is the caller's fp32 parameter partition, not kept here."""
        return self.layout.kinds == 2

    @property
    def nvme_bytes(self) -> int:
        """Bytes this partition's state occupies in the swap space (4 KiB-rounded)."""
        return sum(e.length for e in self.extents or ())


def chunk_views(buffer: object, n: int, kinds: int = 3, state_dtype: StateDtype = "fp32"
                ) -> tuple[torch.Tensor | None, Moment, Moment]:
    """(master, exp_avg, exp_avg_sq) views of a chunk of `n` elements in a slot buffer;
    master (fp32) is None in a 2-kind layout."""
    raw = buffer.as_tensor(torch.uint8, state_bytes(n, kinds, state_dtype))
    master = None
    if kinds == 3:
        master, raw = raw[:4 * n].view(torch.float32), raw[4 * n:]
    return (master, *moment_views(raw, state_dtype, n))
