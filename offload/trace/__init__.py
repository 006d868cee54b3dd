"""Event trace: a low-overhead recorder every layer may emit to, and its Chrome-trace export.

This package imports only the standard library and nothing from other
``offload`` sub-packages, so any layer can depend on it (DESIGN.md).

Typical use::

    rec = TraceRecorder(enabled=True, rank=rank)
    with rec.span("forward:block3", cat="compute", track="compute"):
        ...
    tok = rec.async_begin("read", cat="io", track="io:aio", args={"bytes": n})
    ...  # possibly on another thread:
    rec.async_end(tok)
    rec.counter("tier_bytes", {"HOST": host_bytes, "NVME": nvme_bytes}, track="tier:HOST")
    write_chrome_trace("step.trace.json", rec)
"""

from offload.trace.chrome import (TraceFormatError, load_chrome_trace, merge_chrome_traces,
                                  summarize, to_chrome_trace, write_chrome_trace,
                                  write_trace_dict)
from offload.trace.recorder import (NULL_RECORDER, AsyncToken, TraceEvent, TraceRecorder,
                                    TraceSnapshot)
from offload.trace.units import UnitSpans

__all__ = [
    "AsyncToken",
    "NULL_RECORDER",
    "TraceEvent",
    "TraceRecorder",
    "TraceFormatError",
    "TraceSnapshot",
    "UnitSpans",
    "load_chrome_trace",
    "merge_chrome_traces",
    "summarize",
    "to_chrome_trace",
    "write_chrome_trace",
    "write_trace_dict",
]
