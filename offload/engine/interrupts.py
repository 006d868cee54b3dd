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
installed only on the main thread (the only one Python delivers signals to) and
only where Python's own handler is installed: a program with its own SIGINT
handler keeps it. [Note: no interrupt mid-commit] in step.py keeps the commit
whole either way.
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
from typing import Any, Callable, ContextManager, Iterator

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


class SafeInterrupts:
    """Defers Ctrl-C inside the engine's code to a safe point ([Note: Ctrl-C at a safe
    point]). `on_forced(where)` runs when a second Ctrl-C interrupts the engine's code."""

    def __init__(self, on_forced: Callable[[str], None]) -> None:
        self._on_forced = on_forced
        self._depth = 0  # engine calls in progress on the main thread (`held`)
        self._direct = False  # a direct call of the model in progress, outside them
        self._installed: bool | None = None  # our handler in place (None: not decided)
        self._pending = False

    @staticmethod
    def _main() -> bool:
        return threading.current_thread() is threading.main_thread()

    def _install(self) -> None:
        """At the start of an outermost call (a direct call whose end torch skipped, for
        a KeyboardInterrupt of the model's, is over by now)."""
        self._direct = False
        self._pending = False
        if self._installed is None:
            self._installed = signal.getsignal(signal.SIGINT) is signal.default_int_handler
            if self._installed:
                signal.signal(signal.SIGINT, self._handler)

    def _uninstall(self, failed: bool) -> None:
        """At the end of an outermost call: raises a noted interrupt unless the call
        `failed` (its error is on its way already)."""
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = None
        pending, self._pending = self._pending, False
        if pending and not failed:
            raise KeyboardInterrupt

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
        """Raises a noted interrupt: nothing of the engine's is half done here."""
        if self._pending and not self._direct:
            self._pending = False
            raise KeyboardInterrupt

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if not self._direct and not in_offload(frame):
            raise KeyboardInterrupt
        if self._pending:  # a second Ctrl-C: now, wherever it lands
            if in_offload(frame):
                self._on_forced(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            raise KeyboardInterrupt
        self._pending = True


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
    entered = False
    try:
        with interrupts.held():
            value = cm.__enter__()
            entered = True
    except BaseException:
        if entered:  # a Ctrl-C noted on the way in: out again (nothing written), then it
            with interrupts.held():
                cm.__exit__(*sys.exc_info())
        raise
    try:
        yield value
    except BaseException as e:
        with interrupts.held():
            if cm.__exit__(type(e), e, e.__traceback__):
                return
        raise
    with interrupts.held():
        cm.__exit__(None, None, None)
