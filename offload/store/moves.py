"""Moves between tiers: the steps of a fetch or an eviction (pure planning) and their handle.

A move is a short chain of steps over one record, e.g. fetching a partition
from NVMe to a GPU is READ (NVME->HOST) then H2D (HOST->DEVICE); to a CPU
device, one READ_DEVICE (NVME->DEVICE, see [Note: CPU device tier] in
copy.py). The store
reserves every step's destination before the first step starts, so a move in
flight never waits for memory: it finishes on its own, which is what lets
callers wait for in-flight moves to free budget (see [Note: making room] in
store.py).
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Callable, Hashable, NamedTuple

import torch

from .record import Tier

__all__ = ["MoveHandle", "Step", "plan_evict", "plan_fetch", "needs_of"]


class _StepInfo(NamedTuple):
    src: Tier | None
    dst: Tier | None
    is_async: bool


class Step(enum.Enum):
    """One step of a move; `src`/`dst` are the tiers it moves bytes between."""

    READ = _StepInfo(Tier.NVME, Tier.HOST, True)
    READ_DEVICE = _StepInfo(Tier.NVME, Tier.DEVICE, True)  # into DEVICE memory (CPU device)
    WRITE = _StepInfo(Tier.HOST, Tier.NVME, True)
    H2D = _StepInfo(Tier.HOST, Tier.DEVICE, True)        # a copy (CUDA)
    D2H = _StepInfo(Tier.DEVICE, Tier.HOST, True)
    HAND_H2D = _StepInfo(Tier.HOST, Tier.DEVICE, False)  # a hand-over, no copy (CPU device)
    HAND_D2H = _StepInfo(Tier.DEVICE, Tier.HOST, False)
    DROP_DEVICE = _StepInfo(Tier.DEVICE, None, False)    # give up a clean copy
    DROP_HOST = _StepInfo(Tier.HOST, None, False)

    @property
    def src(self) -> Tier | None:
        return self.value.src

    @property
    def dst(self) -> Tier | None:
        return self.value.dst

    @property
    def is_async(self) -> bool:
        return self.value.is_async

    def __repr__(self) -> str:
        return f"Step.{self.name}"


def _copy_to(valid: set[Tier], to: Tier, hand_over: bool, steps: list[Step]) -> None:
    """Appends the steps that make `to` valid; updates `valid` as they would."""
    if to in valid:
        return
    if to is Tier.DEVICE:
        if hand_over and Tier.HOST not in valid and Tier.NVME in valid:
            steps.append(Step.READ_DEVICE)  # see [Note: CPU device tier] in copy.py
            valid.add(to)
            return
        if Tier.HOST not in valid:
            _copy_to(valid, Tier.HOST, hand_over, steps)
        steps.append(Step.HAND_H2D if hand_over else Step.H2D)
        if hand_over:
            valid.discard(Tier.HOST)
    elif to is Tier.HOST:
        if Tier.DEVICE in valid:
            steps.append(Step.HAND_D2H if hand_over else Step.D2H)
            if hand_over:
                valid.discard(Tier.DEVICE)
        elif Tier.NVME in valid:
            steps.append(Step.READ)
        else:
            raise RuntimeError(f"no valid copy to fetch from (valid {sorted(valid)})")
    else:
        _copy_to(valid, Tier.HOST, hand_over, steps)
        steps.append(Step.WRITE)
    valid.add(to)


def plan_fetch(valid: set[Tier] | frozenset[Tier], to: Tier, hand_over: bool) -> list[Step]:
    """Steps that give a record with copies in `valid` a valid copy in `to`.

    Copies elsewhere stay, except a hand-over's source (see copy.py).
    """
    if to is Tier.NVME:
        raise ValueError("fetch moves a copy up, to HOST or DEVICE; use evict(to=NVME) to "
                         "write a partition down")
    steps: list[Step] = []
    _copy_to(set(valid), to, hand_over, steps)
    return steps


def plan_evict(valid: set[Tier] | frozenset[Tier], to: Tier, hand_over: bool) -> list[Step]:
    """Steps that leave a record with no copy above `to` and a valid one in `to`.

    A clean copy is dropped without writing; a dirty one is written down first.
    A record with no copy at or above `to` is left alone (eviction never reads up).
    """
    v = set(valid)
    if not any(t <= to for t in v):
        return []
    steps: list[Step] = []
    if to is Tier.NVME and Tier.NVME not in v:
        _copy_to(v, Tier.HOST, hand_over, steps)
        if Tier.DEVICE in v:  # the HOST copy holds the value now: free the GPU early
            steps.append(Step.DROP_DEVICE)
            v.discard(Tier.DEVICE)
        steps.append(Step.WRITE)
        v.add(Tier.NVME)
    else:
        _copy_to(v, to, hand_over, steps)
    for t in (Tier.DEVICE, Tier.HOST):
        if t < to and t in v:
            steps.append(Step.DROP_DEVICE if t is Tier.DEVICE else Step.DROP_HOST)
            v.discard(t)
    return steps


def needs_of(steps: list[Step], nbytes: int) -> dict[Tier, int]:
    """Bytes each tier must have free before `steps` start (one copy per destination)."""
    needs: dict[Tier, int] = {}
    for s in steps:
        if s.dst is not None:
            needs[s.dst] = needs.get(s.dst, 0) + nbytes
    return needs


class MoveHandle:
    """The future of one move (put, fetch or evict) of partition `key`.

    `wait()` blocks until the move finished and raises its error if it failed;
    for a fetch it returns the tensor view in the destination tier (valid until
    the partition is evicted or freed: fetch with pin=True to keep it), else None.
    """

    def __init__(self, op: str, key: Hashable, dst: Tier, nbytes: int,
                 on_wait: Callable[[MoveHandle, float, float], None] | None = None) -> None:
        self.op = op
        self.key = key
        self.dst = dst
        self.nbytes = nbytes
        self._on_wait = on_wait
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: torch.Tensor | None = None
        self.t_start = time.perf_counter()
        self.t_done = 0.0
        # -- the store's execution state, touched only under its lock --
        self.steps: list[Step] = []
        self.index = 0
        self.reserved: dict[Tier, object] = {}   # reserved destination memory (None: bytes only)
        self.kind = ""
        self.rec: object = None                 # the PartitionRecord moved
        self.pin = False
        self.owner = threading.get_ident()     # the thread that asked: it holds the pin
        self.releasing: Tier | None = None      # the tier this eviction frees, while in flight
        self.active = False                     # counted in the store's moves in flight
        self.waitable: object = None            # IoHandle / ReadHandle / cuda Event of the step
        self.step_t0 = 0.0
        self.step_t1 = 0.0
        self.token: object = None

    @property
    def step(self) -> Step | None:
        return self.steps[self.index] if self.index < len(self.steps) else None

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        """Blocks until the move finished; returns the fetched view (fetch) or None."""
        if not self._done.is_set():
            t0 = time.perf_counter()
            finished = self._done.wait(timeout)
            if self._on_wait is not None:
                self._on_wait(self, t0, time.perf_counter())
            if not finished:
                raise TimeoutError(f"{self.op} of partition {self.key!r}: not done after "
                                   f"{timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def settle(self) -> bool:
        """Waits until the move finished, through interrupts (a KeyboardInterrupt while
        waiting is dropped: the caller is already unwinding from one, or from the
        move's own error); True if it succeeded. A fetch with `pin` holds its pin only
        once it succeeded, so whoever gives the pin back settles the fetch first."""
        while not self._done.is_set():
            try:
                self._done.wait()
            except KeyboardInterrupt:
                continue
        return self._error is None

    def _finish(self, result: torch.Tensor | None, error: BaseException | None) -> None:
        self._result = result
        self._error = error
        self.t_done = time.perf_counter()
        self.waitable = None
        self._done.set()

    def __repr__(self) -> str:
        state = ("failed" if self._error else "done") if self.done() else \
            f"step {self.index + 1}/{len(self.steps)}"
        return f"MoveHandle({self.op} {self.key!r} -> {self.dst}, {self.nbytes} B, {state})"
