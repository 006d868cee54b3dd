"""Per-request futures of the I/O layer.

[Note: two completion events]
A write has two moments a caller may care about, and they are different
events (as in tensorstore): *released* - every byte has left the caller's
buffer, so the buffer may be reused or freed; and *done* - the data is
durable (after fdatasync when `io.sync_writes` is on). For a read both happen
together: when the bytes are in the buffer. `wait()` waits for *done*;
`wait_released()` for *released*. A handle that failed raises its `IoError`
from both, every time it is waited on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .errors import IoError

__all__ = ["IoHandle"]

log = logging.getLogger(__name__)


class IoHandle:
    """The future of one read or write request, possibly split into many blocks.

    Completion is counted per block by the engine (`_block_done`), never by
    the caller; each handle waits for exactly its own blocks.
    """

    __slots__ = ("op", "nbytes", "describe", "_lock", "_released", "_done", "_pending",
                 "_error", "_callbacks", "_keepalive", "t_submit", "t_done")

    def __init__(self, op: str, nbytes: int, describe: str, keepalive: object = None) -> None:
        self.op = op
        self.nbytes = nbytes
        self.describe = describe
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._done = threading.Event()
        self._pending = 0
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IoHandle], None]] = []
        # The buffer's owner stays referenced until the kernel is done with it.
        self._keepalive = keepalive
        self.t_submit = time.perf_counter()
        self.t_done = 0.0

    # -- engine side -------------------------------------------------------
    def _add_blocks(self, n: int) -> None:
        with self._lock:
            self._pending += n

    def _block_done(self, error: BaseException | None = None) -> bool:
        """Records one finished block; returns True when it was the last one."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            if self._pending < 0:
                raise RuntimeError(f"{self.describe}: more completions than blocks submitted")
            return self._pending == 0

    def _mark_released(self) -> None:
        self._released.set()

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:  # done is set under the lock add_done_callback checks it under
            if error is not None and self._error is None:
                self._error = error
            callbacks, self._callbacks = self._callbacks, []
            self.t_done = time.perf_counter()
            self._keepalive = None
            self._released.set()
            self._done.set()
        for cb in callbacks:
            self._call(cb)

    def _call(self, fn: Callable[[IoHandle], None]) -> None:
        # A callback runs on the engine's completion thread: one that raised
        # killed the AIO reaper (every later request hung) and skipped the
        # callbacks after it (the swap space's checksum record among them).
        try:
            fn(self)
        except Exception:
            log.exception("%s: a done callback (%r) raised; the request itself is %s",
                          self.describe, fn, "failed" if self._error else "done")

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- caller side -------------------------------------------------------
    def done(self) -> bool:
        """True once the request finished, successfully or not (never blocks)."""
        return self._done.is_set()

    def released(self) -> bool:
        """True once the caller's buffer may be reused."""
        return self._released.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until done; returns the bytes transferred or raises the `IoError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.describe}: not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.nbytes

    def wait_released(self, timeout: float | None = None) -> None:
        """Blocks until the buffer may be reused; raises the `IoError` if it failed."""
        if not self._released.wait(timeout):
            raise TimeoutError(f"{self.describe}: buffer still in flight after {timeout} s")
        if self._error is not None:  # recorded under the lock before release is signalled
            raise self._error

    def add_done_callback(self, fn: Callable[[IoHandle], None]) -> None:
        """Calls fn(handle) once done (at once, here, if it is already done)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)  # on the caller's thread: its exception is the caller's

    @property
    def seconds(self) -> float:
        """Seconds from submission to completion (0 while in flight)."""
        return self.t_done - self.t_submit if self.t_done else 0.0

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "in flight"
        return f"IoHandle({self.describe}, {self.nbytes} B, {state})"


def gather(handles: list[IoHandle], timeout: float | None = None) -> int:
    """Waits for every handle (all of them, even after one failed); raises the first error."""
    first: BaseException | None = None
    total = 0
    deadline = None if timeout is None else time.perf_counter() + timeout
    for h in handles:
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        try:
            total += h.wait(left)
        except (IoError, TimeoutError) as e:
            first = first or e
    if first is not None:
        raise first
    return total
