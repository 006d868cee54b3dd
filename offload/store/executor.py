"""The store's machinery: claims, reservations under budgets, evictions, and move execution.

`MoveExecutor` owns the shared state of a store (records, accounting, the
lock, the completion thread) and runs moves step by step; `TieredStore`
(store.py) is the public API over it. Everything here runs under `_cond`
(the store's one lock) unless it says otherwise. See [Note: progress],
[Note: making room] and [Note: no data lost] in store.py.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import threading
import time
import weakref
from typing import Hashable, Iterable

import torch

from ..config import IoConfig, StoreConfig, format_bytes
from ..io import BufferPool, IoEngine, IoError, IoHandle, ReadHandle, SwapSpace, open_swap
from ..trace import TraceRecorder
from .budget import Accounting, BudgetExceededError
from .copy import DeviceTier, bind_thread
from .moves import MoveHandle, Step, needs_of, plan_evict
from .policy import Candidate, EvictionPolicy
from .record import PartitionRecord, Tier

log = logging.getLogger(__name__)

__all__ = ["MoveExecutor", "UserClaim"]

_MEMORY_STEPS = frozenset({Step.READ, Step.READ_DEVICE, Step.WRITE, Step.H2D, Step.D2H})
_READS = frozenset({Step.READ, Step.READ_DEVICE})


class UserClaim:
    """The claim of a `modify` block or a `free`: holds a record away from moves."""

    __slots__ = ("what", "thread")

    def __init__(self, what: str) -> None:
        self.what = what
        self.thread = threading.current_thread()

    def __repr__(self) -> str:
        return f"{self.what} in thread {self.thread.name}"


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(text)


def _eviction_failed(what: str, victim: MoveHandle) -> Exception:
    """The error of a reservation for `what` whose `victim` failed to leave. Where it
    failed on I/O (a disk that died: EIO; the file-size limit), that error again, of its
    type (`IoError`, `SwapFullError`) and led by what it failed: a `BudgetExceededError`
    sent the user to raise a budget while the disk was at fault, and a caller that falls
    back on a budget's refusal (a prefetch that skips) now meets the disk's failure at
    once, as every other transfer on that disk does. Else `BudgetExceededError`."""
    text = f"cannot make room for {what}: evicting partition {victim.key!r} failed"
    if isinstance(victim.error, IoError):
        return victim.error.within(text)
    return BudgetExceededError(f"{text}: {victim.error}")


class MoveExecutor:
    """Shared state and move execution of one store; see the module docstring."""

    def __init__(self, cfg: StoreConfig, iocfg: IoConfig, *, rank: int, dev: DeviceTier,
                 engine: IoEngine, pool: BufferPool, policy: EvictionPolicy,
                 recorder: TraceRecorder) -> None:
        self._cfg = cfg
        # kinds beyond store.swap_kinds open on first use: relative io.paths are resolved
        # now, so those land beside the others after an os.chdir()
        self._iocfg = dataclasses.replace(iocfg, paths=[os.path.abspath(p) for p in iocfg.paths])
        self.rank = rank
        self._dev = dev
        self._engine = engine
        self._pool = pool
        self._policy = policy
        self._rec = recorder
        self._acct = Accounting({Tier.DEVICE: cfg.device_budget, Tier.HOST: cfg.host_budget,
                                 Tier.NVME: cfg.nvme_budget})
        self._cond = threading.Condition(threading.Lock())
        self._records: dict[Hashable, PartitionRecord] = {}
        self._moves: set[MoveHandle] = set()  # moves holding reserved memory
        self._active = 0                       # moves started and not finished
        self._planning = 0                     # threads inside _reserve
        self._closing = False                  # set by close(): no new work is taken
        self._closed = False                   # close() released everything
        self._close_lock = threading.Lock()    # one close() at a time
        self._swaps: dict[str, SwapSpace] = {}
        self._kinds_seen: dict[Tier, set[str]] = {t: set() for t in Tier}
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._in_io: dict[MoveHandle, tuple[int, object]] = {}  # moves waiting on an I/O handle
        self._pinners: dict[Hashable, list[int]] = {}  # key -> the thread of each pin
        self._worker = threading.Thread(target=_complete_while_referenced,
                                        args=(weakref.ref(self), self._queue, dev.device),
                                        daemon=True, name=f"offload-store-r{rank}")

    # -- claims, waits, views ---------------------------------------------------------
    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("the tiered store is closed")

    def _record(self, key: Hashable) -> PartitionRecord:
        rec = self._records.get(key)
        if rec is None:
            self._check_open()  # a closed store forgot every key: say why
            raise KeyError(f"partition {key!r} is not stored")
        return rec

    @staticmethod
    def _own_put(held: object) -> bool:
        """True when `held` is a put whose bytes the calling thread is still writing (its
        `create` block is open): only that thread can finish it."""
        return (isinstance(held, MoveHandle) and held.op == "put" and not held.active
                and held.owner == threading.get_ident())

    def _claim(self, key: Hashable, claim: object, what: str) -> PartitionRecord:
        """Waits until no move or user block holds `key`, then holds it for `claim`."""
        deadline = time.monotonic() + self._cfg.wait_timeout
        while True:
            self._check_open()
            rec = self._record(key)
            if rec.claim is None:
                rec.claim = claim
                return rec
            held = rec.claim
            if isinstance(held, UserClaim) and held.thread is threading.current_thread():
                raise RuntimeError(f"{what} of partition {key!r}: this thread holds it in a "
                                   f"{held.what} block; leave the block first")
            if self._own_put(held):
                raise RuntimeError(f"{what} of partition {key!r}: this thread is still writing "
                                   "its bytes in a create block; leave the block first")
            self._wait(deadline, "busy", f"{what} of {key!r} behind {held!r}")

    def _unclaim(self, rec: PartitionRecord, claim: object) -> None:
        if rec.claim is claim:
            rec.claim = None
        self._cond.notify_all()

    def _wait(self, deadline: float, why: str, what: str) -> None:
        """One wait on the store's condition, timed, traced and counted as waiting."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: still waiting after store.wait_timeout "
                               f"({self._cfg.wait_timeout} s)")
        t0 = time.perf_counter_ns()
        self._cond.wait(left)
        t1 = time.perf_counter_ns()
        self._acct.waited((t1 - t0) / 1e9)
        self._rec.complete(f"wait:{why}", t0, t1, cat="wait", args={"what": what})

    def _on_wait(self, move: MoveHandle, t0: float, t1: float) -> None:
        """Called (without the lock) by `MoveHandle.wait` after it blocked."""
        with self._cond:
            self._acct.waited(t1 - t0)
        self._rec.complete(f"wait:{move.op}", int(t0 * 1e9), int(t1 * 1e9), cat="wait",
                           args={"key": str(move.key), "bytes": move.nbytes})

    def _view(self, rec: PartitionRecord, tier: Tier) -> torch.Tensor:
        return self._dev.view(rec.copies[tier], rec.dtype, rec.numel)

    def _swap(self, kind: str) -> SwapSpace:
        swap = self._swaps.get(kind)
        if swap is None:
            swap = self._swaps[kind] = open_swap(self._iocfg, f"r{self.rank}-{kind}",
                                                 self._engine)
        return swap

    # -- pins -------------------------------------------------------------------------
    def _add_pin(self, rec: PartitionRecord, thread: int) -> None:
        rec.pins += 1
        self._pinners.setdefault(rec.key, []).append(thread)

    def _drop_pin(self, rec: PartitionRecord) -> None:
        """One pin of `rec` less: the calling thread's, if it holds one."""
        if rec.pins <= 0:
            raise RuntimeError(f"partition {rec.key!r} is not pinned")
        rec.pins -= 1
        owners = self._pinners.get(rec.key, [])
        me = threading.get_ident()
        if owners:
            owners.remove(me if me in owners else owners[0])
        if not rec.pins:
            self._pinners.pop(rec.key, None)

    def _held_elsewhere(self, tiers: Iterable[Tier]) -> bool:
        """True when another thread pins, or holds in a `modify` block, a copy in one of
        `tiers` or in a memory tier below one: it will give it back, so a reservation
        waits for it rather than fail. (Pins of the calling thread never count: waiting
        for them would never end.)

        [Note: room below] A dirty victim in DEVICE leaves only by a write down to
        HOST, which needs room there: where another thread pins that room (a
        checkpoint save in the background reading a partition in HOST), making room
        in DEVICE waits for the pin to come back as it waits for a pin in DEVICE."""
        me = threading.get_ident()
        tiers = set(tiers)
        tiers |= {t.lower for t in tiers if t.lower is not None and t.lower is not Tier.NVME}
        for key, rec in self._records.items():
            if not tiers & set(rec.copies):
                continue
            if any(t != me for t in self._pinners.get(key, ())):
                return True
            if isinstance(rec.claim, UserClaim) and rec.claim.thread.ident != me:
                return True
        return False

    # -- memory and accounting --------------------------------------------------------
    def _charge(self, tier: Tier, kind: str, nbytes: int) -> None:
        self._acct.charge(tier, kind, nbytes)
        self._emit_tier(tier)

    def _release(self, tier: Tier, rec: PartitionRecord, memory: object) -> None:
        """Gives back `memory` (None: bytes only) of one copy of `rec` in `tier`."""
        if memory is not None:
            if tier is Tier.NVME:
                self._swap(rec.kind).free(memory, counted=False)  # counted below
            else:
                self._dev.release(memory)
        self._acct.refund(tier, rec.kind, rec.footprint)
        self._emit_tier(tier)

    def _alloc_memory(self, tier: Tier, rec: PartitionRecord) -> object:
        tag = f"{rec.kind}:{rec.key}"
        try:
            if tier is Tier.HOST:
                return self._pool.alloc(rec.nbytes, tag=tag)
            if tier is Tier.DEVICE:
                return self._dev.alloc(rec.nbytes, tag)
        except OSError as e:  # the pool's mmap: ENOMEM under ulimit -v or a cgroup limit
            if e.errno != errno.ENOMEM:
                raise
            raise self._unmappable(tier, tag, rec.nbytes, e) from e
        return self._swap(rec.kind).alloc(rec.nbytes, counted=False)  # charged by the move

    def _unmappable(self, tier: Tier, tag: str, nbytes: int, e: OSError) -> MemoryError:
        """The host memory the budgets promise cannot be mapped: a MemoryError that
        names the budget keys to lower, not the pool's bare ENOMEM."""
        keys = [f"store.host_budget = {format_bytes(self._cfg.host_budget)}",
                f"io.buffer_budget = {format_bytes(self._iocfg.buffer_budget)}"]
        if self._dev.device.type == "cpu":
            keys.append(f"store.device_budget = {format_bytes(self._cfg.device_budget)} "
                        "(the CPU is the device)")
        return MemoryError(
            f"cannot map {nbytes} bytes of host memory for partition {tag} in the "
            f"{tier.name} tier ([Errno {e.errno}] {e.strerror}): this process may not map "
            "as much as its host budgets allow (ulimit -v, a container's memory limit, or "
            f"the machine's free memory); lower {', '.join(keys)} to fit beside the rest "
            "of the process, or raise the limit")

    def _allocate(self, move: MoveHandle, rec: PartitionRecord, needs: dict[Tier, int],
                  memory: set[Tier]) -> None:
        """Charges `needs` (which must fit) and allocates the tiers in `memory` for `move`."""
        charged = []
        try:
            for t, n in needs.items():
                self._charge(t, rec.kind, n)
                charged.append(t)
                move.reserved[t] = self._alloc_memory(t, rec) if t in memory else None
        except BaseException:
            for t in charged:
                self._release(t, rec, move.reserved.pop(t, None))
            raise
        self._moves.add(move)

    def _emit_tier(self, tier: Tier) -> None:
        if not self._rec.enabled:
            return
        held = self._acct.by_kind(tier)
        seen = self._kinds_seen[tier]
        seen.update(held)
        self._rec.counter(f"tier:{tier.name}", {k: held.get(k, 0) for k in sorted(seen)}
                          or {"bytes": 0}, track=f"tier:{tier.name}")

    # -- making room (see [Note: making room]) -----------------------------------------
    def _reserve(self, needs: dict[Tier, int], exclude: set[Hashable], what: str) -> None:
        """Returns once `needs` fit (the lock still held, nothing charged yet); evicts and
        waits as needed. Raises `BudgetExceededError` when no room can be made, and a
        victim's `IoError` where its eviction failed on I/O ([_eviction_failed])."""
        for t, n in needs.items():
            budget = self._acct.budget(t)
            if budget and n > budget:
                raise BudgetExceededError(
                    f"{what} needs {n} bytes in {t}, more than its whole budget of {budget} "
                    f"bytes; raise store.{t.name.lower()}_budget")
        deadline = time.monotonic() + self._cfg.wait_timeout
        victims: list[MoveHandle] = []
        idle = 0
        self._planning += 1
        try:
            while not self._acct.fits(needs):
                self._check_open()
                failed = next((v for v in victims if v.error is not None), None)
                if failed is not None:
                    raise _eviction_failed(what, failed) from failed.error
                if self._make_room(needs, exclude, victims):
                    continue
                if self._active or any(not self._own_put(m) for m in self._moves):
                    self._wait(deadline, "budget", what)  # moves in flight (or another
                    idle = 0                              # thread's put) finish on their own
                elif self._held_elsewhere(needs):  # another thread's pins come back
                    self._wait(deadline, "budget", what)
                    idle = 0
                elif self._planning > 1 and idle < 40:  # another thread may start a move
                    idle += 1
                    self._wait(min(deadline, time.monotonic() + 0.025), "budget", what)
                elif not self._make_room(needs, exclude, victims, any_victim=True):
                    raise BudgetExceededError(self._no_room_message(needs, what))
            # a wait woken by close(), which gave every record's memory back: the room
            # is there, the record gone ("partition is FREED")
            self._check_open()
        except TimeoutError as e:
            raise BudgetExceededError(f"{self._no_room_message(needs, what)} ({e})") from e
        finally:
            self._planning -= 1

    def _make_room(self, needs: dict[Tier, int], exclude: set[Hashable],
                   victims: list[MoveHandle], any_victim: bool = False) -> bool:
        """Evicts what the policy chooses where `needs` lack room; True if bytes were freed
        or an eviction started. `any_victim`: where nothing else would ever make room,
        goes on down the policy's order past victims that cannot leave now ([Note: a
        victim that cannot leave] in store.py)."""
        progressed = False
        for tier, n in needs.items():
            short = n - self._acct.room(tier) - self._acct.releasing(tier)
            if tier is Tier.NVME or short <= 0:
                continue  # nothing is below NVMe; the rest is on its way back
            cands = self._candidates(tier, exclude)
            if not cands:
                continue
            want = sum(c.nbytes for c in cands.values()) if any_victim else short
            freed = 0
            for key in self._policy.choose(tier, want, list(cands.values())):
                if key not in cands:
                    raise RuntimeError(f"eviction policy {type(self._policy).__name__} chose "
                                       f"{key!r}, not a candidate in {tier} (candidates: "
                                       f"{list(cands)[:10]})")
                rec = self._records[key]
                if rec.claim is not None or rec.pins or tier not in rec.valid:
                    continue  # taken by an eviction made just before
                freed += self._evict_victim(rec, tier, exclude, victims)
                if any_victim and freed >= short:
                    break
            progressed = progressed or freed > 0
        return progressed

    def _candidates(self, tier: Tier, exclude: set[Hashable]) -> dict[Hashable, Candidate]:
        return {k: Candidate(k, r.kind, r.footprint, len(r.valid) > 1)
                for k, r in self._records.items()
                if r.claim is None and not r.pins and tier in r.valid and k not in exclude}

    def _evict_victim(self, rec: PartitionRecord, tier: Tier, exclude: set[Hashable],
                      victims: list[MoveHandle]) -> int:
        """Drops `rec`'s clean copy in `tier`, or starts writing its dirty one down without
        waiting; returns the bytes freed or on their way (0: no room below yet)."""
        args = {"key": str(rec.key), "tier": tier.name, "bytes": rec.footprint}
        # A clean copy on a CPU device tier is handed down to HOST where HOST has room,
        # or the policy would rather give up a HOST copy: it costs no copy, and the next
        # fetch finds it there instead of on disk.
        keep = (tier is Tier.DEVICE and self._dev.hand_over and Tier.HOST not in rec.valid
                and self._host_goes_first(rec, exclude))
        if len(rec.valid) > 1 and not keep:
            self._release(tier, rec, rec.drop(tier))
            self._acct.evictions += 1
            self._acct.drops += 1
            self._rec.instant("evict clean", "store", "store:policy", args)
            return rec.footprint
        lower = tier.lower
        steps = plan_evict(rec.valid, lower, self._dev.hand_over)
        needs = needs_of(steps, rec.footprint)
        if not self._acct.fits(needs):
            self._make_room(needs, exclude | {rec.key}, victims)
            if not self._acct.fits(needs):
                return 0
        move = self._new_move("evict", rec.key, lower)
        self._bind(move, rec)
        move.steps = steps
        rec.claim = move
        try:
            self._allocate(move, rec, needs, {s.dst for s in steps if s in _MEMORY_STEPS})
        except BaseException:
            rec.claim = None
            raise
        move.releasing = tier
        self._acct.add_releasing(tier, rec.footprint)
        self._acct.evictions += 1
        self._rec.instant("evict dirty", "store", "store:policy", args)
        victims.append(move)
        self._start(move, rec)
        return rec.footprint

    # [Note: a hand-over swaps]
    # On a CPU device a fetch of a HOST copy to a full DEVICE tier hands the copy up
    # (no bytes copied) once the DEVICE victims the policy chose have left. A
    # victim that has to go down to HOST (its only copy, or a clean one worth
    # keeping) needs room there, which the copy going up is about to give: waiting
    # for it is impossible and making other room costs a write or a drop. So where
    # the victims fit in HOST once the copy has left it, both hand-overs happen at
    # once, under the lock: no budget is exceeded when it is released, no byte moves.
    def _swap_victims(self, rec: PartitionRecord) -> list[PartitionRecord]:
        """The DEVICE copies `_swap_up` would hand down for `rec`; empty where it would not
        swap: unless DEVICE is short of room, no eviction there is in flight, and every
        victim is a resting copy with no HOST copy that fits HOST once `rec` has left
        it."""
        short = rec.footprint - self._acct.room(Tier.DEVICE)
        if short <= 0 or self._acct.releasing(Tier.DEVICE) or Tier.HOST not in rec.valid:
            return []
        cands = {k: c for k, c in self._candidates(Tier.DEVICE, {rec.key}).items()
                 if Tier.HOST not in self._records[k].copies}
        if not cands:
            return []
        keys = self._policy.choose(Tier.DEVICE, short, list(cands.values()))
        if any(k not in cands for k in keys):
            return []
        down = [self._records[k] for k in keys]
        freed = sum(v.footprint for v in down)
        return down if short <= freed <= self._acct.room(Tier.HOST) + rec.footprint else []

    def _swap_up(self, rec: PartitionRecord) -> bool:
        """Hands `rec` (HOST) up to DEVICE and the DEVICE copies the policy gives up in
        its place down to HOST, together; False (nothing changed) where
        `_swap_victims` finds none."""
        down = self._swap_victims(rec)
        if not down:
            return False
        for v in down:
            self._acct.refund(Tier.DEVICE, v.kind, v.footprint)
        self._acct.refund(Tier.HOST, rec.kind, rec.footprint)
        self._acct.charge(Tier.DEVICE, rec.kind, rec.footprint)
        rec.hand_over(Tier.DEVICE)
        self._handed(rec, Tier.HOST, Tier.DEVICE)
        for v in down:
            self._acct.charge(Tier.HOST, v.kind, v.footprint)
            v.hand_over(Tier.HOST)
            self._handed(v, Tier.DEVICE, Tier.HOST)
            self._acct.evictions += 1
            self._rec.instant("evict swap", "store", "store:policy",
                              {"key": str(v.key), "tier": "DEVICE", "bytes": v.footprint})
        for t in (Tier.DEVICE, Tier.HOST):
            self._emit_tier(t)
        return True

    def _host_goes_first(self, rec: PartitionRecord, exclude: set[Hashable]) -> bool:
        """Whether `rec`'s clean DEVICE copy should go down to HOST rather than be dropped:
        True where HOST has room for it, now or on its way (an eviction there in
        flight, perhaps the one this choice started: the copy waits for it), or
        where the policy, choosing in HOST among its copies and this one as if it
        were there, would give up another first: DEVICE and HOST are one memory on
        a CPU device, so the copy needed last should leave, wherever it is."""
        if self._acct.room(Tier.HOST) + self._acct.releasing(Tier.HOST) >= rec.footprint:
            return True
        cands = self._candidates(Tier.HOST, exclude | {rec.key})
        if not cands:
            return False
        me = Candidate(rec.key, rec.kind, rec.footprint, True)
        order = self._policy.choose(Tier.HOST, rec.footprint, [me, *cands.values()])
        return bool(order) and order[0] != rec.key

    def _no_room_message(self, needs: dict[Tier, int], what: str) -> str:
        parts = []
        for t, n in needs.items():
            if n <= self._acct.room(t):
                continue
            residents = [r for r in self._records.values() if t in r.copies]
            shown = "; ".join(
                f"{r.key!r} ({r.kind}, {r.footprint} B, {r.state}"
                + (f", pinned x{r.pins}" if r.pins else "") + (", busy" if r.claim else "") + ")"
                for r in residents[:16])
            more = f"; and {len(residents) - 16} more" if len(residents) > 16 else ""
            puts = [f"{m.key!r} ({m.rec.footprint} B)" for m in self._moves
                    if m.op == "put" and not m.active and t in m.reserved]
            held = f"; reserved by puts still writing their bytes: {', '.join(puts)}" \
                if puts else ""
            parts.append(f"{t} holds {self._acct.used(t)} of {self._acct.budget(t)} bytes "
                         f"({self._acct.releasing(t)} being released), needs {n} more; "
                         f"resident: {shown or 'nothing'}{more}{held}")
        return (f"cannot make room for {what}: " + " | ".join(parts) + ". Unpin or free "
                "partitions, or raise the budget (store.device_budget, store.host_budget, "
                "store.nvme_budget)")

    # -- running moves (see [Note: progress]) ------------------------------------------
    def _new_move(self, op: str, key: Hashable, dst: Tier) -> MoveHandle:
        return MoveHandle(op, key, dst, 0, self._on_wait)

    @staticmethod
    def _bind(move: MoveHandle, rec: PartitionRecord) -> None:
        move.rec = rec
        move.key = rec.key
        move.kind = rec.kind
        move.nbytes = rec.nbytes

    def _plan(self, move: MoveHandle, rec: PartitionRecord, steps: list[Step]) -> None:
        """Sets `move`'s steps and reserves their memory (may evict and wait)."""
        move.steps = steps
        if steps == [Step.HAND_H2D] and self._swap_up(rec):
            move.index = 1  # the step is done: [Note: a hand-over swaps]
        elif steps:
            needs = needs_of(steps, rec.footprint)
            self._reserve(needs, {rec.key}, f"{move.op} of {rec.key!r} to {move.dst}")
            self._allocate(move, rec, needs, {s.dst for s in steps if s in _MEMORY_STEPS})

    def _start(self, move: MoveHandle, rec: PartitionRecord) -> None:
        move.active = True
        self._active += 1
        self._advance(move, rec)

    def _advance(self, move: MoveHandle, rec: PartitionRecord) -> None:
        """Runs synchronous steps; starts the next asynchronous one, or finishes the move."""
        while (step := move.step) is not None:
            if step.is_async:
                self._begin_async(move, rec, step)
                return
            try:
                self._do_sync(move, rec, step)
            except BaseException as e:  # an invariant broke: fail the move, keep the store
                log.exception("%s of partition %r failed at %s", move.op, rec.key, step)
                self._finish_move(move, rec, e)
                return
            move.index += 1
        self._finish_move(move, rec, None)

    # [Note: a pin keeps its copy]
    # `evict` refuses a pinned partition and the policy never picks one, but `pin`
    # takes no claim, so a pin can arrive while an eviction (or an NVME put) of the
    # partition is writing it down. Its view was taken from a copy the move's later
    # drop step would release, and the buffer would be lent to another partition
    # while the pinner still writes through the view. So a drop step leaves a
    # pinned record's copy in place: the write made it clean, nothing is lost, and
    # the move still succeeds. Hand-overs keep their memory, so they need no such care.

    def _do_sync(self, move: MoveHandle, rec: PartitionRecord, step: Step) -> None:
        if step in (Step.HAND_H2D, Step.HAND_D2H):  # see [Note: CPU device tier]
            src, dst = step.src, step.dst
            rec.hand_over(dst)
            move.reserved.pop(dst)  # the bytes reserved in `dst` now hold the handed-over copy
            self._release(src, rec, None)
            self._handed(rec, src, dst)
        elif rec.pins:  # pinned after the move started: [Note: a pin keeps its copy]
            log.debug("%s of partition %r keeps its %s copy: pinned", move.op, rec.key, step.src)
        else:
            self._release(step.src, rec, rec.drop(step.src))
            self._acct.drops += 1

    def _handed(self, rec: PartitionRecord, src: Tier, dst: Tier) -> None:
        """Counts and traces a hand-over of `rec` from `src` to `dst` (no bytes copied)."""
        self._acct.moved(src, dst, rec.nbytes, 0, 0.0)
        args = {"key": str(rec.key), "bytes": rec.nbytes, "copied": 0}
        self._rec.async_end(self._rec.async_begin(f"{src}->{dst}", "store",
                                                  f"store:{src}->{dst}", args), args)

    def _begin_async(self, move: MoveHandle, rec: PartitionRecord, step: Step) -> None:
        memory = move.reserved.pop(step.dst)
        move.step_t0, move.step_t1 = time.perf_counter(), 0.0
        move.token = self._rec.async_begin(f"{step.src}->{step.dst}", "store",
                                           f"store:{step.src}->{step.dst}",
                                           {"key": str(rec.key), "kind": rec.kind,
                                            "bytes": rec.nbytes})
        began = False
        try:
            if step in _READS:
                rec.begin_read(memory, step.dst)
                began = True
                waitable = self._swap(rec.kind).read(rec.copies[Tier.NVME], memory, rec.nbytes)
            elif step is Step.WRITE:
                rec.begin_write(memory)
                began = True
                waitable = self._swap(rec.kind).write(memory, rec.copies[Tier.HOST], rec.nbytes)
            elif step is Step.H2D:
                rec.begin_copy(Tier.DEVICE, memory)
                began = True
                waitable = self._dev.copy_h2d(rec.copies[Tier.HOST], memory, rec.nbytes)
            else:
                rec.begin_copy(Tier.HOST, memory)
                began = True
                waitable = self._dev.copy_d2h(rec.copies[Tier.DEVICE], memory, rec.nbytes)
        except BaseException as e:
            if began:
                memory = self._abort(rec, step)
            self._release(step.dst, rec, memory)
            self._step_failed(move, rec, step, e)
            return
        move.waitable = waitable
        if isinstance(waitable, (IoHandle, ReadHandle)):
            self._in_io[move] = (move.index, waitable)  # see [Note: lost callbacks]
            waitable.add_done_callback(
                lambda _h, m=move, i=move.index, w=waitable: self._io_done(m, i, w))
        else:  # a CUDA event: the completion thread synchronizes it
            self._queue.put((move, move.index, waitable))

    @staticmethod
    def _abort(rec: PartitionRecord, step: Step) -> object:
        if step in _READS:
            return rec.abort_read()
        if step is Step.WRITE:
            return rec.abort_write()
        return rec.abort_copy()

    def _io_done(self, move: MoveHandle, index: int, waitable: object) -> None:
        """On an I/O engine thread, without the lock: hand the step to the completion thread."""
        move.step_t1 = time.perf_counter()
        self._queue.put((move, index, waitable))

    # [Note: lost callbacks]
    # A handle runs its callbacks one after another on the thread that finishes
    # it; one that raises leaves the ones after it uncalled, and a move whose
    # callback is never called would stay in flight for ever. So the completion
    # thread does not rely on callbacks alone: while I/O is in flight it wakes
    # every 50 ms and sweeps `_in_io` for handles that are done. A step reached
    # both ways is finished once (`_complete_one` skips the second).

    def _complete_round(self, item: tuple | None) -> bool:
        """One round of the completion thread: finishes `item` (None: close() ended the
        thread; `_SWEEP`: the steps in `_in_io` whose I/O is done) off the lock (a
        read's checksum is verified here), then starts the next step under the lock.
        False once the thread is to end."""
        if item is None:
            return False
        if item is _SWEEP:
            if not self._in_io:
                return True
            with self._cond:
                items = [(m, i, w) for m, (i, w) in self._in_io.items() if w.done()]
        else:
            items = [item]
        for move, index, waitable in items:
            self._complete_one(move, index, waitable)
        return True

    def _complete_one(self, move: MoveHandle, index: int, waitable: object) -> None:
        error = None
        try:
            if isinstance(waitable, (IoHandle, ReadHandle)):
                waitable.wait()
            else:
                waitable.synchronize()
                move.step_t1 = time.perf_counter()
        except BaseException as e:
            error = e
        with self._cond:
            if move.done() or move.index != index or move.waitable is not waitable:
                return  # reached by a callback and by the sweep: finished already
            self._in_io.pop(move, None)
            try:
                self._complete_step(move, move.rec, error)
            except BaseException as e:
                log.exception("completing %r failed", move)
                if not move.done():
                    self._finish_move(move, move.rec, e)

    def _complete_step(self, move: MoveHandle, rec: PartitionRecord,
                       error: BaseException | None) -> None:
        step = move.step
        if error is not None:
            self._release(step.dst, rec, self._abort(rec, step))
            self._step_failed(move, rec, step, error)
            return
        if step in _READS:
            rec.finish_read()
        elif step is Step.WRITE:
            rec.finish_write()
            self._acct.writes += 1
        else:
            rec.finish_copy()
        t1 = move.step_t1 or time.perf_counter()
        self._acct.moved(step.src, step.dst, rec.nbytes, rec.nbytes, t1 - move.step_t0)
        self._rec.async_end(move.token, {"bytes": rec.nbytes}, ts_ns=int(t1 * 1e9))
        move.index += 1
        self._advance(move, rec)

    def _step_failed(self, move: MoveHandle, rec: PartitionRecord, step: Step,
                     error: BaseException) -> None:
        self._acct.moved(step.src, step.dst, rec.nbytes, 0, 0.0, failed=True)
        self._rec.async_end(move.token, {"error": f"{type(error).__name__}: {error}"})
        where = f"{rec.state} with valid copies in {sorted(t.name for t in rec.valid)}"
        _note(error, f"{move.op} of partition {rec.key!r} failed at {step.src}->{step.dst}; "
                     f"the partition stays {where}")
        log.warning("%s of partition %r failed at %s->%s (%s); it stays %s", move.op, rec.key,
                    step.src, step.dst, error, where)
        self._finish_move(move, rec, error)

    def _finish_move(self, move: MoveHandle, rec: PartitionRecord, error: BaseException | None,
                     unregister: bool = False) -> None:
        for t, memory in list(move.reserved.items()):
            self._release(t, rec, memory)
        move.reserved.clear()
        self._moves.discard(move)
        self._in_io.pop(move, None)
        if move.releasing is not None:
            self._acct.add_releasing(move.releasing, -rec.footprint)
            move.releasing = None
        if move.active:
            move.active = False
            self._active -= 1
        if rec.claim is move:
            rec.claim = None
        if unregister and self._records.get(rec.key) is rec:  # a put that never placed
            del self._records[rec.key]                          # its first copy: its pins
            self._pinners.pop(rec.key, None)                    # go with it
        result = None
        if error is None and move.op == "fetch":
            try:  # the policy's error is the fetch's: the handle finishes, with no pin
                self._policy.touched(rec.key, move.dst)
            except BaseException as e:
                log.exception("eviction policy failed on the fetch of %r", rec.key)
                error = e
            else:
                if move.pin:
                    self._add_pin(rec, move.owner)
                result = self._view(rec, move.dst)
        move._finish(result, error)
        if move.op == "fetch" and self._rec.enabled:  # issue -> arrival: prefetch outcomes
            self._rec.async_end(self._rec.async_begin("fetch", "fetch", "fetch", {
                "key": str(rec.key), "kind": rec.kind, "bytes": rec.nbytes, "steps": "+".join(
                    s.name for s in move.steps)}, ts_ns=int(move.t_start * 1e9)),
                {"error": type(error).__name__} if error else None, ts_ns=int(move.t_done * 1e9))
        self._cond.notify_all()


_SWEEP = ("sweep",)  # no item came within 50 ms: look for I/O done without its callback


def _complete_while_referenced(ref: weakref.ref, items: queue.SimpleQueue,
                               device: torch.device) -> None:
    """The completion thread ([Note: lost callbacks]): rounds of `_complete_round`
    until close() ends it. It holds the store only during a round, so a store dropped
    without close() is collected, and the thread ends; its swap files, buffers and
    I/O engine are then given back by their own finalizers ([Note: an engine dropped
    without close()] in offload/io/engine.py)."""
    bind_thread(device)  # it issues copies: [Note: a GPU per rank] in copy.py
    while True:
        try:
            item = items.get(timeout=0.05)
        except queue.Empty:
            item = _SWEEP
        store = ref()
        if store is None or not store._complete_round(item):
            return
        store = None
