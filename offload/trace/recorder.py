"""Event recorder: timestamped spans, async transfers, instants and counters.

Every layer may hold a :class:`TraceRecorder` and emit to it; this module imports
only the standard library so that it sits below all other layers (DESIGN.md).
A recorder is off by default, and a disabled recorder costs one attribute read
per call. Export to Chrome-trace JSON and summaries live in :mod:`offload.trace.chrome`.

Timestamps are ``time.perf_counter_ns()`` (nanoseconds). On Linux that is
CLOCK_MONOTONIC, shared by every process of one host, so recorders of several
ranks on one host line up without any correction; across hosts they do not,
which is why each recorder keeps a wall-clock anchor (see ``clock_anchor_ns``).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "AsyncToken",
    "NULL_RECORDER",
    "PHASES",
    "TraceEvent",
    "TraceRecorder",
    "TraceSnapshot",
    "as_snapshot",
]

_now_ns = time.perf_counter_ns

# Chrome-trace phase letters, used directly as the event kind.
COMPLETE, ASYNC_BEGIN, ASYNC_END, INSTANT, COUNTER = "X", "b", "e", "i", "C"
PHASES = frozenset((COMPLETE, ASYNC_BEGIN, ASYNC_END, INSTANT, COUNTER))

DEFAULT_CAT = "default"


class TraceEvent(NamedTuple):
    """One recorded event; the recorder stores plain tuples with this layout.

    ``phase`` is a Chrome-trace phase letter: ``"X"`` complete span, ``"b"`` /
    ``"e"`` async begin / end, ``"i"`` instant, ``"C"`` counter. ``ts_ns`` is
    the start time and ``dur_ns`` the duration (``"X"`` only; else 0), both in
    nanoseconds of ``time.perf_counter_ns()``. ``async_id`` pairs ``"b"`` with
    ``"e"`` within one recorder (else 0). ``track`` names the lane. ``args`` is
    a dict or None; for counters it maps series name to a float value.
    """

    phase: str
    ts_ns: int
    dur_ns: int
    async_id: int
    name: str
    cat: str
    track: str
    args: dict[str, Any] | None


class AsyncToken(NamedTuple):
    """What :meth:`TraceRecorder.async_begin` returns; pass it to ``async_end``.

    Holds everything the end event needs, so ending on another thread takes no
    lookup and no lock.
    """

    async_id: int
    name: str
    cat: str
    track: str


@dataclass(frozen=True)
class TraceSnapshot:
    """An immutable copy of one recorder's events, as exporters read them.

    ``rank`` becomes the Chrome-trace pid. ``tracks`` lists every track in
    display order (declared tracks first, then in order of first emission).
    ``dropped`` counts events refused because of ``max_events``.
    ``clock_anchor_ns`` is ``(perf_counter_ns, time_ns)`` read together when
    the recorder was made, for aligning traces of different hosts. ``info``
    holds facts about the whole run (see :meth:`TraceRecorder.set_info`).
    """

    rank: int
    process_name: str
    events: tuple[TraceEvent, ...]
    tracks: tuple[str, ...]
    dropped: int = 0
    clock_anchor_ns: tuple[int, int] = (0, 0)
    info: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Iterable[Iterable[Any]], *, rank: int = 0,
                    process_name: str | None = None) -> "TraceSnapshot":
        """Wrap raw event tuples (``TraceEvent`` layout) as one rank's snapshot."""
        evs = tuple(_checked_event(e) for e in events)
        tracks = tuple(dict.fromkeys(e.track for e in evs))
        return cls(rank=rank, process_name=process_name or f"rank {rank}", events=evs,
                   tracks=tracks)


def _checked_event(raw: Iterable[Any]) -> TraceEvent:
    fields = tuple(raw)
    if len(fields) != len(TraceEvent._fields):
        raise ValueError(f"trace event {fields!r} has {len(fields)} fields, expected "
                         f"{len(TraceEvent._fields)}: {TraceEvent._fields}")
    event = TraceEvent._make(fields)
    if event.phase not in PHASES:
        raise ValueError(f"trace event {event!r} has phase {event.phase!r}, expected one of "
                         f"{sorted(PHASES)}")
    return event


class _Span:
    """Context manager of an enabled :meth:`TraceRecorder.span`; emits one ``"X"``."""

    __slots__ = ("_rec", "name", "cat", "track", "args", "start_ns")

    def __init__(self, rec: "TraceRecorder", name: str, cat: str, track: str,
                 args: dict[str, Any]) -> None:
        self._rec = rec
        self.name = name
        self.cat = cat
        self.track = track
        self.args = args
        self.start_ns = 0

    def set(self, **args: Any) -> None:
        """Add or replace args of the span before it ends (e.g. ``bytes=n``)."""
        self.args.update(args)

    def __enter__(self) -> "_Span":
        self.start_ns = _now_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        end_ns = _now_ns()
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        # Recorded even if the recorder was disabled meanwhile (the span began enabled),
        # unless max_events is reached: a span is one event, no pair to keep whole
        self._rec._append((COMPLETE, self.start_ns, end_ns - self.start_ns, 0,
                           self.name, self.cat, self.track, self.args or None))
        return False


class _NullSpan:
    """Shared context manager of a disabled recorder's ``span``: does nothing."""

    __slots__ = ()

    @property
    def args(self) -> dict[str, Any]:
        return {}  # a fresh dict each time: writes to it go nowhere

    def set(self, **args: Any) -> None:
        pass

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False


_NULL_SPAN = _NullSpan()


class TraceRecorder:
    """Thread-safe, low-overhead recorder of trace events for one process (rank).

    Off by default: every emitting method first reads ``self.enabled`` and
    returns at once when it is False, so callers need no guard of their own.
    Set ``enabled`` (a plain bool attribute) to switch recording on or off.

    ``track`` names a display lane, e.g. ``"compute"``, ``"stream:h2d"``,
    ``"io:aio"``, ``"tier:NVME"``; each becomes one Chrome-trace thread. When
    omitted, the emitting thread's name is used (``"thread:<name>"``). Complete
    spans on one track must nest (they do when one thread emits them); async
    events have no such constraint. ``args`` dicts are stored by reference:
    do not mutate one after passing it.

    ``max_events`` caps memory: once that many events are held, new events
    are dropped and counted in ``dropped``. The end of an async event whose
    begin was kept is always kept, so pairs stay whole; the cap can therefore
    be exceeded by the number of async events in flight, and by a few events
    when several threads reach the cap at once.

    [Note: lock-free append] Events go into a plain list with ``list.append``,
    a single bytecode call into C that runs while holding the GIL, so
    concurrent appends from many threads never interleave or lose an item; on
    free-threaded builds list operations take a per-object lock and keep the
    same guarantee. Readers copy with ``events[:]``, also one C call. Only the
    rare paths that read-modify-write a counter (dropping, clearing) or
    register tracks take ``self._lock``.
    """

    def __init__(self, *, enabled: bool = False, rank: int = 0,
                 process_name: str | None = None, max_events: int | None = None) -> None:
        if max_events is not None and max_events < 0:
            raise ValueError(f"max_events is {max_events}; use None for no cap or a count >= 0")
        self.enabled = bool(enabled)
        self.rank = int(rank)
        self.process_name = process_name
        self.max_events = max_events
        self.clock_anchor_ns = (_now_ns(), time.time_ns())
        self._events: list[tuple] = []
        self._lock = threading.Lock()
        self._dropped = 0
        self._declared_tracks: list[str] = []
        self._info: dict[str, Any] = {"host": socket.gethostname()}
        # next() on itertools.count is one C call under the GIL: ids are unique.
        self._async_ids = itertools.count(1)

    # -- emitting ---------------------------------------------------------------------------

    def span(self, name: str, cat: str = DEFAULT_CAT, track: str | None = None,
             **args: Any) -> _Span | _NullSpan:
        """Context manager timing its body as one complete event (``"X"``).

        The value bound by ``with ... as s`` has ``s.set(key=value)`` to add
        args before the span ends. An exception in the body is recorded as
        ``args["error"]`` (its type name) and propagates.
        """
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, cat, track or _thread_track(), args)

    def complete(self, name: str, start_ns: int, end_ns: int, cat: str = DEFAULT_CAT,
                 track: str | None = None, args: dict[str, Any] | None = None) -> None:
        """Record a span that ran from ``start_ns`` to ``end_ns`` (perf_counter_ns)."""
        if not self.enabled:
            return
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends at {end_ns} ns before it starts at "
                             f"{start_ns} ns; pass time.perf_counter_ns() values in order")
        self._append((COMPLETE, start_ns, end_ns - start_ns, 0, name, cat,
                      track or _thread_track(), args))

    def async_begin(self, name: str, cat: str = DEFAULT_CAT, track: str | None = None,
                    args: dict[str, Any] | None = None,
                    ts_ns: int | None = None) -> AsyncToken | None:
        """Begin an async event (an I/O or a move between tiers); returns its token.

        Returns None when disabled or when the event was dropped by
        ``max_events``; ``async_end(None)`` is a no-op, so callers need not check.
        The matching ``async_end`` may run on any thread.
        """
        if not self.enabled:
            return None
        token = AsyncToken(next(self._async_ids), name, cat, track or _thread_track())
        event = (ASYNC_BEGIN, _now_ns() if ts_ns is None else ts_ns, 0, token.async_id,
                 name, cat, token.track, args)
        return token if self._append(event) else None

    def async_end(self, token: AsyncToken | None, args: dict[str, Any] | None = None,
                  ts_ns: int | None = None) -> None:
        """End the async event of ``token``; ``args`` (e.g. ``{"bytes": n}``) go on the end.

        Recorded whenever ``token`` is not None, even if the recorder was
        disabled since the begin, so that every recorded begin has its end.
        """
        if token is None:
            return
        self._append_always((ASYNC_END, _now_ns() if ts_ns is None else ts_ns, 0,
                             token.async_id, token.name, token.cat, token.track, args))

    def instant(self, name: str, cat: str = DEFAULT_CAT, track: str | None = None,
                args: dict[str, Any] | None = None, ts_ns: int | None = None) -> None:
        """Record a point in time (e.g. a plan fallback, an eviction decision)."""
        if not self.enabled:
            return
        self._append((INSTANT, _now_ns() if ts_ns is None else ts_ns, 0, 0, name, cat,
                      track or _thread_track(), args))

    def counter(self, name: str, values: Mapping[str, float], track: str | None = None,
                ts_ns: int | None = None) -> None:
        """Record the current value of one or more series, e.g. bytes resident per tier.

        ``values`` maps series name to a number (converted to float now; a
        value float() rejects raises TypeError/ValueError).
        """
        if not self.enabled:
            return
        floats = {str(k): float(v) for k, v in values.items()}
        self._append((COUNTER, _now_ns() if ts_ns is None else ts_ns, 0, 0, name, "counter",
                      track or _thread_track(), floats))

    def declare_track(self, track: str) -> None:
        """Fix a track's display position: declared tracks come first, in call order."""
        with self._lock:
            if track not in self._declared_tracks:
                self._declared_tracks.append(track)

    def set_info(self, **values: Any) -> None:
        """Record facts that hold for the whole run, e.g. ``tier_budgets={"HOST": n}``.

        Kept whether or not the recorder is enabled (layers state them once, when
        they are built, usually before recording starts) and exported in the
        Chrome-trace metadata under ``info[rank]``. The names the HTML report
        reads are listed in docs/trace.md. Values must be JSON-ready.
        """
        with self._lock:
            self._info.update(values)

    @property
    def info(self) -> dict[str, Any]:
        """A copy of the facts given to :meth:`set_info` (and ``host``, the host name)."""
        with self._lock:
            return dict(self._info)

    @staticmethod
    def now_ns() -> int:
        """The recorder's clock, ``time.perf_counter_ns()`` (nanoseconds)."""
        return _now_ns()

    def _append(self, event: tuple) -> bool:
        events = self._events
        cap = self.max_events
        if cap is not None and len(events) >= cap:
            with self._lock:
                self._dropped += 1
            return False
        events.append(event)  # atomic: see [Note: lock-free append]
        return True

    def _append_always(self, event: tuple) -> None:
        self._events.append(event)  # atomic: see [Note: lock-free append]

    # -- reading ----------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Events refused because ``max_events`` was reached (count)."""
        return self._dropped

    def __len__(self) -> int:
        return len(self._events)

    def events(self) -> list[TraceEvent]:
        """A copy of the events recorded so far, in emission order."""
        return [TraceEvent._make(e) for e in self._events[:]]

    def snapshot(self) -> TraceSnapshot:
        """An immutable copy of the events and track order, for export."""
        events = tuple(TraceEvent._make(e) for e in self._events[:])
        with self._lock:
            declared = list(self._declared_tracks)
            dropped = self._dropped
            info = dict(self._info)
        tracks = tuple(dict.fromkeys([*declared, *(e.track for e in events)]))
        return TraceSnapshot(rank=self.rank, process_name=self.process_name or f"rank {self.rank}",
                             events=events, tracks=tracks, dropped=dropped,
                             clock_anchor_ns=self.clock_anchor_ns, info=info)

    def clear(self) -> None:
        """Forget recorded events and the dropped count; declared tracks stay.

        Events appended while clearing are kept: only the first ``n`` items,
        counted before the delete, are removed.
        """
        with self._lock:
            n = len(self._events)
            del self._events[:n]
            self._dropped = 0


def _thread_track() -> str:
    return "thread:" + threading.current_thread().name


class _AlwaysDisabledRecorder(TraceRecorder):
    """The type of :data:`NULL_RECORDER`: can never be enabled or changed."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"NULL_RECORDER is shared and always disabled; cannot set "
                                 f"{name}={value!r}. Create TraceRecorder(enabled=True) instead")
        super().__setattr__(name, value)

    def declare_track(self, track: str) -> None:
        pass

    def set_info(self, **values: Any) -> None:
        pass


NULL_RECORDER: TraceRecorder = _AlwaysDisabledRecorder()
"""A shared recorder that records nothing: the default for layers given none."""


def as_snapshot(source: TraceRecorder | TraceSnapshot | Iterable[Iterable[Any]]) -> TraceSnapshot:
    """A snapshot of a recorder, a snapshot itself, or raw events taken as rank 0."""
    if isinstance(source, TraceRecorder):
        return source.snapshot()
    if isinstance(source, TraceSnapshot):
        return source
    return TraceSnapshot.from_events(source)
