"""`TieredStore`: partitions kept in DEVICE, HOST or NVME under hard budgets, moved asynchronously.

[Note: progress]
Every move reserves all the memory its steps need before its first step
starts (moves.py), so once started it needs nothing from any caller: each
asynchronous step (an NVMe read or write, a CUDA copy) signals the store's
completion thread, which waits for it off the lock - a read's checksum is
verified there - then, under the lock, finishes the record's transition and
starts the next step. A move therefore finishes whether or not anyone waits
on its handle, and a caller may always wait for moves in flight.

[Note: making room]
A reservation that does not fit asks the policy for victims among the copies
that may move now (resting, unpinned, unclaimed) and evicts them: a clean
copy is dropped at once, a dirty one is written one tier down by an eviction
move of its own (whose reservation is made without waiting, so no thread
waits while holding a claim on a victim). It then waits for moves in flight
to give bytes back, or for other threads to unpin (or leave a `modify`
block on) what they hold in the tier: they give it back by themselves. If
nothing is in flight, nothing can be evicted and only the calling thread's
own pins hold the room, the budget is exhausted for real (waiting would never
end) and it raises `BudgetExceededError` listing what is resident. Charges are all-or-nothing per move, so no thread waits while
holding part of a reservation.

[Note: a victim that cannot leave]
The policy names the fewest victims that free enough, farthest next use
first; a dirty one is written down through the tier below, which may have no
room for it. Nothing in flight, a fetch of a gradient to accumulate at the
minimum device budget (grads on the device, bf16, two micro-batches) raised
there: the policy named the embedding's 128 KiB gradient, HOST lacked 8 KiB
of room to write it down, while clean parameters, free to drop, sat beside
it. Before raising, the reservation goes on down the policy's whole order,
past victims that cannot leave now, until enough is freed; only then is the
budget exhausted for real. (Where moves are in flight it waits for them
first, as before: the policy's choice stands.)

[Note: no data lost]
A dirty copy is written to a new swap extent, and the HOST copy stays valid,
its buffer held, until that write is durable (`IoHandle.wait()`, after
fdatasync with io.sync_writes). A failed write frees only the new extent and
leaves the record at its HOST copy. An extent that stops holding the current
value (the partition is modified) is freed at once: it is not a copy of the
partition any more, and the write that replaces it goes to a new extent
anyway. A failed read or checksum mismatch releases the destination buffer
and leaves the record at NVME, the bytes never handed out.

[Note: optimizer extents]
The optimizer's NVMe state (its chunks' extents in the "optim" swap space,
`swap_space`) is not records, but its bytes count in the NVME tier like
theirs: the space's `ledger` charges every extent it reserves to the store's
accounting (kind "optim") and refunds it when freed, so `store.nvme_budget`
bounds all the training state on NVMe, the second version a step writes
before its commit included, and `stats()` shows it. An extent that would
exceed the budget raises `BudgetExceededError` naming the key before
anything is reserved (the step then fails as a whole and changes nothing).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import warnings
import weakref
from typing import Callable, Hashable, Iterator

import torch

from ..config import OffloadConfig, load_config
from ..io import BufferPool, IoEngine, SwapSpace, host_copy, make_engine
from ..trace import NULL_RECORDER, TraceRecorder
from .budget import BudgetExceededError, StoreStats
from .copy import DeviceTier, resolve_device
from .executor import MoveExecutor, UserClaim
from .moves import MoveHandle, Step, needs_of, plan_evict, plan_fetch
from .policy import EvictionPolicy, LruPolicy
from .record import IN_FLIGHT, PartitionRecord, RecordInfo, Residency, Tier

log = logging.getLogger(__name__)

__all__ = ["TieredStore"]

_DEST = {Residency.WRITING: Tier.NVME, Residency.COPYING_H2D: Tier.DEVICE,
         Residency.COPYING_D2H: Tier.HOST}  # a read's: `reading_into`


def _tier(value: Tier | str | int) -> Tier:
    if isinstance(value, str):
        try:
            return Tier[value.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; use DEVICE, HOST or NVME") from None
    try:
        return Tier(value)
    except ValueError:
        raise ValueError(f"unknown tier {value!r}; use DEVICE, HOST or NVME") from None


def _flat_source(key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s value as a 1-D dense tensor to copy from; raises, naming `key`, for
    tensors whose bytes are not their value."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"put({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError(f"put({key!r}): the tensor is on the meta device and holds no data; "
                         "materialise it first, or write its bytes in `create`")
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise ValueError(f"put({key!r}): a {tensor.layout} tensor has no flat bytes to store; "
                         "convert it with .to_dense() first")
    if tensor.is_quantized:
        raise ValueError(f"put({key!r}): a quantized tensor's scale and zero point would be "
                         "lost; store tensor.int_repr() and its quantization parameters")
    # A conjugate or negative view's bytes are not its value: resolve (copies if set).
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1)


def _memory_tier(value: Tier | str | int, what: str) -> Tier:
    """`value` as a tier, refused (ValueError) unless DEVICE or HOST."""
    tier = _tier(value)
    if tier is Tier.NVME:
        raise ValueError(f"{what} needs a copy in DEVICE or HOST; fetch it there first")
    return tier


class TieredStore(MoveExecutor):
    """Partitions in three tiers under hard budgets; every move returns a handle.

    Args:
        config: an `OffloadConfig` (or what `load_config` takes); uses its
            `store` and `io` sections.
        rank: names this process's swap files (`offload-r<rank>-<kind>.swap`).
        policy: decides evictions (default `LruPolicy`); see policy.py.
        recorder: receives moves (async events with bytes), waits (spans) and
            per-tier occupancy (counters). Off by default.
        engine, pool: an I/O engine and a host buffer pool to use instead of
            making (and owning) new ones. A given pool must hold `host_budget`
            bytes, plus `device_budget` on a CPU device (see copy.py). The pool
            the store makes also holds `io.buffer_budget` for the optimizer's
            chunk buffers (`buffer_pool`): one pool per rank, whose budget is
            the hard ceiling of host memory held for training state.

    Thread safe. A tensor view from `get`, `fetch(...).wait()` or `modify` is
    valid until the partition leaves that tier; `pin` it to keep it there.
    """

    def __init__(self, config: OffloadConfig | dict | str | None = None, *, rank: int = 0,
                 policy: EvictionPolicy | None = None, recorder: TraceRecorder = NULL_RECORDER,
                 engine: IoEngine | None = None, pool: BufferPool | None = None) -> None:
        cfg = load_config(config)
        device = resolve_device(cfg.store.device)
        self._owns_engine, self._owns_pool = engine is None, pool is None
        self._engine, self._pool, self._swaps = engine, pool, {}
        try:  # a failure, or a Ctrl-C after any line, leaves no thread and no locked file
            if engine is None:
                engine = self._engine = make_engine(cfg.io, recorder)
            if pool is None:
                extra = cfg.store.device_budget if device.type == "cpu" else 0
                # pinned for a GPU only: a CPU device on a machine with one copies nothing
                pool = self._pool = BufferPool(
                    cfg.store.host_budget + extra + cfg.io.buffer_budget,
                    pin=device.type == "cuda", device=device)
            super().__init__(cfg.store, cfg.io, rank=rank, dev=DeviceTier(device, pool),
                             engine=engine, pool=pool, recorder=recorder,
                             policy=policy if policy is not None else LruPolicy())
            self._ledgers: dict[str, _NvmeLedger] = {}  # [Note: optimizer extents]
            # collected unclosed: its parts give themselves back ([Note: lost callbacks] in
            # executor.py); said as for a file left open (not at interpreter exit)
            self._unclosed = weakref.finalize(
                self, warnings.warn, "a TieredStore was collected without close(): its "
                "threads and swap files are released now; close() it, or use it as a "
                "context manager", ResourceWarning)
            self._unclosed.atexit = False
            for kind in self._cfg.swap_kinds:
                self._swap(kind)  # open and lock now: a second job on these paths fails here
            self._worker.start()
            for t in Tier:
                recorder.declare_track(f"tier:{t.name}")
            recorder.set_info(tier_budgets={t.name: self._acct.budget(t) for t in Tier})
            log.info("tiered store on %s: DEVICE %d B, HOST %d B, NVME %s; swap under %s",
                     device, self._cfg.device_budget, self._cfg.host_budget,
                     f"{self._cfg.nvme_budget} B" if self._cfg.nvme_budget else "unlimited",
                     ", ".join(self._iocfg.paths))
        except BaseException:
            self._undo_init()
            raise

    def _undo_init(self) -> None:
        """A constructor that failed (or was interrupted) at any line: its thread ends,
        its swap files are removed, the engine and pool it made are closed."""
        unclosed, worker = self.__dict__.get("_unclosed"), self.__dict__.get("_worker")
        if unclosed is not None:
            unclosed.detach()
        if worker is not None:
            self._queue.put(None)  # a worker that started ends at it
            with contextlib.suppress(RuntimeError):  # one start() never got to
                worker.join()
        self._close_io(keep=False)

    # -- public: placing and moving ---------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The compute device of the DEVICE tier (cpu on a host without a GPU)."""
        return self._dev.device

    def put(self, key: Hashable, tensor: torch.Tensor, *, kind: str = "param",
            tier: Tier | str = Tier.HOST, cache: bool = False,
            write: bool = True) -> MoveHandle:
        """Stores a copy of `tensor` (flattened) as partition `key`, home `tier`.

        HOST and DEVICE puts are done on return; an NVME put returns while its
        write is in flight (the HOST staging copy stays valid until it is durable).
        With `cache`, an NVME put keeps that HOST copy afterwards as a clean copy
        (the next fetch finds it in memory; the policy drops it when HOST needs
        room); without, it is released once written. With `write=False`, an NVME
        put writes nothing now: the HOST copy is the only one (dirty), written to
        NVMe when the store evicts it, as a modified partition would be.
        Raises KeyError if `key` is stored, `BudgetExceededError` if no room.
        """
        src = _flat_source(key, tensor)
        with self._creating(key, src.numel(), src.dtype, kind, tier, cache,
                            write) as (new, move):
            host_copy(new, src)
        return move

    @contextlib.contextmanager
    def create(self, key: Hashable, numel: int, dtype: torch.dtype, *, kind: str = "param",
               tier: Tier | str = Tier.HOST, cache: bool = False,
               write: bool = True) -> Iterator[torch.Tensor]:
        """`with store.create(key, numel, dtype, tier=...) as t:` stores a new partition
        whose bytes the caller writes into `t` (its memory in HOST for an NVME home,
        else in the home tier): `put` without a source tensor to copy from.

        The partition exists, as `put` would leave it, when the block ends (an
        NVME write starts then); if the block raises, nothing is stored. `cache`
        and `write` are `put`'s. Raises KeyError if `key` is stored,
        `BudgetExceededError` if no room (before the block runs).
        """
        with self._creating(key, numel, dtype, kind, tier, cache, write) as (new, _):
            yield new

    @contextlib.contextmanager
    def _creating(self, key: Hashable, numel: int, dtype: torch.dtype, kind: str,
                  tier: Tier | str, cache: bool,
                  write: bool) -> Iterator[tuple[torch.Tensor, MoveHandle]]:
        tier = _tier(tier)
        cache = cache or not write
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", kind):
            raise ValueError(f"kind {kind!r} names swap files: use letters, digits, '_', '.', '-'")
        rec = PartitionRecord(key, kind, dtype, numel, tier)
        first = Tier.HOST if tier is Tier.NVME else tier
        move = self._new_move("put", key, tier)
        self._bind(move, rec)
        with self._cond:
            self._check_open()
            if key in self._records:
                raise KeyError(f"partition {key!r} is already stored; free it first, or "
                               "modify it in place")
            rec.claim = move
            self._records[key] = rec
            try:
                needs = {first: rec.footprint}
                if tier is Tier.NVME and write:
                    needs[Tier.NVME] = rec.footprint
                self._reserve(needs, {key}, f"put of {key!r}")
                self._allocate(move, rec, needs, set(needs))
            except BaseException:
                del self._records[key]
                self._cond.notify_all()
                raise
        try:  # off the lock: the record is claimed, nobody else touches its memory
            yield self._dev.view(move.reserved[first], rec.dtype, rec.numel), move
        except BaseException as e:
            with self._cond:
                if self._closed:  # the block closed the store: close released everything
                    move._finish(None, e)
                else:
                    self._finish_move(move, rec, e, unregister=True)
            raise
        with self._cond:
            if self._closed:
                error = RuntimeError(f"put of {key!r}: the store was closed inside its create "
                                     "block; nothing is stored")
                move._finish(None, error)
                raise error
            rec.place(first, move.reserved.pop(first))
            move.steps = ([Step.WRITE] if cache else [Step.WRITE, Step.DROP_HOST]) \
                if tier is Tier.NVME and write else []
            self._start(move, rec)  # first: the move runs even if the policy raises
            self._policy.touched(key, first)

    def fetch(self, key: Hashable, to: Tier | str = Tier.DEVICE, *,
              pin: bool = False) -> MoveHandle:
        """Starts making a valid copy of `key` in `to` (HOST or DEVICE); returns its handle.

        `handle.wait()` returns the view in `to`. With `pin`, the partition is
        pinned once the fetch succeeds (`unpin` it when done). Waits first for a
        move of `key` in flight. Raises `BudgetExceededError` when no room can
        be made; the record is then unchanged.
        """
        with self._cond:
            return self._fetch(key, _tier(to), pin)

    def prefetch(self, key: Hashable, to: Tier | str = Tier.DEVICE) -> MoveHandle | None:
        """`fetch(key, to)` where it starts without waiting; else None. None when `key`
        has a move in flight (it is on its way), or when its room is not free now:
        the evictions that make it are started (a dirty copy's write) and a later
        call finds the room. A prefetch on the compute thread, which must not wait
        for one, calls this ([Note: prefetch room] in offload/engine/eviction.py)."""
        to = _tier(to)
        with self._cond:
            self._check_open()
            rec = self._record(key)
            if rec.claim is not None:
                return None
            steps = plan_fetch(rec.valid, to, self._dev.hand_over)
            needs = needs_of(steps, rec.footprint)
            if (steps and not self._acct.fits(needs)
                    and not (steps == [Step.HAND_H2D] and self._swap_victims(rec))):
                self._make_room(needs, {key}, [])
                if not self._acct.fits(needs):
                    return None
            return self._fetch(key, to, False)

    def _fetch(self, key: Hashable, to: Tier, pin: bool) -> MoveHandle:
        """`fetch`, the lock held."""
        self._check_open()
        move = self._new_move("fetch", key, to)
        rec = self._claim(key, move, "fetch")
        try:
            self._bind(move, rec)
            move.pin = pin
            self._plan(move, rec, plan_fetch(rec.valid, to, self._dev.hand_over))
        except BaseException:
            self._unclaim(rec, move)
            raise
        self._start(move, rec)
        return move

    def could_hold(self, where: dict[Hashable, Tier]) -> bool:
        """False when the copies `where` names (key -> tier) could never be resident
        together: their bytes in some tier exceed its budget. (True does not promise
        they fit: other copies may be pinned.) Asked before pinning many at once, so
        that an attempt bound to fail moves nothing."""
        need: dict[Tier, int] = {}
        with self._cond:
            for key, tier in where.items():
                rec = self._records.get(key)
                if rec is not None and tier is not Tier.NVME:
                    need[tier] = need.get(tier, 0) + rec.footprint
            return all(not self._acct.budget(t) or n <= self._acct.budget(t)
                       for t, n in need.items())

    def fits_sparing(self, key: Hashable, to: Tier | str,
                     spare: Callable[[Hashable], bool]) -> bool:
        """True when a fetch of `key` to `to` finds room in every memory tier it passes
        through, free or freed by evicting copies other than those for which
        `spare(key)` is True (unpinned, unclaimed ones: the policy's candidates);
        a fetch that needs no room, or waits for a move of `key` in flight, fits.
        A prefetch asks this first, so that it never evicts what is needed sooner
        ([Note: prefetch room] in offload/engine/eviction.py)."""
        to = _tier(to)
        with self._cond:
            rec = self._records.get(key)
            if rec is None or rec.claim is not None:
                return True
            needs = needs_of(plan_fetch(rec.valid, to, self._dev.hand_over), rec.footprint)
            for tier, n in needs.items():
                free = self._acct.room(tier) + self._acct.releasing(tier)
                if tier is Tier.NVME or free >= n:
                    continue
                free += sum(c.nbytes for k, c in self._candidates(tier, {key}).items()
                            if not spare(k))
                if free < n:
                    return False
            return True

    def evict(self, key: Hashable, to: Tier | str | None = None) -> MoveHandle:
        """Starts moving `key` down to `to` (default: its home tier); returns its handle.

        Copies above `to` are dropped; if none below holds the value, it is
        written to `to` first. A partition already below `to` is left alone.
        Raises RuntimeError if `key` is pinned.
        """
        with self._cond:
            self._check_open()
            move = self._new_move("evict", key, Tier.NVME)
            rec = self._claim(key, move, "evict")
            try:
                self._bind(move, rec)
                move.dst = rec.home if to is None else _tier(to)
                if rec.pins:
                    raise RuntimeError(f"partition {key!r} is pinned {rec.pins} time(s); unpin "
                                       "it before evicting")
                self._plan(move, rec, plan_evict(rec.valid, move.dst, self._dev.hand_over))
            except BaseException:
                self._unclaim(rec, move)
                raise
            self._start(move, rec)
        return move

    def get(self, key: Hashable, tier: Tier | str = Tier.DEVICE) -> torch.Tensor:
        """The view of `key` in `tier`; raises unless that copy is valid (fetch and wait first)."""
        tier = _tier(tier)
        with self._cond:
            self._check_open()
            rec = self._record(key)
            if tier not in rec.valid:
                raise RuntimeError(f"partition {key!r} is {rec.state}; its {tier} copy is not "
                                   f"valid (valid: {sorted(t.name for t in rec.valid)}); fetch "
                                   "it there and wait first")
            self._policy.touched(key, tier)
            return self._view(rec, tier)

    @contextlib.contextmanager
    def modify(self, key: Hashable, tier: Tier | str = Tier.DEVICE) -> Iterator[torch.Tensor]:
        """`with store.modify(key, tier) as t:` yields the writable view in `tier`.

        That copy becomes the only valid one (the others are released now, see
        [Note: no data lost]); the partition is held away from moves until the
        block ends. Its copy in `tier` must be valid: fetch it there first.
        """
        tier = _memory_tier(tier, "modify")
        claim = UserClaim("modify")
        with self._cond:
            self._check_open()
            rec = self._claim(key, claim, "modify")
            try:
                for t, memory in rec.modify(tier).items():
                    self._release(t, rec, memory)
                view = self._view(rec, tier)
                self._policy.touched(key, tier)
            except BaseException:
                self._unclaim(rec, claim)
                raise
        try:
            yield view
        finally:
            with self._cond:
                self._unclaim(rec, claim)

    def pin(self, key: Hashable) -> None:
        """Holds `key` where it is: never chosen for eviction, `evict` and `free` refuse it."""
        with self._cond:
            self._add_pin(self._record(key), threading.get_ident())

    def unpin(self, key: Hashable) -> None:
        """Gives back one pin of `key` (the calling thread's, if it holds one)."""
        with self._cond:
            self._drop_pin(self._record(key))
            self._cond.notify_all()

    def free(self, key: Hashable) -> None:
        """Forgets `key` and releases its memory in every tier (waits for its move in flight)."""
        claim = UserClaim("free")
        with self._cond:
            self._check_open()
            rec = self._claim(key, claim, "free")
            if rec.pins:
                self._unclaim(rec, claim)
                raise RuntimeError(f"partition {key!r} is pinned {rec.pins} time(s); unpin it "
                                   "before freeing")
            for t, memory in rec.release_all().items():
                self._release(t, rec, memory)
            del self._records[key]
            self._policy.forgotten(key)
            self._cond.notify_all()

    def replace(self, key: Hashable, by: Hashable) -> None:
        """`key` takes the value of partition `by`, without a copy: `key`'s memory in
        every tier is released and `by`'s record is stored as `key` (`by` is gone).

        Waits for moves in flight of either; nothing else can fail once both are
        held, so a caller can switch many partitions to new versions one after the
        other and know none of the switches fails half way. Raises (changing
        nothing) if `by` is not stored, or either is pinned or of another kind.
        """
        claim = UserClaim("replace")
        with self._cond:
            self._check_open()
            new = self._claim(by, claim, "replace")
            old = None
            try:
                if key in self._records:
                    old = self._claim(key, claim, "replace")
                for rec in (new, old):
                    if rec is not None and rec.pins:
                        raise RuntimeError(f"replace of {key!r} by {by!r}: partition "
                                           f"{rec.key!r} is pinned {rec.pins} time(s)")
                if old is not None and old.kind != new.kind:
                    raise ValueError(f"replace of {key!r} ({old.kind}) by {by!r} ({new.kind}): "
                                     "partitions of different kinds live in different swap files")
            except BaseException:
                for rec in (new, old):
                    if rec is not None:
                        self._unclaim(rec, claim)
                raise
            if old is not None:
                for t, memory in old.release_all().items():
                    self._release(t, old, memory)
                self._policy.forgotten(key)
            del self._records[by]
            self._policy.forgotten(by)
            new.key = key
            self._records[key] = new
            self._policy.touched(key, new.top)
            self._unclaim(new, claim)

    def split(self, key: Hashable, into: Hashable, tier: Tier | str, *,
              pin: bool = False) -> bool:
        """Moves the copy of `key` in `tier` (HOST or DEVICE), without a copy of its
        bytes, to a new partition `into` of the same kind, dtype, size and home, whose
        only copy it then is; `key` keeps its other copies and its value.

        [Note: split] The memory changes owner, not tier: nothing is charged or
        released, and no budget can be exceeded. The copy must be clean (another
        tier holds `key`'s value), so `key` loses nothing; a caller that writes the
        new partition in place (`modify`) and then frees it on failure leaves
        `key` as it was. The calling thread's pins of `key` stay with `key`; with
        `pin`, `into` is born pinned by the calling thread (`unpin` it when done), so
        no eviction can move it out of `tier` before the caller modifies it there.
        Waits for a move of `key` in flight. Returns False, changing nothing, when
        the copy is not there or not clean, or another thread pins `key`; raises
        when `into` is stored.
        """
        tier = _memory_tier(tier, "split")
        claim = UserClaim("split")
        with self._cond:
            self._check_open()
            if into in self._records:
                raise KeyError(f"partition {into!r} is already stored; free it first")
            rec = self._claim(key, claim, "split")
            try:
                me = threading.get_ident()
                if (any(t != me for t in self._pinners.get(key, ()))
                        or tier not in rec.valid or len(rec.valid) < 2):
                    return False
                memory = rec.drop(tier)
            finally:
                self._unclaim(rec, claim)
            new = PartitionRecord(into, rec.kind, rec.dtype, rec.numel, rec.home)
            new.place(tier, memory)
            self._records[into] = new
            if pin:
                self._add_pin(new, threading.get_ident())
            self._policy.touched(into, tier)
            self._emit_tier(tier)
            self._cond.notify_all()
        return True

    def wait_all(self, timeout: float | None = None) -> None:
        """Blocks until no move is in flight (errors stay with their handles)."""
        deadline = time.monotonic() + (self._cfg.wait_timeout if timeout is None else timeout)
        with self._cond:
            while self._active:
                self._wait(deadline, "idle", "wait_all")

    # -- public: reading the state ----------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        with self._cond:
            return key in self._records

    def __len__(self) -> int:
        with self._cond:
            return len(self._records)

    def keys(self) -> list[Hashable]:
        with self._cond:
            return list(self._records)

    def info(self, key: Hashable) -> RecordInfo:
        """A consistent copy of `key`'s record."""
        with self._cond:
            return self._record(key).info()

    def swap_paths(self, kind: str) -> list[str]:
        """The swap files that hold NVME copies of `kind` (striped over io.paths)."""
        with self._cond:
            return self._swap(kind).paths

    @property
    def io_engine(self) -> IoEngine:
        """The engine every swap file of this store reads and writes through."""
        return self._engine

    @property
    def buffer_pool(self) -> BufferPool:
        """The host buffer pool the store's memory comes from; the optimizer's chunk
        buffers (`io.buffer_budget`) come from it too. Closed by `close`."""
        return self._pool

    def swap_space(self, kind: str) -> SwapSpace:
        """The `SwapSpace` of `kind` (opened on first use, through the store's I/O engine;
        closed, with its files, by `close`), for the optimizer's state ("optim"),
        tools and benchmarks. Extents allocated there directly are outside the store's
        records but count in its NVME budget ([Note: optimizer extents]).
        """
        with self._cond:
            self._check_open()
            swap = self._swap(kind)
            if swap.ledger is None:
                swap.ledger = self._ledgers[kind] = _NvmeLedger(self, kind)
            return swap

    def stats(self) -> StoreStats:
        """A snapshot of the accounting: bytes per tier and kind, moves, waits."""
        with self._cond:
            by_state: dict[str, int] = {}
            for rec in self._records.values():
                by_state[str(rec.state)] = by_state.get(str(rec.state), 0) + 1
            return self._acct.snapshot(len(self._records), by_state)

    def take_peaks(self) -> dict[str, int]:
        """The most bytes each tier ("DEVICE", "HOST", "NVME") held since the last call
        (since the store started, the first time): a step's peak, taken at its end,
        which `stats()`'s peak since the start cannot give."""
        with self._cond:
            return self._acct.take_peaks()

    def log_stats(self, level: int = logging.INFO) -> StoreStats:
        stats = self.stats()
        log.log(level, "store r%d: %s", self.rank, stats.summary())
        return stats

    def audit(self) -> None:
        """Cross-checks every record against the accounting; raises RuntimeError with the values."""
        with self._cond:
            expected: dict[Tier, dict[str, int]] = {t: {} for t in Tier}
            for rec in self._records.values():
                self._audit_record(rec)
                for t in rec.copies:
                    expected[t][rec.kind] = expected[t].get(rec.kind, 0) + rec.footprint
            for move in self._moves:
                for t in move.reserved:
                    expected[t][move.kind] = expected[t].get(move.kind, 0) + move.rec.footprint
            for kind, ledger in self._ledgers.items():
                if ledger.held:
                    expected[Tier.NVME][kind] = expected[Tier.NVME].get(kind, 0) + ledger.held
            for t in Tier:
                held = self._acct.by_kind(t)
                if held != expected[t]:
                    raise RuntimeError(f"{t}: accounting holds {held} bytes by kind, records "
                                       f"and reservations hold {expected[t]}")
                budget = self._acct.budget(t)
                if budget and self._acct.used(t) > budget:
                    raise RuntimeError(f"{t}: {self._acct.used(t)} bytes held, over the budget "
                                       f"of {budget}")
                if not self._active and self._acct.releasing(t):
                    raise RuntimeError(f"{t}: {self._acct.releasing(t)} bytes releasing with "
                                       "no move in flight")

    @staticmethod
    def _audit_record(rec: PartitionRecord) -> None:
        if rec.state is Residency.FREED:
            if rec.copies or not (isinstance(rec.claim, MoveHandle) and rec.claim.op == "put"):
                raise RuntimeError(f"{rec!r}: FREED but stored, and not being put")
            return  # a put copying its first bytes in: its memory is its move's reservation
        if not rec.valid or not rec.valid <= set(rec.copies):
            raise RuntimeError(f"{rec!r}: valid tiers must be a non-empty subset of held "
                               f"tiers {sorted(t.name for t in rec.copies)}")
        extra = set(rec.copies) - rec.valid
        want = set()
        if rec.state is Residency.READING:
            want = {rec.reading_into}
        elif rec.state in IN_FLIGHT:
            want = {_DEST[rec.state]}
        if extra != want:
            raise RuntimeError(f"{rec!r}: holds memory in {sorted(t.name for t in extra)} "
                               f"beyond its valid copies, expected {sorted(t.name for t in want)}")
        if rec.state not in IN_FLIGHT and rec.state.value != rec.top.name:
            raise RuntimeError(f"{rec!r}: resting state must be its top valid tier {rec.top}")
        if rec.in_flight and rec.claim is None:
            raise RuntimeError(f"{rec!r}: in flight without a move")
        if rec.pins < 0:
            raise RuntimeError(f"{rec!r}: negative pin count")

    # -- closing ----------------------------------------------------------------------
    def close(self, keep_files: bool | None = None) -> None:
        """Waits for moves in flight and for other threads' `create` and `modify` blocks,
        then releases all memory and removes the swap files (unless `keep_files`,
        default store.keep_swap_files). From the moment it is called the store takes
        no new work. A `create` block of the calling thread stores nothing: it raises
        when it ends. Raises RuntimeError when the wait passes store.wait_timeout: the
        store then stays closing, and a later `close` waits again and finishes the
        job. Idempotent once done."""
        keep = self._cfg.keep_swap_files if keep_files is None else keep_files
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._closing = True
                self._cond.notify_all()
                deadline = time.monotonic() + self._cfg.wait_timeout
                while (self._active or self._open_blocks()) and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                stuck = ([f"{self._active} move(s)"] if self._active else []) \
                    + self._open_blocks()
            if stuck:
                raise RuntimeError(f"store close: {', '.join(stuck)} still in flight after "
                                   f"{self._cfg.wait_timeout} s; their buffers are not "
                                   "released; call close again once they end")
            self._queue.put(None)
            self._worker.join()
            with self._cond:
                for rec in self._records.values():
                    for t, memory in rec.copies.items():
                        self._release(t, rec, memory)
                    rec.copies.clear()
                    rec.valid.clear()
                    rec.state = Residency.FREED
                self._records.clear()
                self._closed = True
            self._unclosed.detach()
            self.log_stats()
            self._close_io(keep)

    def _open_blocks(self) -> list[str]:
        """The `create` and `modify` blocks other threads hold open now (a `free`,
        `replace` or `split` never holds its claim off the lock). The calling thread's
        own are left out: waiting for them would never end."""
        me = threading.get_ident()
        found = []
        for rec in self._records.values():
            held = rec.claim
            if isinstance(held, UserClaim) and held.thread.ident != me:
                found.append(f"a {held.what} block of partition {rec.key!r}")
            elif (isinstance(held, MoveHandle) and held.op == "put" and not held.active
                  and held.owner != me):
                found.append(f"the create block of partition {rec.key!r}")
        return found

    def _close_io(self, keep: bool) -> None:
        errors = []
        for swap in list(self._swaps.values()):
            try:
                swap.close(keep=keep)
            except OSError as e:
                errors.append(e)
        self._swaps.clear()
        if self._owns_engine and self._engine is not None:
            self._engine.close()
        if self._owns_pool and self._pool is not None:
            self._pool.close(force=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredStore(device={self.device}, partitions={len(self._records)})"


class _NvmeLedger:
    """The NVME budget's count of a swap space used outside the store's records
    ([Note: optimizer extents]); `held`: its bytes now."""

    def __init__(self, store: TieredStore, kind: str) -> None:
        self._store = store
        self.kind = kind
        self.held = 0

    def charge(self, nbytes: int) -> None:
        st = self._store
        with st._cond:
            acct = st._acct
            if nbytes > acct.room(Tier.NVME):
                raise BudgetExceededError(
                    f"store.nvme_budget: the {self.kind} state needs {nbytes} more bytes on "
                    f"NVMe, and the NVME tier holds {acct.used(Tier.NVME)} of its "
                    f"{acct.budget(Tier.NVME)} bytes ({acct.by_kind(Tier.NVME)} by kind; a "
                    "step writes its optimizer state's new version beside the old one until "
                    "it commits); raise store.nvme_budget, or set it to 0 (bounded by the disk)")
            st._charge(Tier.NVME, self.kind, nbytes)
            self.held += nbytes

    def refund(self, nbytes: int) -> None:
        st = self._store
        with st._cond:
            st._acct.refund(Tier.NVME, self.kind, nbytes)
            self.held -= nbytes
            st._emit_tier(Tier.NVME)
