"""Per-unit compute spans and use waits, for an engine's module hooks.

The engine calls these from its hooks, one line each; every call returns at
once when the recorder is off. Emitted on the ``compute`` track (names are the
report's vocabulary, docs/trace.md):

* ``forward:<unit>`` / ``recompute:<unit>``: from the unit's forward pre-hook to
  its forward hook; ``recompute`` when the forward runs inside backward
  (activation-checkpoint recomputation);
* ``backward:<unit>``: from the unit's first pre-backward hook to the next
  unit's, or to the end of backward;
* ``wait:gather`` (cat ``wait``, args ``key``): the compute needs a group's
  full weights from its start and has them at its end (fetch and all-gather).
"""

from __future__ import annotations

import time
from typing import Any, Hashable

from offload.trace.recorder import TraceRecorder

__all__ = ["UnitSpans"]

TRACK = "compute"
_now_ns = time.perf_counter_ns


class _Use:
    __slots__ = ("_rec", "_key", "_t0")

    def __init__(self, rec: TraceRecorder, key: Hashable) -> None:
        self._rec, self._key, self._t0 = rec, key, 0

    def __enter__(self) -> "_Use":
        self._t0 = _now_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._rec.complete("wait:gather", self._t0, _now_ns(), cat="wait", track=TRACK,
                           args={"key": str(self._key)})
        return False


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> "_Nothing":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return False


_NOTHING = _Nothing()


class UnitSpans:
    """Open spans of one engine's units; hook threads call it one at a time (the
    forward runs on one thread, and backward hooks run in order)."""

    __slots__ = ("_rec", "_forward", "_backward", "_step")

    def __init__(self, recorder: TraceRecorder) -> None:
        self._rec = recorder
        self._forward: dict[str, list[int]] = {}    # unit -> start times of open forwards
        self._backward: tuple[str, int] | None = None  # the unit whose backward is open
        self._step: int | None = None  # start of the step in progress, if recorded

    def step_begin(self) -> None:
        """A forward with gradients (or a backward) of a step: the first one since the
        last ``step_end`` starts the step's span."""
        if self._step is None and self._rec.enabled:
            self._step = _now_ns()

    def step_drop(self) -> None:
        """The step's micro-batches were dropped (zero_grad): the next one starts it."""
        self._step = None

    def step_end(self, step: int, error: str | None = None) -> None:
        """Records the ``step`` span, from ``step_begin`` to now, with ``step`` (the
        step's number) and the ``error`` that failed it: each step has its card in
        the report without the loop marking it (a loop's own ``step`` span around it
        is the one the report reads)."""
        if self._step is None:
            return  # began while the recorder was off
        t0, self._step = self._step, None
        args: dict[str, Any] = {"step": step}
        if error is not None:
            args["error"] = error
        self._rec.complete("step", t0, _now_ns(), cat="compute", track=TRACK, args=args)

    def forward_begin(self, unit: str) -> None:
        if self._rec.enabled:
            self._forward.setdefault(unit, []).append(_now_ns())

    def forward_end(self, unit: str, in_backward: bool) -> None:
        """Ends the unit's innermost open forward; a recomputation when ``in_backward``."""
        starts = self._forward.get(unit)
        if not starts:
            return  # began while the recorder was off
        t0 = starts.pop()
        phase = "recompute" if in_backward else "forward"
        self._rec.complete(f"{phase}:{unit}", t0, _now_ns(), cat="compute", track=TRACK,
                           args={"unit": unit})

    def backward_begin(self, unit: str) -> None:
        """The unit's backward starts: ends the open one of another unit."""
        if self._backward is not None and self._backward[0] == unit:
            return
        self.backward_end()
        if self._rec.enabled:
            self._backward = (unit, _now_ns())

    def backward_end(self) -> None:
        """Ends the open backward span, if any (call when backward returns)."""
        if self._backward is None:
            return
        unit, t0 = self._backward
        self._backward = None
        self._rec.complete(f"backward:{unit}", t0, _now_ns(), cat="compute", track=TRACK,
                           args={"unit": unit})

    def use(self, key: Hashable) -> _Use | _Nothing:
        """Context manager timing the compute's wait for record ``key``."""
        return _Use(self._rec, key) if self._rec.enabled else _NOTHING
