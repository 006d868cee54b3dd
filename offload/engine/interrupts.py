"""[Note: Ctrl-C at a safe point]
SIGINT raises KeyboardInterrupt at whatever line the main thread runs. In the
user's model or in torch, that is like any error of the model's: the engine's
calls undo what they started. Inside the engine's and the store's own
bookkeeping it is not: a move registered and not yet queued waits forever, a
pin taken and not yet recorded is never given back, and the engine is unusable
or trains on wrong state. So while an engine call runs (`engine(...)`,
`backward`, `step`, `zero_grad`, `generate`, the model called directly,
`state_dict`, `load_state_dict`, `save_pretrained`, a blocking save, the
gathering and the write-back of a `full_weights` block: `around_user_block`,
`close()`, `initialize` placing the partitions, a safe point before each group), the
engine's SIGINT handler looks at the line it interrupted: in offload's code it
notes the interrupt and returns, and the KeyboardInterrupt is raised at the next
safe point instead: the start of the next unit's hook, or the end of the call.
Anywhere else (the model's forward, torch) it raises at once, as Python's
handler would, except inside a direct call of the model, whose cleanup runs in
a forward hook that torch skips for a KeyboardInterrupt: there the interrupt
waits for the model's forward to end (one call of `generate`'s loop).

A second Ctrl-C while one is noted raises at once wherever it lands (a wait
that never ends can still be interrupted); the engine's state in memory may then
be inconsistent, and every later call raises, saying so. The handler is
installed only on the main thread (the only one Python delivers signals to).
A handler the program installed in Python for SIGINT or for a signal it uses to
stop or time out (SIGTERM, SIGALRM, SIGHUP, SIGUSR1, SIGUSR2) is deferred the
same way: one that raises (a timeout, `sys.exit`) left pins and moves half
recorded as Ctrl-C did; it runs at the safe point (given a frame of the
engine's there). Only a second Ctrl-C is obeyed at once; another signal noted again
stays noted, as the kernel merges a pending signal's repeats (a periodic
timer). Each noted handler runs even where an earlier one raised. [Note: no
interrupt mid-commit] in step.py keeps the commit whole either way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
import sys
import sysconfig
import threading
from types import FrameType
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

__all__ = ["SafeInterrupts", "around_user_block", "guarded"]

_OFFLOAD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _package_dir(name: str) -> str | None:
    """The directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or ()) if spec is not None else []
    return os.path.abspath(places[0]) + os.sep if places else None


# code that runs on behalf of its caller: a frame of it belongs to whoever called it.
# libaio's too: a KeyboardInterrupt inside its submit() after io_submit returned made it
# forget requests the kernel took, whose completions then killed the reaper thread.
_LIBRARIES = tuple({os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                    sysconfig.get_paths()["stdlib"] + os.sep,
                    sysconfig.get_paths()["platstdlib"] + os.sep, "<",
                    *filter(None, [_package_dir("libaio"), _package_dir("numpy")])})


def in_offload(frame: FrameType | None) -> bool:
    """The line `frame` runs is offload's own, or torch's or the standard library's on
    offload's behalf."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OFFLOAD):
            return True
        if not name.startswith(_LIBRARIES):
            return False
        frame = frame.f_back
    return False


# signals whose Python handler an engine call defers from its own code: Ctrl-C, and
# those a program handles itself to stop or time out (not the profilers' timers, whose
# handlers sample the line they interrupt)
DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


class SafeInterrupts:
    """Defers Ctrl-C, and every signal the program handles in Python, inside the
    engine's code to a safe point ([Note: Ctrl-C at a safe point]). `on_forced(where)`
    runs when a second Ctrl-C interrupts the engine's code."""

    def __init__(self, on_forced: Callable[[str], None]) -> None:
        self._on_forced = on_forced
        self._depth = 0  # engine calls in progress on the main thread (`held`)
        self._direct = False  # a direct call of the model in progress, outside them
        self._everywhere = 0  # inside `everywhere()`: every line's signals are deferred
        self._installed: dict[int, Any] | None = None  # signal -> the program's handler
        self._pending: list[int] = []  # signals noted, in the order they came

    @staticmethod
    def _main() -> bool:
        return threading.current_thread() is threading.main_thread()

    def _install(self) -> None:
        """At the start of an outermost call (a direct call whose end torch skipped, for
        a KeyboardInterrupt of the model's, is over by now: what it noted besides a
        Ctrl-C is delivered here, at a point where nothing is half done)."""
        self._direct = False
        stale, self._pending = self._pending, []
        if self._installed is not None and any(  # that direct call's handlers, in place
                signal.getsignal(sig) == self._handler for sig in self._installed):
            self._deliver_all([sig for sig in stale if sig != signal.SIGINT])
            return
        self._installed = {sig: h for sig in DEFERRED_SIGNALS
                           if callable(h := signal.getsignal(sig))}
        for sig in self._installed:
            signal.signal(sig, self._handler)

    def _uninstall(self, failed: bool) -> None:
        """At the end of an outermost call: delivers the noted signals unless the call
        `failed` (its error is on its way already; a KeyboardInterrupt noted then is
        dropped, as before, and the program's other handlers still run). A handler
        the program replaced during the call stays as it set it."""
        installed = self._installed or {}
        # SIGINT's (installed first) back last: a Ctrl-C at a line after it raises, and
        # leaves no handler of the engine's in place (`_install` starts afresh)
        for sig, handler in reversed(installed.items()):
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, handler)
        self._installed = None
        pending, self._pending = self._pending, []
        self._deliver_all([sig for sig in pending if not (
            failed and installed.get(sig) is signal.default_int_handler)], installed)

    def _deliver_all(self, sigs: list[int], installed: dict[int, Any] | None = None) -> None:
        """Runs each noted signal's handler, every one even where an earlier raised; the
        first error is raised after the last."""
        handlers = (self._installed if installed is None else installed) or {}
        frame = sys._getframe(2)  # the engine's caller, for the handlers
        run_each(functools.partial(_deliver, sig, handlers.get(sig), frame)
                 for sig in dict.fromkeys(sigs))  # a signal noted twice: delivered once

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """An engine call: `engine(...)`, `backward`, `step`, ..."""
        if not self._main():
            yield
            return
        if self._depth == 0:
            self._install()
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._uninstall(failed=True)
            raise
        self._depth -= 1
        if self._depth == 0:
            self._uninstall(failed=False)

    @contextlib.contextmanager
    def everywhere(self) -> Iterator[None]:
        """Inside `held`: signals landing in any code are deferred too, the program's
        (an LR scheduler's step runs torch's code and the program's lr lambda as one
        piece of the engine's state)."""
        self._everywhere += 1
        try:
            yield
        finally:
            self._everywhere -= 1

    def direct_enter(self) -> None:
        """The model's root module starts a forward (its pre-hook); a direct call where
        no engine call is in progress."""
        if self._main() and self._depth == 0:
            self._install()
            self._direct = True

    def direct_leave(self, failed: bool) -> None:
        """The model's root module ended its forward (its forward hook)."""
        if self._main() and self._depth == 0 and self._direct:
            self._direct = False
            self._uninstall(failed)

    def safe_point(self) -> None:
        """Delivers the noted signals: nothing of the engine's is half done here. Only on
        the main thread (a hook may run on autograd's device threads)."""
        if not self._direct:
            self.deliver_noted()

    def deliver_noted(self) -> None:
        """[Note: a call that a Ctrl-C fails] `engine(...)` and `engine.backward()` end
        with a safe point inside the part that undoes them when they raise, as does a
        direct call of the model (its root's forward hook): a Ctrl-C noted in the
        engine's code during the call is raised there, and the call is undone, as for
        a Ctrl-C in the model's code. Delivered at the end of the call, it came after
        the call's work (a backward's gradient summed and counted), and running the
        step's micro-batches again, as for any failed call, counted one twice. A Ctrl-C
        landing in the few lines after that point still comes after the work:
        `engine.micro_step` tells whether a backward counted."""
        if not self._pending or not self._main():
            return
        pending, self._pending = self._pending, []
        self._deliver_all(pending)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        handler = (self._installed or {}).get(signum)
        if not self._direct and not self._everywhere and not in_offload(frame):
            return _deliver(signum, handler, frame)
        if signum not in self._pending:
            self._pending.append(signum)
        elif signum == signal.SIGINT:  # a second Ctrl-C: now, wherever it lands
            self._pending.remove(signum)
            ours = in_offload(frame)
            if ours or self._everywhere:  # the scheduler's step is state too: cut short in
                # the program's lr lambda, it is left half stepped
                where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                self._on_forced(where if ours else f"the LR scheduler's step, in the "
                                f"program's code at {where}")
            # the program's handler hears both: the first, noted until now, then this one
            # (a handler that stops after the step on the first and at once on the second,
            # as the demo's, took this for the first and left the engine broken with no
            # error in flight)
            _deliver(signum, handler, frame)
            _deliver(signum, handler, frame)
        # another signal noted again: as the kernel merges a pending signal's repeats


def run_each(calls: Iterable[Callable[[], Any]]) -> None:
    """Runs every call, even where an earlier one raised; raises the first error once
    the last has run (noted signals' handlers: each one runs)."""
    first = None
    for call in calls:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - raised once all have run
            first = first or e
    if first is not None:
        raise first


def _deliver(signum: int, handler: Any, frame: FrameType | None = None) -> None:
    """Runs the program's handler of `signum` (Python's own for SIGINT raises
    KeyboardInterrupt)."""
    if handler is None or handler is signal.default_int_handler:
        raise KeyboardInterrupt
    handler(signum, frame)


def guarded(method: Callable) -> Callable:
    """An engine method run as one engine call: a Ctrl-C inside it comes at its end
    ([Note: Ctrl-C at a safe point]); the engine keeps its `SafeInterrupts` as
    `_interrupts`."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._interrupts.held():
            return method(self, *args, **kwargs)
    return call


@contextlib.contextmanager
def around_user_block(interrupts: SafeInterrupts, cm: ContextManager[Any]) -> Iterator[Any]:
    """`with cm:` where `cm`'s entry and exit are the engine's work (a Ctrl-C inside
    them comes at their end, as in an engine call) and the block between is the
    user's code (one there comes at once): `engine.full_weights()`."""
    entered = exited = False  # a Ctrl-C at a line between the held parts: `cm` still
    try:                      # exits, once, as for an error of the block's
        with interrupts.held():
            value = cm.__enter__()
            entered = True
        yield value
        with interrupts.held():
            exited = True
            cm.__exit__(None, None, None)
    except BaseException as e:
        if entered and not exited:  # the block's error, or a Ctrl-C noted on the way in
            with interrupts.held():  # (out again: nothing written)
                exited = True
                if cm.__exit__(type(e), e, e.__traceback__):
                    return
        raise
