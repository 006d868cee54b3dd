"""`CpuAdam`: Adam / AdamW over flat fp32 partitions whose state lives on the host or NVMe.

Typical use (the engine's view)::

    opt = CpuAdam(cfg.optim, swap=swap, pool=pool)
    opt.add_partition("g0", master_g0)                     # host state, updated in place
    opt.add_partition("g1", master_g1, tier="nvme")        # state streamed from NVMe
    ...                                                    # backward produced g1's grad:
    opt.prefetch("g1")                                     # its first chunks start reading
    res = opt.step({"g0": grad0, "g1": grad1}, params_out={"g0": bf16_0, "g1": bf16_1},
                   loss_scale=scaler_scale)

[Note: early reads and early updates]
`prefetch(pid)` may be called as soon as backward produced a partition's
final gradient: it only starts reading the partition's first chunks into idle
pipeline buffers, which never changes a result. An *update* may run before the
whole backward is done (`update({pid: grad})` during backward, then `step()`
for the rest) only where its result is exactly that of the sequential step,
i.e. where nothing it depends on is still unknown:
  * no gradient clipping (optim.max_grad_norm = 0): the clip coefficient needs
    the global norm over every gradient; with clipping, an early update needs
    `grad_norm` passed in, which the engine knows only after backward;
  * not fp16 training: there an overflow anywhere skips the whole step, at any
    loss scale (1 included), so an early update needs `found_inf` passed in,
    known only after backward.
So bf16/fp32 training without clipping may update early; `early_update_allowed`
answers for clipping and a loss scale other than 1, `update` refuses those cases
unless given the values, and the engine never updates fp16 training early
(`OffloadEngine._early_allowed`): CpuAdam does not know the gradients' dtype.

[Note: rounds]
The updates between two commits form a round: each partition is updated at
most once in it, and the round commits as a whole (`commit`, which `step`
calls) or not at all (`rollback`, or a failed commit). Until then every
partition's previous version is kept: NVMe state in its committed extents
([Note: the round commits as a whole] in pipeline.py), host state in a copy
taken before its in-place update. An update the caller passes `final=True`
keeps no copy (nothing that runs after it in the round can fail); a rollback
cannot undo it, and the error says so. Reads (`read_master`,
`partition_state`) see the committed version.

[Note: learning-rate schedule]
Each group's `lr_lambda(k)` (a callable step -> multiplier, as in
torch.optim.lr_scheduler.LambdaLR) is evaluated at the optimizer's global
step k: the number of committed rounds before this one (`steps`, 0 for the
first), or the `schedule_step` the caller passes. Every update of a step uses
lr * lr_lambda(k), whether or not the partition was updated in earlier steps:
the same as LambdaLR stepped after each optimizer step. A scheduler of any
other kind may instead write `param_groups[i]["lr"]`: torch's schedulers take
the optimizer ([Note: what torch sees] in torch_view.py).

[Note: one set of values per round]
Every update of a round uses each group's values as the round's first update
of that group used them (lr after the schedule's multiplier, betas, eps,
weight decay). A write between two updates of one round would train part of
the step at one rate and the rest at another, which no torch step does; the
engine updates groups during backward ([Note: early update] in engine/updates.py), so
a write between the last backward and `step()` is such a write. An update
that would use other values than the round's earlier ones raises ValueError
before it changes anything, and `durable()` (so `commit`) rolls back a round
whose groups' values changed after they were used (OptimStepError).

[Note: segments]
A partition is cut into segments (`add_partition(..., segments=...)`): the
elements of one parameter on this rank, or padding. Each segment belongs to a
parameter group (its own lr, betas, eps, weight decay: a partition may hold
parameters of several groups) and counts its own updates (`seg_steps`, the
step of Adam's bias correction, as torch keeps `state[p]["step"]` per
parameter). An update may name the segments that had a gradient (`active`):
the others are left exactly as they are, moments and weights (no weight
decay, no moment decay), as torch leaves a parameter whose `.grad` is None.
Neighbouring segments of the same group and count run as one kernel call, so
a partition of one group costs one call per cache block as before.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch

from ..config import ConfigError, OffloadConfig, OptimConfig
from ..io import BufferPool, SwapSpace, make_engine, open_swap
from ..planner.sizes import MAX_AUTO_CHUNK, auto_chunk_elems
from ..trace import NULL_RECORDER, TraceRecorder
from .adam import AdamHyper, hyper_error, resolve_scaling
from .blocks import BlockUpdater
from .codec import Moment, SpareBuffers, copy_moment, encode, new_moment, zero_moment
from .pipeline import OptimStepError, SwapPipeline
from .snapshot import _OUT_DTYPES, StateAccess, flat_tensor
from .state import ChunkLayout, PartitionState, Segment, Tier, optim_tier, state_bytes
from .torch_view import TorchOptimizerView, check_same, group_values, unsupported_option

if TYPE_CHECKING:
    from ..store import TieredStore

log = logging.getLogger(__name__)

__all__ = ["CpuAdam", "StepResult", "resolve_chunk_elems"]

def _slot_bytes(chunk_elems: int, masters: bool, state_dtype: str) -> int:
    """Bytes of one chunk buffer: a chunk's state, with its master where `masters`."""
    return state_bytes(chunk_elems, 3 if masters else 2, state_dtype)


def resolve_chunk_elems(cfg: OptimConfig, budget_bytes: int | None, masters: bool = True) -> int:
    """Elements per NVMe chunk: `cfg.chunk_elems`, or (when 0) the largest power of two
    such that `cfg.buffers` chunk buffers (`state_bytes`: 12 bytes/element with fp32
    moments and a master, 8 without one) take at most `cfg.buffer_share` of
    `budget_bytes`, within [4096, 2**23] elements (`planner.sizes.auto_chunk_elems`).
    `masters`: whether chunks hold a master (False where every fp32 parameter is
    its own master: fp32 training).

    Raises ConfigError (a ValueError) when the chunks cannot fit the budget.
    """
    if budget_bytes is None:
        return cfg.chunk_elems or MAX_AUTO_CHUNK
    if cfg.chunk_elems:
        need = cfg.buffers * _slot_bytes(cfg.chunk_elems, masters, cfg.state_dtype)
        if need > budget_bytes:
            raise ConfigError(f"optim.chunk_elems={cfg.chunk_elems} x optim.buffers={cfg.buffers} "
                              f"needs {need} bytes of buffers, the pool holds {budget_bytes}; "
                              "lower them or raise io.buffer_budget")
        return cfg.chunk_elems
    n = auto_chunk_elems(budget_bytes, cfg.buffers, cfg.buffer_share, cfg.state_dtype, masters)
    if not n:
        raise ConfigError(f"io.buffer_budget={budget_bytes} bytes x optim.buffer_share="
                          f"{cfg.buffer_share} leaves under 4096 elements per chunk for "
                          f"{cfg.buffers} buffers; raise the budget or set optim.chunk_elems")
    return n


def _check_group(k: int, group: Mapping[str, Any], decoupled: bool,
                 lr: float | None = None) -> None:
    """Raises ValueError where param group `k`'s values are ones torch.optim.AdamW refuses
    (`adam.hyper_error`) or asks what this optimizer does not run (`decoupled`: its
    decay is AdamW's); `lr`: the rate after the schedule's multiplier, where known."""
    bad = unsupported_option(group, decoupled) or hyper_error(
        group["lr"] if lr is None else lr, group["betas"], group["eps"],
        group["weight_decay"], scheduled=lr is not None)
    if bad:
        raise ValueError(f"param_groups[{k}]: {bad}"
                         + ("" if lr is None else " (lr times the schedule's multiplier)"))


def _master_and_out(master: torch.Tensor | None, out: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the tensor Adam updates as the master, the copy it also writes): where no master
    is kept (master_is_param), the caller's fp32 parameter is updated in place."""
    return (out, None) if master is None else (master, out)


@dataclass(frozen=True)
class StepResult:
    """What one `step` / `update` did.

    `grad_norm`: global 2-norm of the unscaled gradients, when computed or given.
    `grad_scale`: the divisor applied to every gradient (loss scale / clip coefficient).
    `bytes_read` / `bytes_written`: NVMe bytes this call used and wrote (reads
    started early by `prefetch` count here). `seconds`: wall time.
    """

    skipped: bool
    updated: tuple[Hashable, ...]
    grad_norm: float | None
    clip_coef: float
    grad_scale: float
    seconds: float
    bytes_read: int = 0
    bytes_written: int = 0


class CpuAdam(StateAccess, TorchOptimizerView):
    """Adam or AdamW (`config.name`) over flat fp32 partitions; see the module notes.

    Args:
        config: hyper-parameter defaults, kernel and pipeline sizes.
        param_groups: one dict per group overriding `lr`, `betas`, `eps`,
            `weight_decay`, `lr_lambda`; default one group of the config's values.
        swap, pool: needed for partitions with tier="nvme": the swap space that
            holds their chunks and the pool lending the pipeline's buffers.
        buffer_budget: bytes of `pool` the pipeline's buffers size their chunks
            from (`resolve_chunk_elems`; default the pool's whole budget); the
            engine passes io.buffer_budget, its share of the store's pool.
        lr_lambda: default schedule of every group, step -> lr multiplier.
        masters: whether NVMe partitions may keep their own fp32 master. False
            (fp32 training, every partition added with master_is_param) sizes the
            pipeline's chunk buffers for the moments alone: larger chunks from
            the same budget; adding an NVMe partition with a master then raises.
    Thread safe: calls serialise; `prefetch` (e.g. from the autograd thread) never waits.
    """

    def __init__(self, config: OptimConfig | None = None, *,
                 param_groups: Sequence[Mapping[str, Any]] | None = None,
                 swap: SwapSpace | None = None, pool: BufferPool | None = None,
                 lr_lambda: Callable[[int], float] | None = None,
                 recorder: TraceRecorder = NULL_RECORDER,
                 buffer_budget: int | None = None, masters: bool = True) -> None:
        cfg = config or OptimConfig()
        self.config = cfg
        self.decoupled = cfg.name == "adamw"
        self.max_grad_norm = cfg.max_grad_norm
        defaults = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay, "lr_lambda": lr_lambda}
        self.defaults = dict(defaults)  # [Note: what torch sees]
        self.param_groups: list[dict[str, Any]] = []
        for k, g in enumerate(param_groups or [{}]):
            unknown = set(g) - set(defaults)
            if unknown:
                raise ValueError(f"param_groups[{k}]: unknown keys {sorted(unknown)}; known: "
                                 f"{sorted(defaults)} (partitions join with add_partition)")
            grp = {**defaults, **g, "params": []}
            _check_group(k, grp, self.decoupled)
            self.param_groups.append(grp)
        self.state_dtype = cfg.state_dtype
        self.kernel = BlockUpdater(cfg.kernel, cfg.block_elems)
        if (swap is None) != (pool is None):
            raise ValueError("pass both swap and pool (NVMe state) or neither (host state only)")
        self.swap = swap
        self.masters = masters
        self.chunk_elems = resolve_chunk_elems(
            cfg, None if pool is None else buffer_budget or pool.budget, masters)
        self._pipeline = None if swap is None else SwapPipeline(
            swap, pool, chunk_elems=self.chunk_elems, buffers=cfg.buffers, recorder=recorder,
            slot_bytes=_slot_bytes(self.chunk_elems, masters, self.state_dtype))
        self.recorder = recorder
        self._parts: dict[Hashable, PartitionState] = {}
        self._round: set[Hashable] = set()  # updated in the open round ([Note: rounds])
        self._final: set[Hashable] = set()  # of those, updated with final=True
        # host partitions updated in the round: (step, copies of their state) before it
        self._backups: dict[Hashable, tuple[int, tuple]] = {}
        self._seg_backups: dict[Hashable, list[int]] = {}  # seg_steps before the round
        # group -> its values the open round's updates used ([Note: one set of values
        # per round])
        self._round_values: dict[int, tuple] = {}
        self._spare = SpareBuffers()  # [Note: the copies' buffers]
        self.steps = 0  # committed rounds: the schedule's step ([Note: learning-rate schedule])
        self._lock = threading.RLock()
        self._owned: tuple = ()  # I/O objects `open` made for this optimizer, closed with it

    @classmethod
    def open(cls, config: OffloadConfig, *, rank: int = 0, nvme: bool = False,
             lr_lambda: Callable[[int], float] | None = None,
             param_groups: Sequence[Mapping[str, Any]] | None = None,
             recorder: TraceRecorder = NULL_RECORDER,
             store: TieredStore | None = None, masters: bool = True) -> "CpuAdam":
        """A `CpuAdam` from the whole configuration. With `nvme`, its state lives in the
        swap file `offload-r<rank>-optim.swap` under `io.paths`, staged through a pool
        of `io.buffer_budget` bytes. Given a `store`, the swap file is the store's
        (opened, locked and removed by it), its I/O goes through the store's
        engine (one engine queues against the disk) and its buffers come from the
        store's pool (one pool holds every host byte of training state). Without,
        the optimizer opens its own engine, swap file and pool. What it opens,
        `close()` closes. `masters`: as in `CpuAdam` (False: every partition will be
        added with master_is_param, and NVMe chunk buffers hold moments alone)."""
        if not nvme:
            return cls(config.optim, lr_lambda=lr_lambda, param_groups=param_groups,
                       recorder=recorder, masters=masters)
        engine = swap = pool = None
        try:
            if store is not None:
                swap, pool = store.swap_space("optim"), store.buffer_pool
            else:
                engine = make_engine(config.io, recorder)
                swap = open_swap(config.io, f"r{rank}-optim", engine)
                pool = BufferPool(config.io.buffer_budget)
            opt = cls(config.optim, swap=swap, pool=pool, lr_lambda=lr_lambda,
                      param_groups=param_groups, recorder=recorder,
                      buffer_budget=config.io.buffer_budget, masters=masters)
        except BaseException:
            for thing in () if store is not None else (pool, swap, engine):
                if thing is not None:
                    thing.close()
            raise
        # closed in this order by close(), unless the store's: buffers, swap, engine
        opt._owned = () if store is not None else (
            lambda: pool.close(force=True), swap.close, engine.close)
        return opt

    # -- partitions ------------------------------------------------------------
    @property
    def partitions(self) -> list[Hashable]:
        """Partition ids in the order they were added."""
        return list(self._parts)

    def partition(self, pid: Hashable) -> PartitionState:
        """The record of partition `pid` (read it; do not modify it)."""
        try:
            return self._parts[pid]
        except KeyError:
            raise KeyError(f"unknown partition {pid!r}; known: {list(self._parts)[:8]}") from None

    def add_partition(self, pid: Hashable, master: torch.Tensor, *, group: int = 0,
                      tier: str | Tier = "host", exp_avg: torch.Tensor | None = None,
                      exp_avg_sq: torch.Tensor | None = None,
                      master_is_param: bool = False,
                      segments: Sequence[tuple[int, int, int]] | None = None,
                      step: int = 0, segment_steps: Sequence[int] | None = None,
                      origin: int = 0) -> None:
        """Registers a partition at `step` (completed updates: 0 for a fresh one, a
        checkpoint's count on resume), with zero moments unless given.

        `master` (and the moments): fp32, contiguous CPU, one element per
        partition element; the moments are stored in `optim.state_dtype`'s form
        (a copy where that is not fp32). tier="host": the master and fp32 moments
        are kept (not copied) and updated in place. tier="nvme": written to fresh
        swap extents chunk by chunk; not kept.

        master_is_param: the caller's fp32 parameter partition is the master
        (fp32 training keeps no second copy). It is passed to every update as
        `params_out` and updated in place there; `master` only gives the size,
        and the optimizer holds the moments alone (8 bytes per element).

        segments: (first element, elements, parameter group) of consecutive ranges
        covering the partition in order ([Note: segments]); default one segment
        of `group`. segment_steps: each segment's update count (default `step`).
        origin: the index of element 0 in bf16 moments' stochastic rounding ([Note:
        stochastic rounding] in codec.py): its place in what the caller shards (the
        engine: the model's flat weights), so that the bits do not depend on how many
        ranks share it.
        """
        with self._lock:
            tier = optim_tier(tier)
            if pid in self._parts:
                raise ValueError(f"partition {pid!r} is already registered")
            if step < 0:
                raise ValueError(f"partition {pid!r}: step {step} is negative")
            if origin < 0:
                raise ValueError(f"partition {pid!r}: origin {origin} is negative")
            if not 0 <= group < len(self.param_groups):
                raise ValueError(f"group {group} out of range 0..{len(self.param_groups) - 1}")
            if not isinstance(master, torch.Tensor):
                raise TypeError(f"partition {pid!r}: master must be a torch.Tensor, got "
                                f"{type(master).__name__}")
            master = flat_tensor(master, f"partition {pid!r} master", master.numel(), (torch.float32,))
            if master.numel() == 0:
                raise ValueError(f"partition {pid!r} is empty")
            segs = self._checked_segments(pid, master.numel(), segments, group)
            if tier is Tier.NVME and not (master_is_param or self.masters):
                raise ValueError(f"partition {pid!r} keeps its own master on NVMe, but this "
                                 "optimizer's chunk buffers were sized without masters "
                                 "(masters=False); add it with master_is_param=True or "
                                 "build the optimizer with masters=True")
            layout = ChunkLayout(master.numel(), self.chunk_elems, 2 if master_is_param else 3,
                                 self.state_dtype)
            moments = [None if t is None else flat_tensor(t, f"partition {pid!r} {k}", master.numel(),
                                                    (torch.float32,))
                       for k, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))]
            kept = None if master_is_param else master
            if tier is Tier.HOST:
                a, s = (self._host_moment(k, t, master.numel())
                        for k, t in zip(("exp_avg", "exp_avg_sq"), moments))
                part = PartitionState(pid, master.numel(), group, tier, layout, step=step,
                                      host=(kept, a, s), segments=segs, origin=origin)
            else:
                part = PartitionState(pid, master.numel(), group, tier, layout, segments=segs,
                                      origin=origin)
                part.commit(self._need_pipeline(pid).swap,
                            self._write_new(part, kept, *moments), step=step)
            part.seg_steps = self._checked_seg_steps(
                part, {} if segment_steps is None else {"segment_steps": list(segment_steps)},
                step)
            self._parts[pid] = part
            for k in sorted({seg.group for seg in segs}):
                self.param_groups[k]["params"].append(pid)

    def _checked_segments(self, pid: Hashable, numel: int,
                          segments: Sequence[tuple[int, int, int]] | None,
                          group: int) -> tuple[Segment, ...]:
        if segments is None:
            return (Segment(0, numel, group),)
        segs = tuple(Segment(int(lo), int(n), int(k)) for lo, n, k in segments)
        at = 0
        for seg in segs:
            if seg.lo != at or seg.n < 1:
                raise ValueError(f"partition {pid!r}: segment {seg} does not start at element "
                                 f"{at} or is empty; give consecutive ranges covering 0..{numel}")
            if not 0 <= seg.group < len(self.param_groups):
                raise ValueError(f"partition {pid!r}: segment {seg} names group {seg.group}, "
                                 f"out of range 0..{len(self.param_groups) - 1}")
            at += seg.n
        if at != numel:
            raise ValueError(f"partition {pid!r}: segments cover {at} elements, the partition "
                             f"has {numel}")
        return segs

    def _host_moment(self, kind: str, t: torch.Tensor | Moment | None, n: int) -> Moment:
        """A host moment in this optimizer's form: an fp32 tensor kept as is (fp32
        state) or encoded into a new one; a `Moment` of that form copied; None: zeros."""
        if isinstance(t, torch.Tensor) and self.state_dtype == "fp32":
            return Moment(t, None, kind)
        m = new_moment(self.state_dtype, kind, n)
        if isinstance(t, Moment):
            copy_moment(m, t)
        elif t is not None:
            encode(t, m, torch.empty(n, dtype=torch.float32))
        return m

    def has_master(self, pid: Hashable) -> bool:
        """False where the partition's master is the caller's parameter partition."""
        return not self.partition(pid).master_is_param

    def _need_pipeline(self, pid: Hashable) -> SwapPipeline:
        if self._pipeline is None:
            raise ValueError(f"partition {pid!r} has tier 'nvme' but the optimizer has no swap "
                             "space; construct CpuAdam with swap= and pool=")
        return self._pipeline

    def _write_new(self, part: PartitionState, master: torch.Tensor | None,
                   exp_avg: torch.Tensor | None, exp_avg_sq: torch.Tensor | None) -> list:
        """Writes a whole NVMe state to fresh extents; kinds given as None are zeros,
        or kept from the current extents when the partition has some. Moments: fp32
        tensors (encoded chunk by chunk) or `Moment`s of this optimizer's form."""
        keep = part.extents is not None
        tmp = torch.empty(min(part.numel, self.chunk_elems), dtype=torch.float32)

        def fill(_p, _i, lo, n, m_buf, a_buf, s_buf) -> None:
            if m_buf is not None:  # else no master kept
                if master is not None:
                    m_buf.copy_(master[lo:lo + n])
                elif not keep:
                    m_buf.zero_()
            for src, dst in ((exp_avg, a_buf), (exp_avg_sq, s_buf)):
                if isinstance(src, Moment):
                    copy_moment(dst, src[lo:lo + n])
                elif src is not None:
                    encode(src[lo:lo + n], dst, tmp[:n])
                elif not keep:
                    zero_moment(dst)
        return self._need_pipeline(part.pid).write_state(part, fill, keep_old=keep)

    # -- step ------------------------------------------------------------------
    def early_update_allowed(self, loss_scale: float = 1.0) -> bool:
        """True when `update` may run for a partition before backward has finished
        with the others, results unchanged: no clipping and no loss scaling
        ([Note: early reads and early updates])."""
        return self.max_grad_norm == 0 and loss_scale == 1.0

    def prefetch(self, pid: Hashable) -> int:
        """Starts reading the first chunks of NVMe partition `pid` into idle pipeline
        buffers; returns the chunks in flight for it. Never waits: 0 for host
        partitions, when no buffer is idle, or while another call (a step) runs.
        Safe at any time and from any thread: reads change no result."""
        if not self._lock.acquire(blocking=False):
            return 0  # a step (or another call) is running: never stall the caller
        try:
            part = self.partition(pid)
            if part.tier is Tier.HOST:
                return 0
            return self._pipeline.prefetch(part, max(1, self._pipeline.nbuf - 1))
        finally:
            self._lock.release()

    def step(self, grads: Mapping[Hashable, torch.Tensor] | None = None, *,
             params_out: Mapping[Hashable, torch.Tensor] | None = None, loss_scale: float = 1.0,
             grad_norm: float | None = None, found_inf: bool | None = None,
             skip: Iterable[Hashable] = (),
             masters: Mapping[Hashable, torch.Tensor] | None = None,
             final: bool = False,
             active: Mapping[Hashable, Sequence[bool]] | None = None) -> StepResult:
        """Updates every partition not already updated by `update` in this round, then
        commits the round ([Note: rounds]).

        Args:
            grads: partition id -> its fp32 gradient (loss-scaled); read, never written.
            params_out: partition id -> bf16/fp16/fp32 tensor that receives the new
                weights (master rounded to its dtype), written in the same pass.
            loss_scale: the gradients' scale; they are divided by it (with the clip
                coefficient) inside the update.
            grad_norm: the global (all ranks) 2-norm of the unscaled gradients; computed
                from `grads` when clipping needs it and it is not given.
            found_inf: a non-finite gradient was seen; skips the step. When None and
                loss_scale != 1 it is derived from the gradients' norm (one read pass).
            masters, final, active: as in `update`.
        Raises:
            OptimStepError: a failure part way; the round was rolled back (see its
                `unchanged`), every partition is at its previous version.
        """
        if grads is None or callable(grads):  # torch's `optimizer.step()` / `step(closure)`
            raise TypeError("CpuAdam.step takes the gradients of its partitions, which the "
                            "engine holds: in a training loop call engine.step() (after "
                            "engine.backward(loss)), not engine.optimizer.step()")
        with self._lock:
            skip = set(skip)
            missing = [p for p in self._parts
                       if p not in self._round and p not in grads and p not in skip]
            if missing:
                raise ValueError(f"step: no gradient for partition(s) {missing[:8]}; every "
                                 "partition not updated early needs one, or list it in skip "
                                 "(as torch skips parameters whose grad is None)")
            res = self.update(grads, params_out=params_out, loss_scale=loss_scale,
                              grad_norm=grad_norm, found_inf=found_inf, masters=masters,
                              final=final, active=active)
            self.commit(grad_norm=res.grad_norm)
            return res

    @property
    def round(self) -> list[Hashable]:
        """Partitions updated in the open round, not yet committed."""
        with self._lock:
            return [p for p in self._parts if p in self._round]

    def durable(self, grad_norm: float | None = None) -> None:
        """Waits for the open round's NVMe writes, so that `commit` after it cannot fail.

        Raises:
            OptimStepError: a write failed; the whole round was rolled back.
        """
        with self._lock:
            try:
                for group, used in self._round_values.items():
                    check_same(group, used, group_values(self.param_groups[group]))
                if self._pipeline is not None:
                    self._pipeline.durable()
            except Exception as e:
                raise self._failed_round(e, grad_norm) from e

    def commit(self, grad_norm: float | None = None) -> None:
        """Commits the round: every update since the last commit becomes the partitions'
        state, all together ([Note: rounds]). Waits for the NVMe writes.

        Raises:
            OptimStepError: a write failed; the whole round was rolled back.
        """
        with self._lock:
            self.durable(grad_norm)
            if self._pipeline is not None:
                self._pipeline.commit()  # its writes are durable: installs, cannot fail
            if self._round:
                self.steps += 1
            self._opt_called = True  # torch's schedulers check they step after this
            self._drop_backups()
            self._seg_backups.clear()
            self._round.clear()
            self._round_values.clear()
            self._final.clear()

    def _drop_backups(self) -> None:
        for _, copies in self._backups.values():
            self._spare.give(*copies)
        self._backups.clear()

    def rollback(self) -> list[Hashable]:
        """Undoes the open round: every partition updated in it gets back its previous
        state and step ([Note: rounds]); returns their ids. Partitions updated with
        `final=True` cannot be undone: RuntimeError (after undoing the others)."""
        with self._lock:
            undone = [p for p in self._parts if p in self._round and p not in self._final]
            if self._pipeline is not None:
                self._pipeline.rollback()
            for pid, (step, (m0, a0, s0)) in self._backups.items():
                part = self._parts[pid]
                if m0 is not None:
                    part.host[0].copy_(m0)
                copy_moment(part.host[1], a0)
                copy_moment(part.host[2], s0)
                part.step = step
            for pid, seg_steps in self._seg_backups.items():
                self._parts[pid].seg_steps = seg_steps
            final = [p for p in self._parts if p in self._final]
            self._drop_backups()
            self._seg_backups.clear()
            self._round.clear()
            self._round_values.clear()
            self._final.clear()
            if final:
                raise RuntimeError(f"partition(s) {final[:8]} were updated with final=True: "
                                   "their previous state was not kept")
            return undone

    def _failed_round(self, cause: BaseException, grad_norm: float | None,
                      tried: Iterable[Hashable] = ()) -> OptimStepError:
        """Rolls the round back after `cause` (`tried`: the partitions of the call that
        failed, left as they were); the error to raise."""
        final = [p for p in self._parts if p in self._final]
        self._final.clear()  # kept as updated: nothing can undo them
        undone = set(self.rollback()) | (set(tried) - set(final))
        undone = [p for p in self._parts if p in undone]
        shown = ", ".join(map(repr, undone[:16])) + (" ..." if len(undone) > 16 else "")
        return OptimStepError(f"optimizer step failed ({type(cause).__name__}: {cause}); "
                              f"{len(undone)} partition(s) left at their previous version "
                              f"({shown})"
                              + (f", {len(final)} updated without a kept version"
                                 if final else ""), final, undone, grad_norm)

    def update(self, grads: Mapping[Hashable, torch.Tensor], *,
               params_out: Mapping[Hashable, torch.Tensor] | None = None,
               loss_scale: float = 1.0, grad_norm: float | None = None,
               found_inf: bool | None = None, next_pid: Hashable | None = None,
               masters: Mapping[Hashable, torch.Tensor] | None = None,
               final: bool = False,
               active: Mapping[Hashable, Sequence[bool]] | None = None,
               schedule_step: int | None = None) -> StepResult:
        """Updates exactly the partitions in `grads` now (arguments as in `step`), in
        the open round: they commit with it ([Note: rounds]). A call that does not
        cover the whole round needs `grad_norm` when clipping and `found_inf` when
        loss-scaling. `params_out` is complete on return.
        `next_pid`: the partition the caller expects to update next; its NVMe state
        starts being read into buffers this update leaves idle.
        `masters`: for partitions whose master is the parameter (master_is_param),
        their current fp32 parameter, read only: the new one is written to
        `params_out` (without it, `params_out` is the master, updated in place).
        `final`: the caller guarantees nothing after this call can fail before the
        round commits, so host partitions keep no copy of their previous state.
        `active`: per partition, one flag per segment: whether its parameter had a
        gradient; the others are left untouched ([Note: segments]). Default: all.
        `schedule_step`: the step `lr_lambda` is evaluated at (default `steps`).

        Raises:
            OptimStepError: the update failed; the whole round was rolled back.
        """
        with self._lock:
            t0 = time.perf_counter()
            parts, g, out, mins = self._check_inputs(grads, params_out or {}, masters or {})
            if not parts:  # e.g. step() after every partition was updated early
                return StepResult(False, (), grad_norm, 1.0, loss_scale, 0.0)
            k = self.steps if schedule_step is None else schedule_step
            hypers: dict[int, AdamHyper] = {}
            runs = {p.pid: self._runs(p, (active or {}).get(p.pid), k, hypers)
                    for p in parts}  # checks `active` before anything changes
            now = {group: group_values(self.param_groups[group]) for group in hypers}
            for group, v in now.items():  # [Note: one set of values per round]
                if group in self._round_values:
                    check_same(group, self._round_values[group], v)
            whole = not self._round and len(parts) == len(self._parts)
            if not whole and self.max_grad_norm > 0 and grad_norm is None:
                raise ValueError("update of part of a step with clipping on needs grad_norm "
                                 "(the global norm); see early_update_allowed()")
            if not whole and loss_scale != 1.0 and found_inf is None:
                raise ValueError("update of part of a step with loss scaling needs found_inf; "
                                 "see early_update_allowed()")
            sc = resolve_scaling((g[p.pid] for p in parts), loss_scale=loss_scale,
                                 max_grad_norm=self.max_grad_norm, grad_norm=grad_norm,
                                 found_inf=found_inf)
            if sc.found_inf:
                log.info("optimizer step skipped: non-finite gradients (loss scale %g)", loss_scale)
                return StepResult(True, (), sc.grad_norm, sc.clip_coef, sc.grad_scale,
                                  time.perf_counter() - t0)
            r0, w0 = self._io_counters()
            try:
                updated = self._run(parts, g, out, mins, sc.grad_scale, next_pid, final, runs)
            except Exception as e:
                raise self._failed_round(e, sc.grad_norm, [p.pid for p in parts]) from e
            for group, v in now.items():
                self._round_values.setdefault(group, v)
            r1, w1 = self._io_counters()
            return StepResult(False, tuple(updated), sc.grad_norm, sc.clip_coef, sc.grad_scale,
                              time.perf_counter() - t0, r1 - r0, w1 - w0)

    def _io_counters(self) -> tuple[int, int]:
        p = self._pipeline
        return (p.bytes_read, p.bytes_written) if p is not None else (0, 0)

    def _check_inputs(self, grads: Mapping, params_out: Mapping,
                      masters: Mapping) -> tuple[list, dict, dict, dict]:
        unknown = [p for p in list(grads) + list(params_out) if p not in self._parts]
        if unknown:
            raise KeyError(f"unknown partition(s) {unknown[:8]}")
        again = [p for p in grads if p in self._round]
        if again:
            raise ValueError(f"partition(s) {again[:8]} were already updated in this step")
        parts = [self._parts[p] for p in self._parts if p in grads]
        g = {p.pid: flat_tensor(grads[p.pid], f"grad of {p.pid!r}", p.numel, (torch.float32,))
             for p in parts}
        out = {pid: flat_tensor(t, f"params_out of {pid!r}", self._parts[pid].numel, _OUT_DTYPES)
               for pid, t in params_out.items() if pid in grads}
        mins = {pid: flat_tensor(t, f"masters of {pid!r}", self._parts[pid].numel, (torch.float32,))
                for pid, t in masters.items() if pid in grads}
        for p in parts:
            if p.master_is_param and (p.pid not in out or out[p.pid].dtype != torch.float32):
                raise ValueError(f"partition {p.pid!r}: its master is the parameter "
                                 "partition (master_is_param): pass it, fp32, in params_out")
            if p.pid in mins and not p.master_is_param:
                raise ValueError(f"partition {p.pid!r} keeps its own master: pass no masters")
        return parts, g, out, mins

    def values(self) -> list[tuple]:
        """Each group's values as an update would read them now: lr, beta1, beta2, eps,
        weight_decay, lr_lambda."""
        return [group_values(g) for g in self.param_groups]

    def check_values(self, schedule_step: int | None = None) -> None:
        """Raises ValueError where a group holding partitions has values an update
        would refuse (at schedule step `schedule_step`, default `steps`): for a caller
        whose updates keep no previous version (`final=True`), before any begins."""
        with self._lock:
            k = self.steps if schedule_step is None else schedule_step
            for group, grp in enumerate(self.param_groups):
                if grp["params"]:
                    self._hyper(group, k)

    def _hyper(self, group: int, schedule_step: int) -> AdamHyper:
        grp = self.param_groups[group]
        _check_group(group, grp, self.decoupled)  # its values may have been written since
        lr = float(grp["lr"])
        if grp["lr_lambda"] is not None:
            lr *= float(grp["lr_lambda"](schedule_step))
            _check_group(group, grp, self.decoupled, lr)
        b1, b2 = grp["betas"]
        return AdamHyper(lr, float(b1), float(b2), float(grp["eps"]),
                         float(grp["weight_decay"]), self.decoupled)

    def _runs(self, part: PartitionState, active: Sequence[bool] | None, k: int,
              hypers: dict[int, AdamHyper]) -> list[tuple[int, int, AdamHyper | None, int]]:
        """(first element, elements, hyper-parameters or None to leave alone, segment
        step) of the partition's update, neighbours merged ([Note: segments]); each
        group's values at schedule step `k` are computed once, into `hypers`."""
        if active is not None and len(active) != len(part.segments):
            raise ValueError(f"active of {part.pid!r}: {len(active)} flags, the partition has "
                             f"{len(part.segments)} segments")
        runs: list[list] = []
        for i, seg in enumerate(part.segments):
            on = active is None or bool(active[i])
            key = (seg.group, part.seg_steps[i]) if on else None
            if runs and runs[-1][4] == key:
                runs[-1][1] += seg.n
            else:
                if on and seg.group not in hypers:
                    hypers[seg.group] = self._hyper(seg.group, k)
                runs.append([seg.lo, seg.n, hypers[seg.group] if on else None,
                             part.seg_steps[i], key])
        return [(lo, n, h, st) for lo, n, h, st, _ in runs]

    def _apply(self, part: PartitionState, runs: list, base: int, m: torch.Tensor,
               g: torch.Tensor, a: Moment, s: Moment, o: torch.Tensor | None,
               grad_scale: float, src: torch.Tensor | None = None) -> None:
        """The update of elements [base, base + m.numel()) (`m`, `a`, `s`, `o` are their
        views; `g` the whole partition's gradient) by `runs` (see `_runs`), one cache
        block at a time ([Note: blocks on worker threads] in blocks.py). `src`: the
        master's current values where `m` is a fresh buffer (`masters` of `update`)."""
        self.kernel.update(runs, base, m, g, a, s, o, grad_scale, src, origin=part.origin)

    def _count_segments(self, part: PartitionState, runs: list, final: bool) -> None:
        """Advances the update count of each segment that had a gradient."""
        if not final:
            self._seg_backups[part.pid] = list(part.seg_steps)
        skipped = [(lo, lo + n) for lo, n, h, _ in runs if h is None]
        for i, seg in enumerate(part.segments):
            if not any(lo <= seg.lo < hi for lo, hi in skipped):
                part.seg_steps[i] += 1

    def _run(self, parts: list[PartitionState], g: dict, out: dict, mins: dict,
             grad_scale: float, next_pid: Hashable | None, final: bool,
             runs: dict) -> list:
        """Host partitions in place (a copy of their state kept unless `final`), then
        NVMe partitions through the pipeline (its first reads start before the host
        work, so they overlap it)."""
        host = [p for p in parts if p.tier is Tier.HOST]
        nvme = [p for p in parts if p.tier is Tier.NVME]
        if nvme:
            first = {pid: k for k, pid in enumerate(self._pipeline.prefetched())}
            nvme.sort(key=lambda p: first.get(p.pid, len(first)))  # stable: then added order
            self._pipeline.prefetch(nvme[0], max(1, self._pipeline.nbuf - 1))
        done = []
        for p in host:
            if final:
                self._final.add(p.pid)
            else:
                m0, a0, s0 = p.host
                self._backups[p.pid] = (p.step, (None if m0 is None else self._spare.copy(m0),
                                                 self._spare.copy_moment(a0),
                                                 self._spare.copy_moment(s0)))
            self._round.add(p.pid)
            m, a, s = p.host
            m, o = _master_and_out(m, out.get(p.pid))
            with self.recorder.span("optim:update", cat="compute", track="optim",
                                    partition=str(p.pid), elems=p.numel):
                self._apply(p, runs[p.pid], 0, m, g[p.pid], a, s, o, grad_scale,
                            mins.get(p.pid))
            p.step += 1
            self._count_segments(p, runs[p.pid], final)
            done.append(p.pid)
        if not nvme:
            return done

        def compute(p, _i, lo, n, m, a, s) -> None:
            o = out.get(p.pid)
            m, o = _master_and_out(m, None if o is None else o[lo:lo + n])
            src = mins.get(p.pid)
            self._apply(p, runs[p.pid], lo, m, g[p.pid], a, s, o, grad_scale,
                        None if src is None else src[lo:lo + n])
        then = self._parts.get(next_pid) if next_pid is not None else None
        if then is not None and (then.tier is not Tier.NVME or then.pid in g
                                 or then.pid in self._round):
            then = None
        done += self._pipeline.run(nvme, compute, then=then)
        self._round.update(p.pid for p in nvme)
        for p in nvme:
            self._count_segments(p, runs[p.pid], final=False)
        return done

    # -- closing ----------------------------------------------------------------
    def close(self) -> None:
        """Waits for transfers, returns the pipeline's buffers and frees every NVMe
        partition's extents. The optimizer is unusable afterwards."""
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.close()
                for part in self._parts.values():
                    for ext in part.extents or ():
                        self._pipeline.swap.free(ext)
                    part.extents = None
            self._parts.clear()
            self.kernel.close()
            owned, self._owned = self._owned, ()
            for close in owned:  # what `open` made for this optimizer
                close()

    def __enter__(self) -> "CpuAdam":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
