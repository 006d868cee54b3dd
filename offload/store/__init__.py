"""Tiered tensor store: partitions in DEVICE, HOST or NVME under hard budgets.

Each stored partition has one `PartitionRecord` with an explicit `Residency`
state; `TieredStore.fetch` / `evict` move it between tiers asynchronously and
return a `MoveHandle`; an `EvictionPolicy` (default `LruPolicy`) decides what
leaves a full tier; `TieredStore.stats()` is the accounting. Typical use::

    store = TieredStore(cfg, rank=rank, recorder=rec)
    store.put("block3.param", weights, kind="param", tier="NVME").wait()
    h = store.fetch("block3.param", to="DEVICE", pin=True)
    ...                                    # overlap: the read and copy run meanwhile
    w = h.wait()                           # the DEVICE view, valid and pinned
    store.unpin("block3.param")
    store.evict("block3.param")            # back to its home tier (NVME)
    store.close()
"""

from .budget import BudgetExceededError, DirectionStats, StoreStats, TierStats
from .moves import MoveHandle, Step, plan_evict, plan_fetch
from .policy import Candidate, EvictionPolicy, LruPolicy, NextUsePolicy
from .record import PartitionRecord, RecordInfo, Residency, Tier, footprint
from .store import TieredStore

__all__ = [
    "BudgetExceededError", "Candidate", "DirectionStats", "EvictionPolicy", "LruPolicy",
    "MoveHandle", "NextUsePolicy", "PartitionRecord", "RecordInfo", "Residency", "Step",
    "StoreStats", "Tier", "TierStats", "TieredStore", "footprint", "plan_evict", "plan_fetch",
]
