"""Access-trace recording, prefetch plans and the step-time simulator (pure functions
of the trace: no tensors, files or threads)."""

from .access import AccessTrace, lookahead
from .plan import Plan, PlanOp, RecordSpec, Use, lru_bytes, make_plan, previous_key
from .simulate import Prediction, Rates, simulate

__all__ = ["AccessTrace", "Plan", "PlanOp", "Prediction", "Rates", "RecordSpec", "Use",
           "lookahead", "lru_bytes", "make_plan", "previous_key", "simulate"]
