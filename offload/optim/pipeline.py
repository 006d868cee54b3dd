"""Streams NVMe-resident optimizer state through a fixed ring of host buffers.

The step reads plainly, FlexGen style: `load(j+1); compute(j); store(j); ...`
over the chunks of all NVMe partitions of the step, in order, crossing
partition boundaries without a bubble. Each of `buffers` slots is one
BufferPool buffer holding a chunk's `[master | exp_avg | exp_avg_sq]` (the
moments as `codec.Moment`s in the partition's state_dtype)
([Note: NVMe layout] in state.py); slots are allocated once, on first use,
and kept until `close()`: nothing is allocated per chunk.

[Note: slot reuse]
A slot is idle when it holds no read and its last write is *released* (the
bytes left the buffer; durability may follow). Before the read of chunk j+1
takes a slot, the oldest write is waited for only if no slot is idle:
  * 1 buffer: read j, update j, write j, wait, read j+1 (no overlap);
  * 2 buffers: the read of j+1 overlaps the update of j; the write of j-1
    must have left its buffer first;
  * 3 buffers: read j+1, update j and write j-1 all overlap;
  * more: reads run further ahead while idle slots exist.
Nothing is committed by `run`: see [Note: the round commits as a whole].

[Note: the round commits as a whole]
`run` writes every updated chunk to a fresh extent and keeps the partition's
rewrite pending: the partition keeps its committed extent table and `step`,
so every read (`read_state`) sees the committed version and a failure leaves
it whole. `commit()` waits for every pending write and, only when all of them
succeeded, installs every new table at `step + 1` and frees the old extents:
no I/O happens while tables are switched, so the switch cannot fail half way.
`rollback()` (or a failed `commit`) frees the fresh extents instead. A caller
updating partitions one call at a time (the engine's early updates during
backward) keeps the disk busy across the boundary between one partition and
the next, and commits once at the end of the step. The swap space holds, at
the end of a round, the committed state plus the rewritten one.

[Note: a read ahead that failed]
A read an earlier call started ahead (`prefetch()` after a step's commit, a
`run`'s read of its `then`) that failed was the failure of whatever call took
it next: a `state_dict()` after a good step raised the read-ahead's I/O error
once, and the next call worked. Such a read is read again, once, where it is
taken: a failure that persists is that call's; one that passed costs a read.
A read the taking call started itself is not: its failure is the call's (the
optimizer's step starts its first reads by `prefetch()`, a call of its own,
so a failure of those gets its second read too).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import torch

from ..io import BufferPool, IoError, IoHandle, SwapExtent, SwapSpace
from ..trace import NULL_RECORDER, TraceRecorder
from .codec import Moment
from .state import BYTES_PER_ELEM, PartitionState, Tier, chunk_views

log = logging.getLogger(__name__)

__all__ = ["OptimStepError", "SwapPipeline"]

Key = tuple[Hashable, int]  # (partition id, chunk index)
ChunkFn = Callable[[PartitionState, int, int, int, torch.Tensor, Moment, Moment],
                   None]  # (partition, chunk, first element, elements, master, exp_avg, exp_avg_sq)


class OptimStepError(RuntimeError):
    """A round of updates failed; every partition is whole at one version.

    `unchanged`: partitions left at their previous (committed) state and step:
    every partition of the failed round whose previous version was kept.
    `updated`: partitions whose update stays in place although the round
    failed: only those the caller updated with `final=True` (no previous
    version kept; see `CpuAdam.update`). The cause (e.g. the `IoError` of a
    failed write) is `__cause__`. `grad_norm` is the norm the round used.
    """

    def __init__(self, message: str, updated: list[Hashable], unchanged: list[Hashable],
                 grad_norm: float | None = None) -> None:
        super().__init__(message)
        self.updated = updated
        self.unchanged = unchanged
        self.grad_norm = grad_norm


def _views(slot: "_Slot", part: PartitionState, n: int) -> tuple:
    return chunk_views(slot.buffer, n, part.layout.kinds, part.layout.state_dtype)


class _Slot:
    __slots__ = ("buffer", "key", "read", "nbytes", "extent", "call", "write", "write_seq",
                 "busy")

    def __init__(self, buffer: object) -> None:
        self.buffer = buffer
        self.key: Key | None = None        # chunk whose read is in flight or waiting here
        self.read: IoHandle | None = None
        self.nbytes = 0                     # bytes of that read
        self.extent: SwapExtent | None = None  # where it reads from
        self.call = 0                       # the pipeline call that issued it
        self.write: IoHandle | None = None  # last write from this slot, until reaped
        self.write_seq = 0
        self.busy = False                   # being updated or filled by the caller

    def idle(self) -> bool:
        return self.key is None and not self.busy and (self.write is None
                                                        or self.write.released())


@dataclass(eq=False)
class _Rewrite:
    """A partition being rewritten to fresh extents within one `run`."""

    part: PartitionState
    new: list[SwapExtent] = field(default_factory=list)
    writes: list[IoHandle] = field(default_factory=list)


class SwapPipeline:
    """The load / compute / store loop over NVMe partitions' chunks.

    Args:
        swap: where NVME partitions' extents live.
        pool: lends the `buffers` slot buffers of `slot_bytes` bytes each.
        chunk_elems: elements per chunk (a multiple of 1024 keeps slots 4 KiB-sized).
        buffers: slots in the ring, >= 1 ([Note: slot reuse]).
        slot_bytes: bytes of one slot (default 12 * chunk_elems: fp32 state with master).
    """

    def __init__(self, swap: SwapSpace, pool: BufferPool, *, chunk_elems: int, buffers: int,
                 recorder: TraceRecorder = NULL_RECORDER, slot_bytes: int | None = None) -> None:
        if buffers < 1 or chunk_elems < 1:
            raise ValueError(f"pipeline needs buffers ({buffers}) and chunk_elems "
                             f"({chunk_elems}) >= 1")
        self.swap = swap
        self.pool = pool
        self.chunk_elems = chunk_elems
        self.nbuf = buffers
        self.slot_bytes = slot_bytes or BYTES_PER_ELEM * chunk_elems
        self.recorder = recorder
        self._slots: list[_Slot] = []
        self._reads: dict[Key, _Slot] = {}  # issued reads, oldest first
        self._pending: dict[Hashable, _Rewrite] = {}  # [Note: the round commits as a whole]
        self._seq = itertools.count(1)
        self._call = 0  # public calls so far: [Note: a read ahead that failed]
        self.bytes_read = 0
        self.bytes_written = 0

    # -- slots ---------------------------------------------------------------------
    def _ensure_slots(self) -> None:
        if self._slots:
            return
        nbytes = self.slot_bytes
        try:
            for k in range(self.nbuf):
                self._slots.append(_Slot(self.pool.alloc(nbytes, tag=f"optim-chunk{k}")))
        except BaseException:
            self.close()
            raise

    def _reap(self, slot: _Slot) -> _Slot:
        if slot.write is not None:
            with self.recorder.span("optim:wait_write", cat="wait", track="optim"):
                try:
                    slot.write.wait_released()
                except IoError:  # the commit of the partition it wrote reports it
                    pass
            slot.write = None
        return slot

    def _take_slot(self, protect: set[Key] | frozenset, mode: str) -> _Slot | None:
        """A slot for a new read or fill, by `mode`:
        "try": an idle one or None, never waiting;
        "wait": else the one with the oldest write (waiting for it to leave the
        buffer), else the newest read not in `protect` (a prefetch the current
        work does not need, dropped: prefetches are issued in the order they are
        needed, so the one issued last is needed last), else None;
        "must": else the one holding the newest read (dropped: it is read again
        when its turn comes; only prefetches can fill every buffer this way)."""
        self._ensure_slots()
        for s in self._slots:
            if s.idle():
                return self._reap(s)
        if mode == "try":
            return None
        writing = [s for s in self._slots if s.key is None and not s.busy]
        if writing:
            return self._reap(min(writing, key=lambda s: s.write_seq))
        for key in reversed(self._reads):
            if key not in protect:
                return self._drop(key)
        if mode == "must" and self._reads:
            return self._drop(next(reversed(self._reads)))
        if mode == "must":
            raise RuntimeError(f"optim pipeline: all {self.nbuf} buffers are busy; "
                               "this is a bug")
        return None

    def _drop(self, key: Key) -> _Slot:
        slot = self._reads.pop(key)
        try:
            slot.read.wait()
        except Exception as e:  # nobody needs these bytes; a later read reports it again
            log.debug("dropped prefetch %s failed: %s", key, e)
        slot.key = slot.read = None
        return slot

    def _issue_read(self, part: PartitionState, i: int, protect: set[Key] | frozenset,
                    mode: str) -> bool:
        """Starts reading chunk `i` of `part` unless it is already; False when no slot
        was available (`mode` as in `_take_slot`)."""
        key = (part.pid, i)
        if key in self._reads:
            return True
        slot = self._take_slot(protect, mode)
        if slot is None:
            return False
        nbytes = part.layout.chunk_bytes(i)
        slot.read = self.swap.read(part.extents[i], slot.buffer, nbytes)
        slot.key, slot.nbytes = key, nbytes
        slot.extent, slot.call = part.extents[i], self._call
        self._reads[key] = slot
        return True

    def _take_read(self, key: Key) -> _Slot:
        slot = self._reads.pop(key)
        slot.busy = True
        with self.recorder.span("optim:wait_read", cat="wait", track="optim"):
            first = self._wait_read(slot, again=slot.call != self._call)
            if first is not None:  # [Note: a read ahead that failed]
                log.warning("optim: a read of %s started ahead, by an earlier call, failed "
                            "(%s); reading it again", key, first)
                slot.read = self.swap.read(slot.extent, slot.buffer, slot.nbytes)
                if self._wait_read(slot, again=True) is not None:
                    raise first  # it persists: the first error says why
        slot.key = slot.read = None
        self.bytes_read += slot.nbytes  # counted when used, so prefetches count in their step
        return slot

    @staticmethod
    def _wait_read(slot: _Slot, again: bool) -> Exception | None:
        """Waits for the slot's read (which verifies its checksum); its error is
        returned where it may be read `again`, else raised."""
        try:
            slot.read.wait()
        except Exception as e:
            if not again:
                raise
            return e
        return None

    def _store(self, slot: _Slot, rw: _Rewrite, i: int) -> None:
        nbytes = rw.part.layout.chunk_bytes(i)
        ext = self.swap.alloc(nbytes)
        rw.new.append(ext)
        h = self.swap.write(ext, slot.buffer, nbytes)
        rw.writes.append(h)
        slot.write, slot.write_seq, slot.busy = h, next(self._seq), False
        self.bytes_written += nbytes

    def _drain(self) -> None:
        """Waits for every transfer on the slots (ignoring errors) and empties them."""
        for s in self._slots:
            for h in (s.read, s.write):
                if h is not None:
                    try:
                        h.wait()
                    except Exception:  # the failure being handled, or one of its kind
                        pass
            s.key = s.read = s.write = None
            s.busy = False
        self._reads.clear()

    # -- public --------------------------------------------------------------------
    def prefetch(self, part: PartitionState, max_chunks: int) -> int:
        """Starts reads of up to `max_chunks` first chunks of `part` into idle slots,
        never waiting; returns how many are (now) in flight or ready."""
        part.check_tier(Tier.NVME)
        self._call += 1
        if part.pid in self._pending:  # its committed extents are about to be replaced
            return 0
        n = 0
        for i in range(min(max_chunks, part.layout.n_chunks)):
            if not self._issue_read(part, i, frozenset(), "try"):
                break
            n += 1
        return n

    def prefetched(self) -> list[Hashable]:
        """Partition ids with reads in flight or ready, in the order they were issued."""
        return list(dict.fromkeys(pid for pid, _ in self._reads))

    def discard(self, pid: Hashable | None = None) -> None:
        """Drops prefetched reads of partition `pid` (all partitions: None)."""
        for key in [k for k in self._reads if pid is None or k[0] == pid]:
            self._drop(key)

    def run(self, parts: list[PartitionState], compute: ChunkFn,
            then: PartitionState | None = None) -> list[Hashable]:
        """Updates `parts` chunk by chunk: `compute` rewrites each chunk's three views
        in place; the result goes to fresh extents, pending until `commit()`
        ([Note: the round commits as a whole]). Returns the partition ids.
        `then`: an NVMe partition likely updated next; once the read-ahead passes the
        end of `parts`, idle buffers start reading its first chunks (never waiting),
        so a caller updating partitions one call at a time keeps reads in flight.

        Raises:
            ValueError: a partition of `parts` is pending already (nothing started).
            Exception: what failed (a read, a checksum, `compute`); this call's fresh
                extents are freed, the partitions pending from earlier calls stay so.
        """
        again = [p.pid for p in parts if p.pid in self._pending]
        if again:
            raise ValueError(f"partition(s) {again[:8]} already have a pending rewrite in "
                             "this round; commit() or rollback() first")
        if then is not None and then.pid in self._pending:
            then = None
        self._call += 1
        work = [(p, i) for p in parts for i in range(p.layout.n_chunks)]
        rewrites = {p.pid: _Rewrite(p) for p in parts}
        protect = {(p.pid, i) for p, i in work}
        try:
            ahead = then.layout.n_chunks if then is not None else 0
            for j, (p, i) in enumerate(work):
                self._issue_read(p, i, protect, "must")
                for k in range(j + 1, j + max(2, self.nbuf - 1)):
                    if k < len(work):
                        mode = "wait" if k == j + 1 else "try"  # load(j+1); more if idle
                        target = work[k]
                    elif k - len(work) < ahead:
                        mode, target = "try", (then, k - len(work))
                    else:
                        break
                    if self.nbuf < 2 or not self._issue_read(*target, protect, mode):
                        break
                slot = self._take_read((p.pid, i))
                lo, n = p.layout.chunk(i)
                with self.recorder.span("optim:update", cat="compute", track="optim",
                                        partition=str(p.pid), chunk=i, elems=n):
                    compute(p, i, lo, n, *_views(slot, p, n))
                self._store(slot, rewrites[p.pid], i)
            if then is not None:  # slots freed by the last writes start on `then`
                self.prefetch(then, max(1, self.nbuf - 1))
        except BaseException:
            self._drain()
            self._discard(rewrites.values())
            raise
        self._pending.update(rewrites)
        return [p.pid for p in parts]

    def commit(self) -> list[Hashable]:
        """Waits for every pending write; when all succeeded, installs every pending
        partition's new extents at `step + 1` (freeing the old ones) and returns their
        ids. When one failed, frees every pending partition's new extents (all keep
        their committed version) and raises that write's error."""
        rewrites = list(self._pending.values())
        try:
            self.durable()
        except BaseException:
            self.rollback()
            raise
        self._pending = {}
        for rw in rewrites:  # no I/O from here on: the switch cannot fail half way
            rw.part.commit(self.swap, rw.new, rw.part.step + 1)
        return [rw.part.pid for rw in rewrites]

    def durable(self) -> None:
        """Waits for every pending write; raises the IoError of one that failed (nothing
        is installed or freed: `commit` or `rollback` follows)."""
        with self.recorder.span("optim:wait_durable", cat="wait", track="optim"):
            for rw in list(self._pending.values()):
                for h in rw.writes:
                    h.wait()

    def rollback(self) -> list[Hashable]:
        """Waits for every transfer, frees the new extents of every pending partition
        (each keeps its committed version) and returns their ids."""
        self._drain()
        rewrites, self._pending = list(self._pending.values()), {}
        self._discard(rewrites)
        return [rw.part.pid for rw in rewrites]

    def pending(self) -> list[Hashable]:
        """Partition ids whose rewrite waits for `commit()`."""
        return list(self._pending)

    def _discard(self, rewrites: Iterable[_Rewrite]) -> None:
        for rw in rewrites:
            for h in rw.writes:
                try:
                    h.wait()
                except Exception:  # the failure being handled, or one of its kind
                    pass
            for ext in rw.new:
                self.swap.free(ext)

    def write_state(self, part: PartitionState, fill: ChunkFn, *, keep_old: bool = False
                    ) -> list[SwapExtent]:
        """Writes a whole partition state to fresh extents; returns them (uncommitted).

        `fill` writes each chunk's three views (with `keep_old`, they first hold
        the partition's current chunk, read from its extents). On failure the
        fresh extents are freed and the error raised; `part` is untouched.
        """
        if part.pid in self._pending:
            raise ValueError(f"partition {part.pid!r} has a pending rewrite in this round; "
                             "commit() or rollback() first")
        rw = _Rewrite(part)
        try:
            for i in range(part.layout.n_chunks):
                slot = self._take_slot(frozenset(), "must")
                slot.busy = True
                if keep_old:
                    self.swap.read(part.extents[i], slot.buffer, part.layout.chunk_bytes(i)).wait()
                lo, n = part.layout.chunk(i)
                fill(part, i, lo, n, *_views(slot, part, n))
                self._store(slot, rw, i)
            for h in rw.writes:
                h.wait()
        except BaseException:
            self._drain()
            for h in rw.writes:
                try:
                    h.wait()
                except Exception:
                    pass
            for ext in rw.new:
                self.swap.free(ext)
            raise
        return rw.new

    def read_state(self, part: PartitionState, consume: ChunkFn) -> None:
        """Reads a partition's committed chunks in order, reads ahead, and hands each to
        `consume` (a pending rewrite is not seen)."""
        part.check_tier(Tier.NVME)
        self._call += 1
        keys = {(part.pid, i) for i in range(part.layout.n_chunks)}
        try:
            for i in range(part.layout.n_chunks):
                self._issue_read(part, i, keys, "must")
                for k in range(i + 1, min(part.layout.n_chunks, i + self.nbuf)):
                    if not self._issue_read(part, k, keys, "try"):
                        break
                slot = self._take_read((part.pid, i))
                lo, n = part.layout.chunk(i)
                consume(part, i, lo, n, *_views(slot, part, n))
                slot.busy = False
        except BaseException:
            self._drain()
            raise

    def close(self) -> None:
        """Waits for every transfer, rolls back what is pending, and gives the slot
        buffers back to the pool."""
        self.rollback()
        slots, self._slots = self._slots, []
        for s in slots:
            s.buffer.release()
