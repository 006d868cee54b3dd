"""Collectives on partitions: all-gather of parameter shards (from a communication
thread, optionally), reduce-scatter of gradients, scalar reductions; async handles so
they run behind compute. Tensor parallelism with Domino slicing (`domino`,
`tensor_parallel`, `blocks`, `mesh`)."""

from .collectives import Collectives, Pending, RankFailedError, user_timeout
from .gather_thread import GatherIssuer

__all__ = ["Collectives", "GatherIssuer", "Pending", "RankFailedError", "user_timeout"]
