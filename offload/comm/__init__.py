"""Collectives on partitions: all-gather of parameter shards, reduce-scatter of
gradients, scalar reductions; async handles so they run behind compute."""

from .collectives import Collectives, Pending

__all__ = ["Collectives", "Pending"]
