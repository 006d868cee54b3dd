"""What an engine gives back when it is closed, or collected without `close()`.

[Note: an engine dropped without close()] A notebook that builds a second engine
and drops the first without closing it must get the first one's threads, pinned
buffers and swap files back, as a file dropped unclosed is closed. The parts below
refer to nothing that refers to the engine (the store's completion thread holds the
store, not the engine), so once the user's last reference to the engine, or to its
model, goes, the engine is collected and a finalizer releases them. The hooks on
the model's tensors hold the engine weakly for that ([Note: hooks on tensors hold
the engine weakly] in units.py). What the finalizer leaves alone: communicators
(destroying a process group is not for a collector's arbitrary moment; a job's
ranks keep theirs until the process exits).

[Note: an engine open at interpreter exit] A script that ends without `close()`
left the engine's threads at work (the store's completion thread, its copies and
writes) while the interpreter shut down; one inside a torch call as the process's
own destructors ran aborted it ("terminate called without an active exception",
exit code 134), one run in ten here. At exit, before the finalizers that remove
swap files, each engine still open in this process is released as by `close()`:
its moves end (within store.wait_timeout) and its threads stop first. A
checkpoint still being saved in the background is waited for first, saying so
(`close()` waits for it too): a script whose last line is a background save
lost that checkpoint without a word.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..io.process import in_owner

__all__ = ["Owned"]

log = logging.getLogger(__name__)
_OPEN: "weakref.WeakSet[Owned]" = weakref.WeakSet()  # [Note: an engine open at
_exit_registered = False  # interpreter exit]
_EXIT_WAIT_S = 10.0  # the longest the exit waits for another thread's call to end


class Owned:
    """The engine's threads, optimizer, warm memory, store and switch-interval hold,
    released once: by `close()` or when the engine is collected unclosed."""

    __slots__ = ("updater", "opt", "warm", "store", "switch", "saving", "released",
                 "calls", "_finalizer", "_pid", "__weakref__")

    def __init__(self, engine: Any, updater: ThreadPoolExecutor, warm: Any, store: Any,
                 switch: Any, calls: Any = None) -> None:
        self.updater, self.warm, self.store, self.switch = updater, warm, store, switch
        # the engine's OneThread (a daemon thread's call at exit), held weakly: a call cut
        # short holds its frame, and so the model and the engine, until it is dropped
        self.calls = weakref.ref(calls) if calls is not None else None
        self.opt: Any = None  # set when the optimizer is attached
        self.saving: Any = None  # the engine's save in the background (its handle), until
        # a wait sees it done
        self.released = False
        # in this process only: a forked child's copy leaves the parts to the parent
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(engine, in_owner, self._pid, _collected, self)
        self._finalizer.atexit = False
        global _exit_registered
        if not _exit_registered:  # after weakref's own exit hook: atexit runs this first
            atexit.register(_release_open_at_exit)
            # threading's exit hooks run in reverse order, before atexit's: this one before
            # concurrent.futures' (registered when it was imported) stops its pools
            getattr(threading, "_register_atexit", atexit.register)(_wait_for_saves_at_exit)
            _exit_registered = True
        _OPEN.add(self)

    def release(self) -> None:
        """Releases every part, once: later calls do nothing, or finish a release cut
        short (a store whose moves did not end in time, a second Ctrl-C); until then
        the finalizer still finishes it when the engine is collected."""
        if self.released:
            return
        _release(self)
        self._finalizer.detach()
        self.released = True


def _release(owned: Owned) -> None:
    """Each part once, so that a release cut short can run again."""
    owned.updater.shutdown(wait=True)
    if owned.opt is not None:
        owned.opt.close()
        owned.opt = None
    owned.warm.clear()
    owned.store.close()
    owned.switch.release()  # the last engine to close restores Python's interval


def _collected(owned: Owned) -> None:
    warnings.warn("an offload engine was collected without close(): its threads and swap "
                  "files are released now; close() it, or use it as a context manager",
                  ResourceWarning, stacklevel=2)
    if threading.current_thread().name.startswith("offload-"):
        # collected on one of the engine's own threads, which cannot wait for itself
        threading.Thread(target=_release, args=(owned,), name="offload-release",
                         daemon=True).start()
    else:
        _release(owned)


def _wait_for_saves_at_exit() -> None:
    """[Note: an engine open at interpreter exit] Runs before the thread pools stop
    taking work (a save writes through one; a step's updates run on one), where
    `atexit` runs after. A daemon thread still inside a call (a training loop the
    main thread did not join) finishes that call first, within `_EXIT_WAIT_S`, and
    its next call ends the thread quietly: stopped under it, the call raised "cannot
    schedule new futures after shutdown" or "the tiered store is closed" into a
    traceback at every such exit."""
    for owned in list(_OPEN):
        calls = owned.calls() if owned.calls is not None else None
        if owned._pid != os.getpid() or owned.released or calls is None:
            continue
        calls.exiting = True
        end = time.monotonic() + _EXIT_WAIT_S
        while calls.daemon_busy() and time.monotonic() < end:
            time.sleep(0.01)
    for owned in list(_OPEN):
        saving = owned.saving
        if owned._pid != os.getpid() or owned.released or saving is None or saving.done():
            continue
        log.warning("the interpreter exits while checkpoint %s is being saved in the "
                    "background: waiting for it to finish (close the engine, or call "
                    "engine.wait_for_checkpoint(), before the script ends)", saving.path)
        try:
            saving.wait()
        except KeyboardInterrupt:  # the user cut the wait short: the save is given up
            log.warning("checkpoint %s abandoned: the exit did not wait for its save",
                        saving.path)
        except BaseException as e:  # noqa: BLE001 - said; the exit goes on
            log.warning("the checkpoint save in the background failed: %s", e)


def _release_open_at_exit() -> None:
    """[Note: an engine open at interpreter exit]"""
    for owned in list(_OPEN):
        if owned._pid != os.getpid():
            continue
        try:
            owned.release()
        except BaseException as e:  # noqa: BLE001 - the exit goes on; the files' own
            log.warning("an offload engine open at exit was not released: %s", e)  # go
