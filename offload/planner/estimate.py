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
optimizer state, no clipping, no fp16 loss scale, no accumulation. With NVMe
optimizer state and stored gradients, the staged partitions take the room of
the gradients their updates used ([Note: updates after backward]).
The optimizer's own state is not a store record: masters (none where the
parameter is the master, `sizes.keeps_master`) and Adam's two moments live in host memory (the
`optimizer` figures, outside the store's ledger) or in the optimizer's swap
space (in the ledger, above), and its chunk pipeline stages through
io.buffer_budget. Host state counts twice where parameters or gradients are
homed on NVMe: a step whose parameter and gradient partitions the memory tiers
cannot hold at once keeps a copy of the state it updates until it commits
([Note: all or nothing] in offload/engine/step.py; `in_place.pin_in_place`
decides), and the copy's memory stays allocated between steps. That is a
question of the budgets, which these figures do not take: at budgets that hold
every partition (homed on NVMe or not) the updates run in place and the
figure is twice what is held, an upper bound. Homed in memory, the partitions
fit their home tier's budget, and the state counts once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .sizes import MAX_AUTO_CHUNK, auto_chunk_elems, keeps_master, moment_bytes, nvme_state_bytes

__all__ = ["KINDS", "PLACEMENTS", "Placement", "ModelBytes", "TierBytes", "kind_bytes",
           "parse_placement", "tier_bytes"]

KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
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
    groups = _group_bytes(m, m.dtype != "fp32" if master is None else master)
    return {k: sum(v) for k, v in groups.items()}


def _group_bytes(m: ModelBytes, master: bool) -> dict[str, list[int]]:
    """Each group's bytes of each kind (`kind_bytes`), in group order; a frozen group's
    gradient, master and moments are 0."""
    item = DTYPE_BYTES[m.dtype]
    grad = [_footprint(n * 4) if t else 0 for n, t in m.shards]
    moment = [_footprint(moment_bytes(m.state_dtype, n) // 2) if t else 0 for n, t in m.shards]
    return {"param": [_footprint(n * item) for n, _ in m.shards], "grad": grad,
            "master": grad if master else [0] * len(grad), "exp_avg": moment,
            "exp_avg_sq": moment}


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


def _peak_over_updates(steps: list[tuple[int, int, int]]) -> int:
    """The most bytes held while the updates run in order, each step (a, b, c) of one
    group: `a` accumulates from its update on (new versions staged until the commit),
    `b` is held until its update is done (stored gradients), `c` only during it (a
    gradient read for it)."""
    ahead = sum(b for _, b, _ in steps)
    done = peak = 0
    for a, b, c in steps:
        done += a
        peak = max(peak, done + ahead + c)
        ahead -= b
    return peak


def tier_bytes(m: ModelBytes, p: Placement, *, device: str = "cpu", buffer_budget: int = 0,
               clipping: bool = False, accum: int = 1, prefetch_depth: int = 2,
               optim_buffers: int = 6, chunk_elems: int = 0) -> TierBytes:
    """Bytes per rank each tier holds for placement `p` ([Note: what each tier holds]).
    `device`: "cpu" or "cuda" (the store's compute device); `clipping`
    (optim.max_grad_norm above 0) and `accum` (engine.grad_accum_steps): whether
    gradients are stored until `step()`; `prefetch_depth`: the engine's look-ahead
    (its default, 2); `optim_buffers` and `chunk_elems` (optim.buffers and
    optim.chunk_elems, 0: sized from `buffer_budget`): the chunks NVMe optimizer state
    is stored in, each its own 4 KiB-rounded extent."""
    master = keeps_master(m.dtype, p.params, device)
    kinds = kind_bytes(m, master)
    P, G = kinds["param"], kinds["grad"]
    item = DTYPE_BYTES[m.dtype]
    Pg = max((_footprint(n * item) for n, _ in m.shards), default=0)
    stored = not early_updates(p, m.dtype, clipping=clipping, accum=accum)
    if p.optimizer == "nvme":
        chunk = chunk_elems or (auto_chunk_elems(buffer_budget, optim_buffers,
                                                 state_dtype=m.state_dtype, master=master)
                                if buffer_budget else MAX_AUTO_CHUNK)
    st = _state_bytes(m, master, chunk if p.optimizer == "nvme" else 0)
    state = sum(st)
    nvme = P if p.params == "nvme" else 0
    if p.optimizer == "nvme" and stored:  # [Note: updates after backward]
        dev, host, nvme_late = _late_updates(m, p, master, st)
        nvme += state + nvme_late
        host_terms = [P if p.params == "host" else 0, max(host, G if p.grads == "nvme" else 0)]
        dev += P
    else:
        dev = P * (2 if p.params == "device" and p.optimizer == "nvme" else 1)
        dev += G if p.grads == "device" and stored else 0
        host_terms = [P if p.params == "host" else 0,
                      G if stored and p.grads in ("host", "nvme") else 0,
                      P if p.optimizer == "nvme" and p.params != "device" else 0]
        nvme += G if p.grads == "nvme" and stored else 0
        if p.optimizer == "nvme":
            nvme += 2 * state  # both versions while a step is open, in the store's ledger
    if p.params == "nvme" and device != "cpu":
        host_terms.append(Pg * max(1, prefetch_depth))
    host = max(host_terms) if device == "cpu" else sum(host_terms)
    if not stored:  # an early update's gradient in HOST (see the Note)
        host += max((_footprint(n * 4) for n, t in m.shards if t), default=0)
    copy = p.optimizer == "host" and "nvme" in (p.params, p.grads)  # see the Note
    opt = {p.optimizer: state * (2 if copy else 1)}
    nvme_used = "nvme" in (p.params, p.grads, p.optimizer)
    buffers = {"host": buffer_budget} if buffer_budget and nvme_used else {}
    return TierBytes({"device": dev, "host": host, "nvme": nvme}, opt, buffers)


def _state_bytes(m: ModelBytes, master: bool, chunk: int) -> list[int]:
    """Each group's optimizer state (0 where frozen): in NVMe chunks of `chunk` elements
    (`nvme_state_bytes`), or, with `chunk` 0 (in memory, or chunks that do not fit the
    buffers), each kind 4 KiB-rounded (`kind_bytes`)."""
    if chunk:
        return [nvme_state_bytes(n, master, m.state_dtype, chunk) if t else 0
                for n, t in m.shards]
    groups = _group_bytes(m, master)
    return [sum(groups[k][i] for k in STATE_KINDS) for i in range(len(m.shards))]


def _late_updates(m: ModelBytes, p: Placement, master: bool,
                  states: list[int]) -> tuple[int, int, int]:
    """DEVICE, HOST and NVME bytes of NVMe optimizer state updated after backward
    (gradients stored), beyond the parameters and the state's current version.

    [Note: updates after backward]
    `step()` updates the groups in order, each staging its new parameter partition
    (in DEVICE where parameters are homed there, else in HOST) and writing its new
    state beside the old until the commit, and freeing the group's gradient once
    its update is done. So the tier that holds both the gradients and the staged
    partitions holds the gradients not yet used plus the partitions staged so far,
    the most of it while some update runs (`_peak_over_updates`), not the two
    added up. A gradient homed on NVMe is read into HOST for its update; NVMe holds
    the new state so far plus the gradients not yet used. In HOST those gradients
    also pass through on their way down in backward: up to all of them while
    their writes are in flight (the bound counted; how many are in flight at
    once depends on the disk)."""
    groups = _group_bytes(m, master)
    train = [i for i, (_, t) in enumerate(m.shards) if t]
    new = [groups["param"][i] for i in train]
    grad = [groups["grad"][i] for i in train]
    st = [states[i] for i in train]
    on_dev, gt = p.params == "device", p.grads
    dev = _peak_over_updates([(n if on_dev else 0, g if gt == "device" else 0, 0)
                              for n, g in zip(new, grad)])
    host = _peak_over_updates([(0 if on_dev else n, g if gt == "host" else 0,
                                g if gt == "nvme" else 0) for n, g in zip(new, grad)])
    nvme = _peak_over_updates([(x, g if gt == "nvme" else 0, 0) for x, g in zip(st, grad)])
    return dev, host, nvme
