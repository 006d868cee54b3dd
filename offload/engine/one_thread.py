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
directly (through a pre-hook on its root module), as is a unit's module called by
itself (a submodule, outside every call of its thread: `unit_enter`; it passed
unchecked, and a second thread's `model[1](x)` beside a training loop freed and
re-gathered the loop's weights under it: steps failed, or trained on other
numbers than torch's). A call from a second thread
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
`_call_impl` frame is no longer on its thread's stack, and it is dropped (the other
calls stay); so is a call whose end was cut short (two Ctrl-Cs in `held`'s
`finally`, or one before the generator resumed: [Note: a lock and Ctrl-C]): the
frame whose `with` held it has left the stack (a call held from a generator stays:
its frame leaves the stack at each `yield`); and so are the calls of a thread that
has ended. A call ends on whichever thread ends it (a `full_weights_by_group`
generator closed or collected on another thread).

[Note: a lock and Ctrl-C]
A call is entered before the engine's Ctrl-C deferral starts and left after it ends
([Note: Ctrl-C at a safe point] in interrupts.py), so a KeyboardInterrupt can land at
any line of that bookkeeping; a call left recorded refuses every later `step()` and
`close()`, a lock left held hangs them. So each `with self._lock:` is one line whose
body is one call: a `with` spread over lines has a line of its own at its end, where
the lock is still held (a handler run at that line raises past the release; on one
line nothing runs between the body's end and the release). `enter` hands the call to
`held` before recording it, and `held` leaves it twice, the second time where a
KeyboardInterrupt cut the first short.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
from typing import Any, Callable, Iterator

__all__ = ["EngineBusyError", "OneThread", "one_call"]


class EngineBusyError(RuntimeError):
    """An engine call refused because another call holds the engine ([Note: one thread at
    a time]); nothing was changed."""


class _Call:
    """One call in progress; `enter` returns it, and `leave_to` takes it back on any
    thread (a generator's `finally` runs on the thread that closes or collects it)."""

    __slots__ = ("what", "sealed", "direct", "frame")

    def __init__(self, what: str, sealed: bool, direct: bool,
                 frame: types.FrameType | None) -> None:
        self.what = what      # "engine.step()", for messages
        self.sealed = sealed  # nothing nests inside it
        self.direct = direct  # the model called directly: ended by `leave()`
        self.frame = frame    # a frame on the stack while the call runs (or None): a
        # direct call's `_call_impl`, or the frame whose `with` holds the call (held, not
        # its id: a frame freed at the call's end gives its address to the next one)


def _caller_frame() -> types.FrameType | None:
    """The `_call_impl` frame running the root module's hooks, None if none is found."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            break
        if f.f_code.co_name == "_call_impl":
            return f
        f = f.f_back
    return None


_SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _holder_frame() -> types.FrameType | None:
    """The frame whose `with` runs `held` (its caller through contextlib's `__enter__`),
    None where that frame is a generator's or a coroutine's."""
    f = sys._getframe(3)  # this ← held ← contextlib's __enter__ ← the `with`
    return None if f.f_code.co_flags & _SUSPENDS else f


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
        self._units = threading.local()  # the units whose direct call this thread tried

    def daemon_busy(self) -> bool:
        """Whether a daemon thread other than this one is inside a call."""
        with self._lock: return self._daemon_busy()  # noqa: E701 - [Note: a lock and Ctrl-C]

    def _daemon_busy(self) -> bool:
        if self._calls and self._thread != threading.get_ident():
            self._drop_finished()
        return bool(self._calls) and self._thread != threading.get_ident() and self._daemon

    def _refusal(self, what: str, outer: bool) -> str | None:
        """Why `what` cannot start now on this thread, or None."""
        if not self._calls:
            return None
        first, last = self._calls[0].what, self._calls[-1]
        name = threading.current_thread().name
        if self._thread != threading.get_ident() and name.startswith("offload-"):
            return (f"{what} was called from the engine's own thread {name!r}, inside "
                    f"{first} (from an lr_lambda or another function the engine runs for "
                    "it): it would use or change the state that call is in the middle of. "
                    f"Nothing was changed: call it after {first} has returned")
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

    def _holds(self) -> bool:
        """Whether this thread is inside a call."""
        return bool(self._calls) and self._thread == threading.get_ident()

    def _drop_finished(self) -> None:
        """Drops what can no longer be running: every call of a thread that has ended,
        and calls whose end was cut short (their frame has left the stack)."""
        frame = sys._current_frames().get(self._thread)
        if frame is None:  # the holding thread has ended
            self._calls.clear()
            return
        live = set()
        while frame is not None:
            live.add(id(frame))
            frame = frame.f_back
        self._calls = [c for c in self._calls if c.frame is None or id(c.frame) in live]

    def enter(self, what: str = "the model's forward", *, outer: bool = False,
              sealed: bool = False, direct: bool = False,
              frame: types.FrameType | None = None, into: list[_Call] | None = None) -> _Call:
        """Starts `what` on this thread, or raises `EngineBusyError` saying why not (and
        changes nothing); returns the call, to give `leave_to`. `outer`: only outside
        every other call; `sealed`: nothing nests inside; `direct`: the model called
        directly, ended by `leave()` from its forward hook; `frame`: a frame on the stack
        until the call ends; `into`: gets the call before it is recorded."""
        if self.exiting and threading.current_thread().daemon:
            raise SystemExit  # a daemon thread's next call at exit: the thread ends quietly
            # (a non-daemon one is joined by the exit: it goes on)
        call = _Call(what, sealed, direct, _caller_frame() if direct else frame)
        if into is not None:
            into.append(call)
        with self._lock: return self._enter(call, outer)  # noqa: E701 - [Note: a lock and Ctrl-C]

    def _enter(self, call: _Call, outer: bool) -> _Call:
        why = self._refusal(call.what, outer)
        if why is not None:
            self._drop_finished()
            why = self._refusal(call.what, outer)
        if why is not None:
            if call.direct:
                self._refused.n = getattr(self._refused, "n", 0) + 1
            raise EngineBusyError(why)
        if not self._calls:
            me = threading.current_thread()
            self._thread, self._name, self._daemon = threading.get_ident(), me.name, me.daemon
        self._calls.append(call)
        return call

    def direct_only(self) -> bool:
        """Whether this thread's only call is a direct call of the model."""
        with self._lock: return self._direct_only()  # noqa: E701 - [Note: a lock and Ctrl-C]

    def _direct_only(self) -> bool:
        return (len(self._calls) == 1 and self._calls[0].direct
                and self._thread == threading.get_ident()
                and not getattr(self._refused, "n", 0))

    def unit_enter(self, name: str, unit: int) -> None:
        """Unit `name`'s module called by itself, outside every call of this thread: a
        direct call of its own in this guard, entered or refused as the model's
        (`unit_leave` ends it); inside a call of this thread that a forward may nest in
        (the model's, `engine(...)`), nothing; inside a sealed one (a step's lr
        schedule), refused as the model is."""
        with self._lock: mine = self._holds()  # noqa: E701 - [Note: a lock and Ctrl-C]
        if mine and not self._calls[-1].sealed:
            return
        tried = self._units.__dict__.setdefault("tried", [])
        if not mine:  # what is left was cut short (a Ctrl-C skips the unit's forward hook)
            tried.clear()
        tried.append([unit, None])
        tried[-1][1] = self.enter(f"the forward of unit {name}", direct=True)

    def unit_leave(self, unit: int, entered: bool) -> bool:
        """The unit's forward hook: ends the direct call `unit_enter` tried for it, where
        it was `entered` (or refused: its leave counted). Whether there was one. A call
        of an earlier forward whose hook a Ctrl-C skipped (not this `_call_impl`'s)
        is dropped alone, and the calls made since are left as they are."""
        tried = self._units.__dict__.get("tried")
        if not tried or tried[-1][0] != unit or (tried[-1][1] is not None) != entered:
            return False
        call = tried.pop()[1]
        if call is None:
            self.leave()
        elif call.frame is None or call.frame is _caller_frame():
            self.leave_to(call)
        else:
            with self._lock: self._forget(call)  # noqa: E701 - [Note: a lock and Ctrl-C]
        return True

    def _forget(self, call: _Call) -> None:
        self._calls = [c for c in self._calls if c is not call]

    def refused_here(self) -> bool:
        """Whether this thread's direct call was refused and awaits its leave: its forward
        hook changes nothing of the call that holds the engine (on another thread)."""
        return getattr(self._refused, "n", 0) > 0

    def leave(self) -> None:
        """A direct call of the model ends (its forward hook)."""
        with self._lock: self._leave()  # noqa: E701 - [Note: a lock and Ctrl-C]

    def _leave(self) -> None:
        if getattr(self._refused, "n", 0):
            self._refused.n -= 1
        elif self._calls and self._thread == threading.get_ident() and self._calls[-1].direct:
            self._calls.pop()

    def leave_to(self, call: _Call) -> None:
        """`call` ends, and any call left inside it; on whichever thread ends it (a call
        already ended: nothing)."""
        with self._lock: self._leave_to(call)  # noqa: E701 - [Note: a lock and Ctrl-C]

    def _leave_to(self, call: _Call) -> None:
        for i, c in enumerate(self._calls):
            if c is call:
                del self._calls[i:]
                return

    @contextlib.contextmanager
    def held(self, what: str, *, outer: bool = False, sealed: bool = False) -> Iterator[None]:
        """`what` as one call ([Note: a lock and Ctrl-C]: it ends though a KeyboardInterrupt
        lands at any one line of its end)."""
        started: list[_Call] = []
        try:
            try:
                self.enter(what, outer=outer, sealed=sealed, frame=_holder_frame(),
                           into=started)
                yield
            finally:
                for call in started:
                    self.leave_to(call)
        finally:  # again, where a KeyboardInterrupt cut the first short
            for call in started:
                self.leave_to(call)


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
