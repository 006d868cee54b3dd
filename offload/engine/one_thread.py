"""[Note: one thread at a time]
Two threads' forwards through one engine would share, and free under each other,
its gathered weights: outputs silently wrong, or a parameter read after its unit
gave it back. So one thread at a time runs the model: `engine(...)`, `generate`,
`backward`, and the model called directly (through a pre-hook on its root module)
enter a `OneThread`, and a call from a second thread while the first one's runs
is refused before it touches anything. Calls nest on one thread (a forward inside
`generate`, the root module inside `engine(...)`). The leave of a refused call
(forward hooks are always called) finds no entry of its thread and changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["OneThread"]


class OneThread:
    def __init__(self) -> None:
        self._running = 0  # calls in progress, all on `_thread`
        self._thread = 0
        self._mine = threading.local()  # this thread's calls in progress

    def enter(self) -> None:
        me = threading.get_ident()
        if self._running and self._thread != me:
            raise RuntimeError(
                "this engine's model is running on another thread: one thread at a time "
                "runs it (they would share its gathered weights); run the calls one after "
                "the other, or give each thread an engine of its own")
        self._thread = me
        self._running += 1
        self._mine.depth = getattr(self._mine, "depth", 0) + 1

    def leave(self) -> None:
        depth = getattr(self._mine, "depth", 0)
        if depth:
            self._mine.depth = depth - 1
            self._running = max(0, self._running - 1)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()
