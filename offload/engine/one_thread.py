"""[Note: one thread at a time]
Two threads' forwards through one engine would share, and free under each other,
its gathered weights: outputs silently wrong, or a parameter read after its unit
gave it back; a step beside a forward (or another step, a `zero_grad`, a save, a
`close`) changes the partitions the other call is reading: a forward made of old
and new weights, a step failed on a partition the other call pinned, its
gradients dropped. So every engine call runs inside a `OneThread`: `engine(...)`,
`generate`, `backward`, `step`, `zero_grad`, `state_dict`, `load_state_dict`,
`save_pretrained`, `save_checkpoint` (its part on the caller's thread), `close`,
each group of `named_weights`, a whole `full_weights` block, and the model called
directly (through a pre-hook on its root module). A call from a second thread
while the first one's runs is refused before it touches anything, naming the thread
that holds the engine and its call (a refusal, never a wait: a wait could deadlock
on a thread that waits for the caller).

Calls nest on one thread (a forward inside `generate`, the root module inside
`engine(...)`, a forward inside a `full_weights` block), except those that change
the training state: `backward`, `step`, `zero_grad`, `load_state_dict`,
`save_checkpoint`, `close` and a writable `full_weights` block start only outside
every other call (not from a forward hook, an autograd hook, an lr schedule), and
nothing nests inside the first six (a model call from an lr schedule would see a
step half done).

A refused direct call's leave (torch calls forward hooks with `always_call` after
the pre-hook raised) is counted per thread and changes nothing. A direct call whose
leave torch skipped (a `KeyboardInterrupt` or `SystemExit` inside the model, for
which `always_call` hooks do not run) is recognised at the next conflict: its
`_call_impl` frame is no longer on its thread's stack, and it is dropped; so are
the calls of a thread that has ended. A call ends on whichever thread ends it (a
`full_weights_by_group` generator closed or collected on another thread).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator

__all__ = ["EngineBusyError", "OneThread", "one_call"]


class EngineBusyError(RuntimeError):
    """An engine call refused because another call holds the engine ([Note: one thread at
    a time]); nothing was changed."""


class _Call:
    """One call in progress; `enter` returns it, and `leave_to` takes it back on any
    thread (a generator's `finally` runs on the thread that closes or collects it)."""

    __slots__ = ("what", "sealed", "direct", "frame")

    def __init__(self, what: str, sealed: bool, direct: bool, frame: int) -> None:
        self.what = what      # "engine.step()", for messages
        self.sealed = sealed  # nothing nests inside it
        self.direct = direct  # the model called directly: ended by `leave()`
        self.frame = frame    # a direct call: id of its `_call_impl` frame (0: not found)


def _caller_frame() -> int:
    """id of the `_call_impl` frame running the root module's hooks, 0 if none is found."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            break
        if f.f_code.co_name == "_call_impl":
            return id(f)
        f = f.f_back
    return 0


class OneThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # enter/leave are check-then-set
        self._thread = 0  # the thread whose calls are in `_calls`
        self._name = ""
        self._calls: list[_Call] = []  # in progress, outermost first
        self._refused = threading.local()  # refused direct calls awaiting their leave
        self.exiting = False  # the interpreter is releasing the engine: [Note: an engine
        # open at interpreter exit] in owned.py
        self._daemon = False  # whether the thread in `_calls` is a daemon thread

    def daemon_busy(self) -> bool:
        """Whether a daemon thread other than this one is inside a call."""
        with self._lock:
            if self._calls and self._thread != threading.get_ident():
                self._drop_finished()
            return bool(self._calls) and self._thread != threading.get_ident() and self._daemon

    def _refusal(self, what: str, outer: bool) -> str | None:
        """Why `what` cannot start now on this thread, or None."""
        if not self._calls:
            return None
        first, last = self._calls[0].what, self._calls[-1]
        if self._thread != threading.get_ident():
            return (f"{what} on thread {threading.current_thread().name!r}: this engine is "
                    f"running on another thread: one thread at a time runs it (thread "
                    f"{self._name!r} is in {first}; two threads would share its gathered "
                    "weights and its step's state). Nothing was changed: run the calls one "
                    "after the other (e.g. under a threading.Lock of your own), or give each "
                    "thread an engine of its own")
        if outer or last.sealed:
            return (f"{what} was called inside {last.what} on the same thread (from a hook, "
                    "a callback or an lr schedule, or after a loop left a generator of it "
                    "open: close it, or finish the loop): it would use or change the state "
                    f"that call is in the middle of. Nothing was changed: call it after "
                    f"{last.what} has returned")
        return None

    def _drop_finished(self) -> None:
        """Drops what can no longer be running: every call of a thread that has ended,
        and direct calls whose leave torch skipped (their frame has left the stack)."""
        frame = sys._current_frames().get(self._thread)
        if frame is None:  # the holding thread has ended
            self._calls.clear()
            return
        live = set()
        while frame is not None:
            live.add(id(frame))
            frame = frame.f_back
        for i, call in enumerate(self._calls):
            if call.frame and call.frame not in live:
                del self._calls[i:]
                return

    def enter(self, what: str = "the model's forward", *, outer: bool = False,
              sealed: bool = False, direct: bool = False) -> _Call:
        """Starts `what` on this thread, or raises `EngineBusyError` saying why not (and
        changes nothing); returns the call, to give `leave_to`. `outer`: only outside
        every other call; `sealed`: nothing nests inside; `direct`: the model called
        directly, ended by `leave()` from its forward hook."""
        if self.exiting and threading.current_thread().daemon:
            raise SystemExit  # a daemon thread's next call at exit: the thread ends quietly
            # (a non-daemon one is joined by the exit: it goes on)
        with self._lock:
            why = self._refusal(what, outer)
            if why is not None:
                self._drop_finished()
                why = self._refusal(what, outer)
            if why is not None:
                if direct:
                    self._refused.n = getattr(self._refused, "n", 0) + 1
                raise EngineBusyError(why)
            if not self._calls:
                me = threading.current_thread()
                self._thread, self._name, self._daemon = threading.get_ident(), me.name, me.daemon
            call = _Call(what, sealed, direct, _caller_frame() if direct else 0)
            self._calls.append(call)
            return call

    def leave(self) -> None:
        """A direct call of the model ends (its forward hook)."""
        with self._lock:
            if getattr(self._refused, "n", 0):
                self._refused.n -= 1
            elif self._calls and self._thread == threading.get_ident() \
                    and self._calls[-1].direct:
                self._calls.pop()

    def leave_to(self, call: _Call) -> None:
        """`call` ends, and any call left inside it; on whichever thread ends it."""
        with self._lock:
            for i, c in enumerate(self._calls):
                if c is call:
                    del self._calls[i:]
                    return

    @contextlib.contextmanager
    def held(self, what: str, *, outer: bool = False, sealed: bool = False) -> Iterator[None]:
        call = self.enter(what, outer=outer, sealed=sealed)
        try:
            yield
        finally:
            try:  # the engine's own Ctrl-C deferral has ended by now (it is inside)
                self.leave_to(call)
            except KeyboardInterrupt:  # one that lands here: the call ends all the same
                self.leave_to(call)
                raise


def one_call(what: str, *, outer: bool = False, sealed: bool = False) -> Callable:
    """An engine method run as one call of [Note: one thread at a time], after the
    engine's `_check_open()`."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._check_open()
            with self._one_thread.held(what, outer=outer, sealed=sealed):
                return method(self, *args, **kwargs)
        return call
    return wrap
