"""Python's thread switch interval, shortened while engines are open.

[Note: switch interval]
I/O completions run on Python threads (the AIO reaper, the thread engine's
workers) and wait up to `sys.getswitchinterval()` behind a thread busy in
Python, so an open engine asks for a shorter one (io.switch_interval). The
setting is the process's, and several engines may be open at once: each asks
through a `SwitchIntervalHold`. The first hold saves Python's interval, the
shortest interval asked for by an open hold is the one in effect, and the
last release restores the saved one, so closing one of two engines changes
nothing the other relies on. A hold that is garbage-collected unreleased is
released then. The count lives in one process-wide object because the
setting it guards is process-wide.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref

__all__ = ["SwitchIntervalHold", "hold_switch_interval"]


class _ProcessSwitchInterval:
    """The open holds of this process and the interval to restore after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[int, float] = {}  # hold -> seconds it asked for
        self._saved: float | None = None    # Python's interval before the first hold
        self._tokens = itertools.count()

    def acquire(self, seconds: float) -> int:
        with self._lock:
            token = next(self._tokens)
            if not self._asked:
                self._saved = sys.getswitchinterval()
            self._asked[token] = seconds
            sys.setswitchinterval(min(self._asked.values()))
            return token

    def release(self, token: int) -> None:
        with self._lock:
            if self._asked.pop(token, None) is None:
                return
            if self._asked:
                sys.setswitchinterval(min(self._asked.values()))
            elif self._saved is not None:  # the last hold: Python's own interval again
                sys.setswitchinterval(self._saved)
                self._saved = None

    @property
    def holds(self) -> int:
        with self._lock:
            return len(self._asked)


_PROCESS = _ProcessSwitchInterval()


class SwitchIntervalHold:
    """Asks for a switch interval of `seconds` until `release()` (0: asks nothing)."""

    def __init__(self, seconds: float) -> None:
        if not 0.0 <= seconds <= 1.0:
            raise ValueError(f"switch interval {seconds} s is out of range; use 0 (leave "
                             "Python's) or seconds up to 1")
        self.seconds = seconds
        self._release = None
        if seconds > 0:
            token = _PROCESS.acquire(seconds)
            self._release = weakref.finalize(self, _PROCESS.release, token)

    @property
    def held(self) -> bool:
        return self._release is not None and self._release.alive

    def release(self) -> None:
        """Gives the hold back; the last one restores Python's interval. Idempotent."""
        if self._release is not None:
            self._release()


def hold_switch_interval(seconds: float) -> SwitchIntervalHold:
    """A hold on the process's switch interval; see [Note: switch interval]."""
    return SwitchIntervalHold(seconds)
