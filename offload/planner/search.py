"""The search behind `offload tune`: every configuration of a space that fits the
budgets, scored by the step simulator (pure functions: no tensors, files or threads).

[Note: the modelled step]
A configuration's step is built as an access trace (`Use`s) and planned and
simulated like any other (offload.planner.plan, .simulate):
  * forward over the units, then backward in reverse (once per micro-batch), each
    taking its measured compute time plus a fixed per-unit cost (hooks, gathers); a
    unit whose parameters live on NVMe uses their partitions (records), read ahead
    at most `prefetch_depth` uses before they are needed (the engine's look-ahead);
    on a GPU, parameters homed on the host are copied up at the copy rate at
    each use; those read from NVMe pay no copy apart: the store reads a
    record into pinned memory and copies it up while the disk reads the next,
    so the copy (at a rate about ten times the disk's) makes a fetch arrive
    later by one record's copy at most, which the model leaves out (not yet
    measured on a GPU);
  * every group's update after backward, or, where updates run early (NVMe
    optimizer state without clipping, loss scaling or accumulation), right after
    the backward of its unit; with NVMe optimizer state the update streams its
    state in chunks (records of `chunk` elements x 12 bytes, 8 in fp32, the
    moments counted in the candidate's `state_dtype`: 4 bytes per element of
    both in bf16, about 2 in int8) that
    are read at most `buffers - 1` chunks ahead and written back, each taking
    its elements over the measured Adam rate of its state dtype; gradients homed on
    NVMe are written at backward (read and written again by each later
    micro-batch's) and read at the update;
  * memory for the streamed records is what the budgets leave once every
    partition homed in memory is counted, plus the pipeline's chunk buffers;
    where that memory spans two tiers, the plan's single budget is what the two
    hold record by record ([Note: two tiers, one budget]).
The disk serves reads and writes at the rates probed for the configuration's
block size and queue depth. What limits the step is the largest of compute
(forward and backward), CPU (Adam) and exposed I/O (disk).

`modelled_step` builds the trace from unit uses given in order with their
seconds: the tuner's from FLOPs (`_uses`), `offload bench plan`'s from a real
step's event trace, which also puts early updates on the engine's update
thread (`Use.lane`), gradients stored in memory as reserves of the budget
(`Use.reserved`), the loss and the commit with their measured seconds.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from .estimate import (DTYPE_BYTES, PLACEMENTS, ModelBytes, Placement, _footprint,
                       early_updates, kind_bytes, tier_bytes)
from .plan import Plan, PlanOp, RecordSpec, Use, lru_bytes, make_plan, previous_key
from .simulate import Rates, simulate
from .sizes import auto_chunk_elems as chunk_elems
from .sizes import keeps_master, state_elem_bytes

__all__ = ["Budgets", "Candidate", "Machine", "ModelledStep", "Scored", "Space", "StepShape",
           "UnitUse", "calibrate", "calibration_key", "chunk_elems", "commit_stages",
           "lru_step_bytes", "model_of", "modelled_step", "packed_budget", "plan_step", "ranked",
           "score", "search", "shortfall", "state_elem_bytes", "steady_records"]

MiB = 1 << 20


@dataclass(frozen=True)
class StepShape:
    """The model grouped at one `group_size`: each group's elements per rank and whether
    it trains, each unit's groups and forward compute seconds (backward: twice), and
    the minimum working set (device, host bytes) of each placement (by name), for
    training that clips or not and sums `accum` micro-batches a step."""

    group_size: int
    dtype: str
    shards: tuple[tuple[int, bool], ...]
    units: tuple[tuple[tuple[int, ...], float], ...]
    minimum: Mapping[str, tuple[int, int]]
    clipping: bool = False  # optim.max_grad_norm > 0: updates after backward
    accum: int = 1  # engine.grad_accum_steps: micro-batches a step, updates after them

    @property
    def model(self) -> ModelBytes:
        return ModelBytes(self.shards, self.dtype)


@dataclass(frozen=True)
class Machine:
    """Measured rates: the disk's per (block size, queue depth), Adam elements/s, the
    host-to-device copy in bytes/s (0: the device is the CPU), a fixed cost per unit
    use in seconds, the free bytes under the swap directory, and a fixed cost per
    optimizer chunk streamed from NVMe in seconds (its requests, waits and kernel
    calls)."""

    disk: Mapping[tuple[int, int], Rates]
    adam_eps: float
    copy_Bps: float = 0.0
    unit_overhead_s: float = 0.0
    disk_free: int = 1 << 62
    chunk_overhead_s: float = 0.0
    adam_eps_by_state: Mapping[str, float] = field(default_factory=dict)  # other than fp32

    def __post_init__(self) -> None:
        rates = {"adam_eps": self.adam_eps, **{f"adam_eps_by_state[{k!r}]": v
                                              for k, v in self.adam_eps_by_state.items()}}
        for name, v in rates.items():
            if not 0 < v:  # NaN too
                raise ValueError(f"Machine.{name} must be a positive rate, got {v}")
        if not self.copy_Bps >= 0:  # 0: the device is the CPU
            raise ValueError(f"Machine.copy_Bps must be >= 0, got {self.copy_Bps}")
        for name in ("unit_overhead_s", "chunk_overhead_s"):
            v = getattr(self, name)
            if not 0 <= v < float("inf"):
                raise ValueError(f"Machine.{name} must be finite and >= 0, got {v}")

    def adam_rate(self, state_dtype: str) -> float:
        """Adam elements/s with moments in `state_dtype` (measured, else the fp32 rate)."""
        return self.adam_eps_by_state.get(state_dtype, self.adam_eps)

    @property
    def device(self) -> str:
        return "cpu" if not self.copy_Bps else "cuda"


@dataclass(frozen=True)
class Budgets:
    """Bytes per rank the user gives offload: host memory (store, optimizer state on
    the host, I/O buffers) and the device tier."""

    host: int
    device: int


@dataclass(frozen=True)
class Space:
    """The values searched for each knob (the io ones only where something is on NVMe,
    prefetch only where parameters stream from NVMe)."""

    placements: tuple[Placement, ...] = PLACEMENTS
    prefetch_depths: tuple[int, ...] = (1, 2, 4)
    buffers: tuple[int, ...] = (2, 4, 6)
    buffer_budgets: tuple[int, ...] = (4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    state_dtypes: tuple[str, ...] = ("fp32",)  # optim.state_dtype: compressed moments are opt-in


@dataclass(frozen=True)
class Candidate:
    """One configuration: the engine, optim, io and store keys it sets."""

    placement: Placement
    group_size: int
    prefetch_depth: int
    buffers: int
    buffer_budget: int
    block_size: int
    queue_depth: int
    host_budget: int        # store.host_budget
    device_budget: int      # store.device_budget
    state_dtype: str = "fp32"  # optim.state_dtype

    def keys(self) -> dict[str, dict[str, object]]:
        """The configuration sections this candidate sets (merge with the rest)."""
        return {"engine": {**self.placement.engine_keys(), "group_size": self.group_size,
                           "prefetch_depth": self.prefetch_depth},
                "optim": {"buffers": self.buffers, "state_dtype": self.state_dtype},
                "io": {"buffer_budget": self.buffer_budget, "block_size": self.block_size,
                       "queue_depth": self.queue_depth},
                "store": {"host_budget": self.host_budget,
                          "device_budget": self.device_budget}}


@dataclass
class Scored:
    """A candidate's predicted step (seconds), its parts, peak bytes per tier, bytes
    moved to and from the disk, and what limits it."""

    candidate: Candidate
    step_s: float
    compute_s: float
    adam_s: float
    exposed_io_s: float
    peak: dict[str, int]
    bytes_read: int
    bytes_written: int
    limit: str
    calibration: float = 1.0    # measured / simulated step of its placement, if measured
    notes: list[str] = field(default_factory=list)

    @property
    def simulated_s(self) -> float:
        """The simulator's step before calibration."""
        return self.step_s / self.calibration


def model_of(shape: StepShape, c: Candidate) -> ModelBytes:
    """`shape`'s bytes with the candidate's moments ([Note: compressed moments])."""
    return dataclasses.replace(shape.model, state_dtype=c.state_dtype)


def _memory(shape: StepShape, c: Candidate, budgets: Budgets,
            device: str) -> tuple[int, int, tuple[int, int]] | None:
    """(store host budget, store device budget, bytes each tier leaves for streamed
    records), or None when the budgets cannot hold what the placement homes in memory
    or its minimum working set."""
    p = c.placement
    tb = tier_bytes(model_of(shape, c), p, device=device, clipping=shape.clipping,
                    accum=shape.accum)
    kinds = kind_bytes(model_of(shape, c))
    opt_host = tb.optimizer.get("host", 0)
    # io.buffer_budget counts against the host budget with or without NVMe: the two
    # together are the ceiling of host bytes the written config allows
    store_host = budgets.host - opt_host - c.buffer_budget
    min_dev, min_host = shape.minimum[p.name]
    P, G = kinds["param"], kinds["grad"]
    stored = not early_updates(p, shape.dtype, clipping=shape.clipping, accum=shape.accum)
    dev_home = (P * (2 if p.optimizer == "nvme" else 1) if p.params == "device" else 0) + \
        (G if p.grads == "device" and stored else 0)
    host_home = tb.store["host"] if p.params != "nvme" else \
        (G if stored and p.grads in ("host", "nvme") else 0)
    if budgets.device < max(min_dev, dev_home) or store_host < max(min_host, host_home):
        return None
    return store_host, budgets.device, (budgets.device - dev_home, store_host - host_home)


def _records(shards: Sequence[tuple[int, bool]], dtype: str, p: Placement) -> dict:
    """The partitions the plan moves between memory and NVMe: parameters homed on NVMe
    (gradients homed there move whatever the budgets: `ModelledStep.grad_io`)."""
    item = DTYPE_BYTES[dtype]
    if p.params != "nvme":
        return {}
    return {("p", gid): RecordSpec(_footprint(n * item)) for gid, (n, _) in enumerate(shards)}


@dataclass(frozen=True)
class UnitUse:
    """One use of a unit in a step, as the modelled step takes it: "forward" or
    "backward", the groups it gathers, and its compute seconds."""

    kind: str
    gids: tuple[int, ...]
    compute_s: float
    label: str = ""


@dataclass
class ModelledStep:
    """A step's access trace ([Note: the modelled step]): its uses, the store's records
    they name, the optimizer's NVMe chunks (use index, key, bytes), the summed seconds
    of the units' compute and of Adam, and the reads and writes of gradients homed on
    NVMe (use index, "read" before it or "write" after it, key, bytes)."""

    uses: list[Use]
    records: dict
    streams: list[tuple[int, tuple, int]]
    compute_s: float
    adam_s: float
    grad_io: list[tuple[int, str, tuple, int]] = field(default_factory=list)

    @property
    def streamed_bytes(self) -> tuple[int, int]:
        """(read, written) bytes the step moves whatever the budgets: the optimizer's
        chunks both ways, and the gradients homed on NVMe."""
        state = sum(b for _, _, b in self.streams)
        read = sum(b for _, kind, _, b in self.grad_io if kind == "read")
        return state + read, state + sum(b for _, _, _, b in self.grad_io) - read


def modelled_step(units: Sequence[UnitUse], shards: Sequence[tuple[int, bool]], dtype: str,
                  placement: Placement, chunk: int, adam_eps: float, *,
                  chunk_overhead_s: float = 0.0, update_lane: str = "compute",
                  update_order: Sequence[int] | None = None,
                  between: Sequence[Use] = (), commit_s: float = 0.0,
                  grads_reserved: bool = False, state_dtype: str = "fp32",
                  staged: bool = False, master: bool, clipping: bool = False,
                  accum: int = 1) -> ModelledStep:
    """The access trace of one step ([Note: the modelled step]) from its unit uses in
    order (forward and backward, each with its compute seconds as given): each group's
    update after the backward of its unit where updates run early (on `update_lane`:
    the engine runs them on a thread of their own beside backward), else all after
    backward (in `update_order`, default by group); with NVMe optimizer state each
    update streams its state in chunks of `chunk` elements, each taking its elements
    over `adam_eps` plus `chunk_overhead_s`. `between`: uses inserted between the
    last forward and the first backward (the loss); `commit_s`: the commit's seconds;
    `grads_reserved`: gradients stored in memory (not on NVMe) take their bytes of the
    plan's budget from their backward to their update (`Use.reserved`); `state_dtype`:
    the form of Adam's moments in the chunks (`adam_eps` is that form's rate);
    `staged`: each update keeps its parameters' previous version until the commit
    (`commit_stages`, [Note: previous versions] in plan.py); `master`: whether chunks
    hold an fp32 master (`sizes.keeps_master`); `clipping` and `accum` (the micro-batches
    in `units`, engine.grad_accum_steps): whether updates wait for the end of backward.

    A stored gradient homed on NVMe is written down by each backward of its group
    (the engine evicts it once summed), read back by each later one to sum into, by
    the norm (clipping, fp16: one use per group after backward) and by its update
    (`grad_io`), whatever the budgets: it passes through the host memory `_memory`
    sets aside for it."""
    state_b = state_elem_bytes(master, state_dtype)
    early = early_updates(placement, dtype, clipping=clipping, accum=accum)
    records = _records(shards, dtype, placement)
    nvme_grads = not early and placement.grads == "nvme"
    uses: list[Use] = []
    streams: list[tuple[int, tuple, int]] = []
    grad_io: list[tuple[int, str, tuple, int]] = []
    fb = adam = 0.0
    held: dict[int, int] = {}  # gradients in memory now: gid -> bytes
    reserved = 0  # their sum
    in_memory = grads_reserved and not early and placement.grads != "nvme"

    def grad_bytes(gid: int) -> int:
        return _footprint(shards[gid][0] * 4)

    def unit_use(u: UnitUse) -> None:
        nonlocal fb, reserved
        keys = tuple(("p", g) for g in u.gids if ("p", g) in records)
        if u.kind == "backward":
            for g in u.gids:
                if nvme_grads and shards[g][1]:
                    if g in made:  # summed into: read back first
                        grad_io.append((len(uses), "read", ("g", g), grad_bytes(g)))
                    grad_io.append((len(uses), "write", ("g", g), grad_bytes(g)))
                    made.add(g)
            if in_memory:
                for g in u.gids:
                    if shards[g][1] and g not in held:
                        held[g] = grad_bytes(g)
                        reserved += held[g]
        fb += u.compute_s
        uses.append(Use(keys, (), u.kind, u.label or f"{u.kind} {u.gids}", u.compute_s,
                        reserved=reserved))

    def update(gid: int, lane: str) -> None:
        nonlocal adam, reserved
        n, trains = shards[gid]
        if not trains:
            return
        parts = [(k, min(chunk, n - k * chunk)) for k in range(-(-n // chunk))] if chunk \
            else [(None, n)]
        for j, (k, m) in enumerate(parts):
            if j == 0 and nvme_grads:
                grad_io.append((len(uses), "read", ("g", gid), grad_bytes(gid)))
            pw = (("p", gid),) if j == len(parts) - 1 and ("p", gid) in records else ()
            if staged:
                kept.extend(pw)
            if k is not None:
                streams.append((len(uses), ("s", gid, k), round(m * state_b)))
            t = m / adam_eps + (chunk_overhead_s if k is not None else 0.0)
            adam += t
            uses.append(Use(pw, pw, "update", f"adam {gid}", t, lane, reserved,
                            previous=pw if staged else (),
                            fresh=pw if dtype != "fp32" else ()))  # the master is apart
        reserved -= held.pop(gid, 0)  # the update frees the stored gradient

    done: set[int] = set()
    made: set = set()  # groups whose gradient this step's backward wrote
    kept: list = []  # records whose previous version waits for the commit
    backward = False
    for u in units:
        if u.kind == "backward" and not backward:
            backward = True
            uses.extend(between)
        unit_use(u)
        if early and u.kind == "backward":
            for g in u.gids:
                if g not in done:
                    done.add(g)
                    update(g, update_lane)
    if not early:
        if nvme_grads and (clipping or dtype == "fp16"):  # the norm reads every gradient
            for g in sorted(made):
                grad_io.append((len(uses), "read", ("g", g), grad_bytes(g)))
                uses.append(Use((), (), "norm", f"norm {g}", reserved=reserved))
        for g in (update_order if update_order is not None else range(len(shards))):
            update(g, "compute")
    uses.append(Use((), (), "commit", "commit", commit_s,  # the last chunk's write lands after
                    drops=tuple(previous_key(k) for k in kept)))
    return ModelledStep(uses, records, streams, fb, adam, grad_io)


def commit_stages(p: Placement, dtype: str, shards: Sequence[tuple[int, bool]],
                  budget: int, clipping: bool = False, accum: int = 1) -> bool:
    """True where the step's updates keep their parameters' previous versions until the
    commit, as the engine's `step()` does ([Note: all or nothing] in
    offload/engine/step.py): always but where the optimizer state is on the host and
    every gradient and parameter partition the updates touch fits `budget` at once
    (the engine then pins them all first and updates in place)."""
    if p.optimizer != "host" or early_updates(p, dtype, clipping=clipping, accum=accum):
        return True
    item = DTYPE_BYTES[dtype]
    need = sum(_footprint(n * item) + _footprint(n * 4) for n, trains in shards if trains)
    return need > budget


def _uses(shape: StepShape, c: Candidate, machine: Machine, staged: bool = False
          ) -> ModelledStep:
    """The modelled step of candidate `c` ([Note: the modelled step]): forward over the
    units, backward in reverse at twice the forward's seconds, each plus the machine's
    fixed cost per unit use (and, on a GPU, the copy up of parameters homed on the
    host), once per micro-batch (`shape.accum`)."""
    p = c.placement
    item = DTYPE_BYTES[shape.dtype]
    master = keeps_master(shape.dtype, p.params, machine.device)
    chunk = chunk_elems(c.buffer_budget, c.buffers, state_dtype=c.state_dtype,
                        master=master) if p.optimizer == "nvme" else 0

    def secs(gids: tuple[int, ...], s: float) -> float:
        extra = 0.0
        if machine.copy_Bps and p.params == "host":
            extra = sum(_footprint(shape.shards[g][0] * item) for g in gids) / machine.copy_Bps
        return s + machine.unit_overhead_s + extra
    micro = [UnitUse("forward", gids, secs(gids, s), f"forward {i}")
             for i, (gids, s) in enumerate(shape.units)]
    micro += [UnitUse("backward", shape.units[i][0], secs(shape.units[i][0],
                                                          2 * shape.units[i][1]),
                      f"backward {i}") for i in reversed(range(len(shape.units)))]
    units = micro * shape.accum
    return modelled_step(units, shape.shards, shape.dtype, p, chunk,
                         machine.adam_rate(c.state_dtype),
                         chunk_overhead_s=machine.chunk_overhead_s, state_dtype=c.state_dtype,
                         staged=staged, master=master, clipping=shape.clipping,
                         accum=shape.accum)


def _with_ops(plan: Plan, extra: list[PlanOp]) -> Plan:
    """`plan` with `extra` operations added whatever its budget (their memory is apart
    from it): each fetch listed at the use that needs it, their bytes counted."""
    by_use = {i: list(v) for i, v in plan.fetches_by_use.items()}
    moved = {"fetch": 0, "write-back": 0}
    for op in extra:
        moved[op.op] += op.nbytes
        if op.op == "fetch":
            by_use.setdefault(op.needed_at, []).append(op)
    return Plan(list(plan.ops) + extra, plan.budget, plan.held,
                plan.bytes_read + moved["fetch"], plan.bytes_written + moved["write-back"],
                by_use)


def _stream_state(plan: Plan, streams: list[tuple[int, tuple, int]], buffers: int) -> Plan:
    """Adds the optimizer's NVMe state traffic to `plan`: every chunk is read (at most
    `buffers - 1` chunks ahead of its update) and written back after it, every step:
    the pipeline streams it whatever the memory budgets ([Note: the modelled step])."""
    ops = []
    for n, (i, key, nbytes) in enumerate(streams):
        first = streams[max(0, n - max(0, buffers - 1))][0]
        ops += [PlanOp("fetch", key, nbytes, min(first, i), i),
                PlanOp("write-back", key, nbytes, i + 1, follows=i)]
    return _with_ops(plan, ops)


def _stream_grads(plan: Plan, grad_io: list[tuple[int, str, tuple, int]]) -> Plan:
    """Adds the traffic of gradients homed on NVMe (`ModelledStep.grad_io`): each read
    issued at the use that reads it (the engine fetches it there) and each write after
    the use that wrote it."""
    return _with_ops(plan, [PlanOp("fetch", key, nbytes, i, i) if kind == "read" else
                            PlanOp("write-back", key, nbytes, i + 1, follows=i)
                            for i, kind, key, nbytes in grad_io])


def _limit_lookahead(plan: Plan, uses: Sequence[Use], depth: int) -> Plan:
    """Parameter fetches issued when the engine issues them: for a unit's forward or
    backward, when the unit `depth` units before it starts (its look-ahead over the
    previous step's order of units; the loss, the updates' chunks and the commit are
    no units), or once the copies evicted for its room have had their last use if
    that is later ([Note: prefetch room] in offload/engine/eviction.py: the prefetch
    evicts what is needed after it); for an update, at the update (the update loop
    fetches on demand). The plan's own order of fetches does not hold it back."""
    units = [i for i, u in enumerate(uses) if u.kind in ("forward", "backward")]
    freed: dict[int, int] = {}  # use -> when the last copy evicted for its room left
    for op in plan.ops:
        if op.op == "evict" and op.needed_at is not None:
            freed[op.needed_at] = max(freed.get(op.needed_at, 0), op.at)
    held, ops = list(plan.held), []
    for op in plan.ops:
        if op.op == "fetch" and op.key[0] == "p":
            j = op.needed_at
            if uses[j].kind in ("forward", "backward"):
                at = units[max(0, bisect.bisect_left(units, j) - depth)]
                at = max(at, freed[j]) if j in freed else max(at, op.at)
            else:
                at = max(j, op.at)
            for t in range(op.at, at):  # not in flight before it is issued
                held[t] -= op.nbytes
            early = op.at  # issued earlier only while the budget has room for it
            while early > at and held[early - 1] + op.nbytes <= plan.budget:
                early -= 1
                held[early] += op.nbytes
            op = dataclasses.replace(op, at=max(at, early))
        ops.append(op)
    by_use: dict[int, list] = {}
    for op in ops:
        if op.op == "fetch":
            by_use.setdefault(op.needed_at, []).append(op)
    return Plan(ops, plan.budget, held, plan.bytes_read, plan.bytes_written, by_use)


def _write_on_demand(plan: Plan) -> Plan:
    """Evictions, and the write-backs of dirty victims, issued where the engine's store
    makes them: when a tier lacks room for a fetch (at the point the fetch is issued)
    or a put (at the use that puts), not right after the victim's last use. The use at
    that point waits for the write ([Note: the simulated step]); the victim's bytes
    stay held until then, so one is moved only where the budget has room for it that
    long and its record is not fetched back in between."""
    issue = {i: min(op.at for op in ops) for i, ops in plan.fetches_by_use.items()}
    fetched: dict = {}  # key -> points its fetches are issued at
    for op in plan.ops:
        if op.op == "fetch":
            fetched.setdefault(op.key, []).append(op.at)
    held, moved = list(plan.held), {}
    for op in plan.ops:  # where each victim leaves: at the need, where the budget
        if op.op == "evict" and op.needed_at is not None:  # holds it until then and
            at = max(op.at, min(issue.get(op.needed_at, op.needed_at), op.needed_at))
            if all(held[t] + op.nbytes <= plan.budget for t in range(op.at, at)) and \
                    not any(op.at <= f < at for f in fetched.get(op.key, ())):  # it is
                for t in range(op.at, at):                      # not fetched back first
                    held[t] += op.nbytes
                moved[(op.key, op.at)] = at
    ops = []
    for op in plan.ops:
        at = moved.get((op.key, op.at)) if op.needed_at is not None else None
        if op.op in ("write-back", "evict") and at is not None:
            op = dataclasses.replace(op, at=at, needed_at=at)
        ops.append(op)
    return Plan(ops, plan.budget, held, plan.bytes_read, plan.bytes_written,
                plan.fetches_by_use)


def steady_records(step: ModelledStep, budget: int) -> dict:
    """The step's records, all resident from the start where they fit `budget` together
    (a loop of steps then never evicts them; the plan's walk with `steady` makes
    those its steps write dirty before the step it plans)."""
    if sum(r.nbytes for r in step.records.values()) <= budget:
        return {k: RecordSpec(r.nbytes, resident=True) for k, r in step.records.items()}
    return dict(step.records)


def packed_budget(step: ModelledStep, tiers: Sequence[int]) -> int:
    """The bytes of `step`'s records that memory tiers of `tiers` bytes each are sure to
    hold together, a record whole in one tier ([Note: two tiers, one budget]); at
    least 1."""
    sizes = {r.nbytes for r in step.records.values()}
    total = sum(max(t, 0) for t in tiers)
    if len(tiers) < 2 or not sizes:
        return max(total, 1)
    if len(sizes) == 1:
        (s,) = sizes
        return max(sum(max(t, 0) // s for t in tiers) * s, 1)
    return max(total - (len(tiers) - 1) * max(sizes), 1)


# [Note: two tiers, one budget]
# The plan walks one budget, but the memory its records live in is two tiers (device
# and host: the device is the CPU too), and a record sits whole in one of them. Their
# sum over-promises: three 40 MB records do not fit tiers of 60 MB each, and a plan
# that counts 120 MB keeps a record the store must evict, which then comes back from
# NVMe as bytes the plan never counted. What two tiers of D and H bytes surely hold,
# records at most L bytes each: any set of at most D + H - L bytes (fill the device
# until a record does not fit: it then holds more than D - L, and the rest, less than
# H, fits the host); records all of one size s: (D // s + H // s) records, exactly.
# The engine's eviction fills tiers the same way (a record goes down only when its
# tier is full), so the plan keeps what the store can keep, and never more.


def plan_step(step: ModelledStep, tiers: Sequence[int], prefetch_depth: int,
              buffers: int) -> Plan:
    """The plan of a modelled step (`make_plan`) with memory tiers of `tiers` bytes for
    its records (`packed_budget`), as the engine executes it: parameter fetches issued
    no earlier than its look-ahead of `prefetch_depth` units (`_limit_lookahead`),
    write-backs where the room is needed (`_write_on_demand`), the optimizer's NVMe
    state streamed through `buffers` chunk buffers, and the gradients homed on NVMe
    moved where they are used. Raises ValueError when a use needs more than that
    budget at once."""
    budget = packed_budget(step, tiers)
    plan = make_plan(step.uses, steady_records(step, budget), budget, steady=True)
    plan = _write_on_demand(_limit_lookahead(plan, step.uses, prefetch_depth))
    return _stream_grads(_stream_state(plan, step.streams, buffers), step.grad_io)


def lru_step_bytes(step: ModelledStep, tiers: Sequence[int]) -> tuple[int, int]:
    """(read, written) bytes of the same step with on-demand fetches and least-recently-
    used eviction of its records (`lru_bytes`) under the same budget as `plan_step`,
    plus the optimizer's streamed state and the gradients' moves."""
    budget = packed_budget(step, tiers)
    read, written = lru_bytes(step.uses, steady_records(step, budget), budget, steady=True)
    more_read, more_written = step.streamed_bytes
    return read + more_read, written + more_written


def score(shape: StepShape, c: Candidate, budgets: Budgets, machine: Machine) -> Scored | None:
    """The predicted step of candidate `c`, or None when it does not fit."""
    mem = _memory(shape, c, budgets, machine.device)
    if mem is None:
        return None
    p = c.placement
    tb = tier_bytes(model_of(shape, c), p, device=machine.device, clipping=shape.clipping,
                    accum=shape.accum, buffer_budget=c.buffer_budget,
                    prefetch_depth=c.prefetch_depth, optim_buffers=c.buffers)
    if tb.total["nvme"] > machine.disk_free:
        return None
    if p.optimizer == "nvme" and not chunk_elems(
            c.buffer_budget, c.buffers, state_dtype=c.state_dtype,
            master=keeps_master(shape.dtype, p.params, machine.device)):
        return None
    staged = commit_stages(p, shape.dtype, shape.shards, sum(mem[2]), shape.clipping,
                           shape.accum)
    step = _uses(shape, c, machine, staged)
    fb, adam = step.compute_s, step.adam_s
    try:
        plan = plan_step(step, mem[2], c.prefetch_depth, c.buffers)
    except ValueError:  # a unit's partitions do not fit what the budgets leave
        return None
    pred = simulate(plan, step.uses, _disk_rates(machine, c))
    parts = {"compute": fb, "CPU": adam, "disk": pred.exposed_io_s}
    peak = {"device": min(tb.total["device"], budgets.device),
            "host": min(tb.total["host"], budgets.host), "nvme": tb.total["nvme"]}
    return Scored(c, pred.step_s, fb, adam, pred.exposed_io_s, peak, plan.bytes_read,
                  plan.bytes_written, max(parts, key=parts.get))


def _disk_rates(machine: Machine, c: Candidate) -> Rates:
    """The disk's rates at the candidate's block size and queue depth; a placement that
    keeps everything in memory moves nothing to or from NVMe and needs none."""
    rates = machine.disk.get((c.block_size, c.queue_depth))
    if rates is not None:
        return rates
    if "nvme" not in (c.placement.params, c.placement.grads, c.placement.optimizer):
        return Rates(float("inf"), float("inf"))  # no disk traffic to time
    raise ValueError(f"no disk rates measured for block size {c.block_size}, queue depth "
                     f"{c.queue_depth} (measured: {sorted(machine.disk)})")


def candidates(shape: StepShape, space: Space, budgets: Budgets,
               io_keys: Iterable[tuple[int, int]], defaults: Candidate) -> Iterator[Candidate]:
    """Every candidate of `space` for this grouping; knobs that change nothing for a
    placement keep their defaults (no duplicates)."""
    io_keys = list(io_keys)
    for p in space.placements:
        nvme = "nvme" in (p.params, p.grads, p.optimizer)
        depths = space.prefetch_depths if p.params == "nvme" else (defaults.prefetch_depth,)
        bufs = space.buffers if p.optimizer == "nvme" else (defaults.buffers,)
        sizes = [b for b in space.buffer_budgets if b <= budgets.host // 2] if nvme \
            else [defaults.block_size]  # nothing streams: the least the config takes
        ios = io_keys if nvme else [(defaults.block_size, defaults.queue_depth)]
        for d, b, s, (bs, qd), sd in itertools.product(depths, bufs, sizes, ios,
                                                      space.state_dtypes):
            if s < bs:  # io.buffer_budget holds at least one block
                continue
            yield dataclasses.replace(defaults, placement=p, group_size=shape.group_size,
                                      prefetch_depth=d, buffers=b, buffer_budget=s,
                                      block_size=bs, queue_depth=qd, state_dtype=sd)


def search(shapes: list[StepShape], space: Space, budgets: Budgets, machine: Machine,
           defaults: Candidate, progress: Callable[[int], None] | None = None) -> list[Scored]:
    """Every candidate that fits, best (shortest predicted step) first; `progress(n)`
    after each candidate scored."""
    out = []
    for shape in shapes:
        for c in candidates(shape, space, budgets, machine.disk, defaults):
            s = score(shape, c, budgets, machine)
            if s is not None:
                mem = _memory(shape, c, budgets, machine.device)
                s.candidate = dataclasses.replace(c, host_budget=mem[0],
                                                  device_budget=mem[1])
                out.append(s)
            if progress:
                progress(1)
    # among equal predictions: fewer bytes moved, less disk, smaller buffers
    return ranked(out)


def ranked(scored: list[Scored]) -> list[Scored]:
    """Best first; among equal predictions fewer bytes moved, less disk, smaller buffers."""
    return sorted(scored, key=lambda s: (round(s.step_s, 6), s.bytes_read + s.bytes_written,
                                         s.peak["nvme"], s.candidate.buffer_budget))


def calibration_key(c: Candidate) -> str:
    """The class a real step calibrates: a placement at a group size ("nvme/host/nvme@4194304")."""
    return f"{c.placement.name}@{c.group_size}"


def calibrate(scored: list[Scored], factors: Mapping[str, float]) -> list[Scored]:
    """Scales each prediction by the measured / simulated ratio of its class (`factors`,
    by `calibration_key`; a class not measured takes the median ratio of its
    placement's measured classes, else of the measured classes with the optimizer
    state in the same tier, else of all) and ranks again: the simulator orders the
    knobs within a class, real steps the classes ([Note: calibration] in
    docs/tuning.md)."""
    if not factors:
        return scored

    def median(vals: list[float]) -> float:
        vals = sorted(vals)
        return vals[len(vals) // 2]
    by_placement: dict[str, list[float]] = {}
    by_optimizer: dict[str, list[float]] = {}
    for k, f in factors.items():
        name = k.split("@")[0]
        by_placement.setdefault(name, []).append(f)
        by_optimizer.setdefault(name.split("/")[2], []).append(f)
    overall = list(factors.values())
    out = []
    for s in scored:
        p = s.candidate.placement
        f = factors.get(calibration_key(s.candidate)) or median(
            by_placement.get(p.name) or by_optimizer.get(p.optimizer) or overall)
        out.append(dataclasses.replace(s, step_s=s.simulated_s * f, calibration=f))
    return ranked(out)


def shortfall(shape: StepShape, budgets: Budgets, machine: Machine,
              buffer_budget: int) -> dict[str, int]:
    """When nothing fits: the bytes missing per tier for the placement that needs least
    memory (everything on NVMe): its minimum working set, the I/O buffers, the disk."""
    p = Placement("nvme", "nvme", "nvme")
    min_dev, min_host = shape.minimum[p.name]
    tb = tier_bytes(shape.model, p, device=machine.device, buffer_budget=buffer_budget,
                    clipping=shape.clipping, accum=shape.accum)
    host = max(min_host + buffer_budget, 2 * buffer_budget)  # buffers: at most half the host
    need = {"device": min_dev, "host": host, "nvme": tb.total["nvme"]}
    have = {"device": budgets.device, "host": budgets.host, "nvme": machine.disk_free}
    return {t: need[t] - have[t] for t in need if need[t] > have[t]}
