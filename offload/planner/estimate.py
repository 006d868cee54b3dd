"""Bytes of a model's training state per kind and per tier, for every placement (pure
arithmetic on partition sizes: no tensors, files or processes).

[Note: what each tier holds]
With budgets that leave room, the store keeps every partition in its home tier
and copies gathered parameters up to DEVICE, where they stay; the figures below
are the peak bytes each tier's ledger (`StoreStats.tiers[...].peak`) reaches
over initialisation and steps, per rank (each partition rounded up to 4 KiB as
the store charges it). P is the parameter partitions (compute dtype), G the
gradient partitions (fp32), Pg the largest parameter partition.
  * DEVICE: P (parameters homed there, or gathered copies of the others); a
    second P where NVMe optimizer state stages each update's new parameters
    beside the old ones on DEVICE (parameters homed there); G where gradients
    are homed there and stored (not handed straight to an early update).
  * HOST: on a CPU device (the DEVICE tier is host memory, and a copy moves up
    by handing its memory over) the largest of: P for parameters homed there;
    G for stored gradients homed on HOST or NVMe (they are summed in HOST);
    P for updates staged in HOST (NVMe optimizer state, parameters not on
    DEVICE). A read from NVMe lands in DEVICE memory there ([Note: CPU device
    tier] in offload/store/copy.py). On a GPU the copies are distinct, so these
    add up, and for parameters streamed from NVMe HOST also holds Pg times the
    look-ahead (`engine.prefetch_depth`, at least 1): the reads in flight,
    each staged in HOST until it is copied up (the first step prefetches along
    the modules' order while every parameter is still on NVMe). Where updates run
    early, their gradients are HOST records ([Note: the gradient's fp32 copy
    is a record] in offload/engine/engine.py), one at a time: plus the
    largest gradient partition.
  * NVME: P for parameters homed there, G for stored gradients homed there,
    and NVMe optimizer state twice: its extents count in the NVME ledger
    ([Note: optimizer extents] in offload/store/store.py), and a step writes
    the new version beside the old one until it commits.
Gradients are not stored in their home tier where updates run early: NVMe
optimizer state, no clipping, no fp16 loss scale, no accumulation.
The optimizer's own state is not a store record: masters (none where the
parameter is the master, `sizes.keeps_master`) and Adam's two moments live in host memory (the
`optimizer` figures, outside the store's ledger) or in the optimizer's swap
space (in the ledger, above), and its chunk pipeline stages through
io.buffer_budget.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .sizes import keeps_master, moment_bytes

__all__ = ["KINDS", "PLACEMENTS", "Placement", "ModelBytes", "TierBytes", "kind_bytes",
           "parse_placement", "tier_bytes"]

KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
ALIGN = 4096
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _footprint(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Placement:
    """Home tiers of the parameter and gradient partitions and of the optimizer state
    (the `engine.params`, `engine.grads`, `engine.optimizer` keys)."""

    params: str
    grads: str
    optimizer: str

    @property
    def name(self) -> str:
        return f"{self.params}/{self.grads}/{self.optimizer}"

    def engine_keys(self) -> dict[str, str]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


PLACEMENTS = tuple(Placement(p, g, o) for p, g, o in itertools.product(
    ("device", "host", "nvme"), ("device", "host", "nvme"), ("host", "nvme")))


def parse_placement(text: str) -> Placement:
    """'nvme/host/nvme' (params/grads/optimizer) -> a Placement; ValueError if not one."""
    parts = text.split("/")
    p = Placement(*parts) if len(parts) == 3 else None
    if p not in PLACEMENTS:
        raise ValueError(f"{text!r} is not params/grads/optimizer with params and grads in "
                         "device, host, nvme and optimizer in host, nvme (e.g. nvme/host/nvme)")
    return p


@dataclass(frozen=True)
class ModelBytes:
    """What the estimate needs of a model: each group's elements per rank (its
    partition, padded) and whether it trains, the compute dtype, and the activation
    bytes of one micro-batch (saved for backward; with activation checkpointing)."""

    shards: tuple[tuple[int, bool], ...]
    dtype: str = "fp32"
    activations: int = 0
    activations_checkpointed: int = 0
    state_dtype: str = "fp32"  # the Adam moments' form (optim.state_dtype)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(DTYPE_BYTES)}")


def kind_bytes(m: ModelBytes, master: bool | None = None) -> dict[str, int]:
    """Bytes per rank of each kind of partition (4 KiB-rounded as stored); `master` is 0
    where the parameter partition is the master (`master`: whether the optimizer keeps
    one, `sizes.keeps_master`; default: unless the training is fp32); each moment in
    `m.state_dtype`'s form (fp32 4 bytes per element, bf16 2, int8 1 and a scale per
    block: [Note: compressed moments] in offload/optim/codec.py)."""
    item = DTYPE_BYTES[m.dtype]
    train = [n for n, t in m.shards if t]
    out = {"param": sum(_footprint(n * item) for n, _ in m.shards),
           "grad": sum(_footprint(n * 4) for n in train),
           "master": sum(_footprint(n * 4) for n in train)
           if (m.dtype != "fp32" if master is None else master) else 0}
    out["exp_avg"] = out["exp_avg_sq"] = sum(
        _footprint(moment_bytes(m.state_dtype, n) // 2) for n in train)
    return out


@dataclass(frozen=True)
class TierBytes:
    """Bytes per rank per tier ([Note: what each tier holds]): `store` as the store's
    ledger counts it, `optimizer` the optimizer's state there (on NVMe also in
    `store`'s figure, twice while a step is open), `buffers` I/O staging; `total` the
    bytes each tier holds at most, each counted once."""

    store: dict[str, int]
    optimizer: dict[str, int]
    buffers: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> dict[str, int]:
        return {t: self.store.get(t, 0) + (self.optimizer.get(t, 0) if t != "nvme" else 0)
                + self.buffers.get(t, 0) for t in ("device", "host", "nvme")}


def early_updates(p: Placement, dtype: str, *, clipping: bool = False,
                  accum: int = 1) -> bool:
    """Whether gradients go straight to the update, never stored (see the Note)."""
    return p.optimizer == "nvme" and not clipping and dtype != "fp16" and accum == 1


def tier_bytes(m: ModelBytes, p: Placement, *, device: str = "cpu", buffer_budget: int = 0,
               clipping: bool = False, accum: int = 1, prefetch_depth: int = 2) -> TierBytes:
    """Bytes per rank each tier holds for placement `p` ([Note: what each tier holds]).
    `device`: "cpu" or "cuda" (the store's compute device); `prefetch_depth`: the
    engine's look-ahead (its default, 2)."""
    kinds = kind_bytes(m, keeps_master(m.dtype, p.params, device))
    P, G = kinds["param"], kinds["grad"]
    item = DTYPE_BYTES[m.dtype]
    Pg = max((_footprint(n * item) for n, _ in m.shards), default=0)
    stored = not early_updates(p, m.dtype, clipping=clipping, accum=accum)
    dev = P * (2 if p.params == "device" and p.optimizer == "nvme" else 1)
    dev += G if p.grads == "device" and stored else 0
    host_terms = [P if p.params == "host" else 0,
                  G if stored and p.grads in ("host", "nvme") else 0,
                  P if p.optimizer == "nvme" and p.params != "device" else 0,
                  Pg * max(1, prefetch_depth) if p.params == "nvme" and device != "cpu" else 0]
    host = max(host_terms) if device == "cpu" else sum(host_terms)
    if not stored:  # an early update's gradient in HOST (see the Note)
        host += max((_footprint(n * 4) for n, t in m.shards if t), default=0)
    nvme = (P if p.params == "nvme" else 0) + (G if p.grads == "nvme" and stored else 0)
    state = kinds["master"] + kinds["exp_avg"] + kinds["exp_avg_sq"]
    if p.optimizer == "nvme":
        nvme += 2 * state  # both versions while a step is open, in the store's ledger
    opt = {p.optimizer: state}
    nvme_used = "nvme" in (p.params, p.grads, p.optimizer)
    buffers = {"host": buffer_budget} if buffer_budget and nvme_used else {}
    return TierBytes({"device": dev, "host": host, "nvme": nvme}, opt, buffers)
