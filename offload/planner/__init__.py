"""Access-trace recording and prefetch plans (pure functions of the trace)."""

from .access import AccessTrace, lookahead

__all__ = ["AccessTrace", "lookahead"]
