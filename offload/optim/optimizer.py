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
  * no fp16 loss scaling (loss_scale = 1, i.e. bf16 or fp32 gradients): with it
    an overflow anywhere skips the whole step, so an early update needs
    `found_inf` passed in, known only after backward.
So bf16/fp32 training without clipping may update early; `early_update_allowed`
answers it, and `update` refuses the other cases unless given the values.

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
other kind may instead write `param_groups[i]["lr"]`.

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
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch

from ..config import OffloadConfig, OptimConfig
from ..io import BufferPool, SwapSpace, make_engine, open_swap
from ..trace import NULL_RECORDER, TraceRecorder
from .adam import AdamHyper, AdamKernel, resolve_scaling
from .pipeline import OptimStepError, SwapPipeline
from .state import BYTES_PER_ELEM, ChunkLayout, PartitionState, Segment, Tier

log = logging.getLogger(__name__)

__all__ = ["CpuAdam", "StepResult", "resolve_chunk_elems"]

_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_AUTO_CHUNK = 1 << 23  # elements: 96 MiB per buffer; larger only lengthens fill and drain


def resolve_chunk_elems(cfg: OptimConfig, budget_bytes: int | None) -> int:
    """Elements per NVMe chunk: `cfg.chunk_elems`, or (when 0) the largest power of two
    such that `cfg.buffers` chunk buffers (12 bytes/element) take at most
    `cfg.buffer_share` of `budget_bytes`, within [4096, 2**23] elements.

    Raises ValueError when an explicit size cannot fit the budget.
    """
    if budget_bytes is None:
        return cfg.chunk_elems or MAX_AUTO_CHUNK
    if cfg.chunk_elems:
        need = cfg.buffers * BYTES_PER_ELEM * cfg.chunk_elems
        if need > budget_bytes:
            raise ValueError(f"optim.chunk_elems={cfg.chunk_elems} x optim.buffers={cfg.buffers} "
                             f"needs {need} bytes of buffers, the pool holds {budget_bytes}; "
                             "lower them or raise io.buffer_budget")
        return cfg.chunk_elems
    per = int(budget_bytes * cfg.buffer_share) // (cfg.buffers * BYTES_PER_ELEM)
    if per < 4096:
        raise ValueError(f"io.buffer_budget={budget_bytes} bytes x optim.buffer_share="
                         f"{cfg.buffer_share} leaves under 4096 elements per chunk for "
                         f"{cfg.buffers} buffers; raise the budget or set optim.chunk_elems")
    return min(MAX_AUTO_CHUNK, 1 << (per.bit_length() - 1))


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


def _flat(t: torch.Tensor, what: str, numel: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{what}: a contiguous CPU tensor of {'/'.join(map(str, dtypes))} is "
                         f"needed, got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")
    if t.numel() != numel:
        raise ValueError(f"{what}: {t.numel()} elements, the partition has {numel}")
    return t.view(-1)


class CpuAdam:
    """Adam or AdamW (`config.name`) over flat fp32 partitions; see the module notes.

    Args:
        config: hyper-parameter defaults, kernel and pipeline sizes.
        param_groups: one dict per group overriding `lr`, `betas`, `eps`,
            `weight_decay`, `lr_lambda`; default one group of the config's values.
        swap, pool: needed for partitions with tier="nvme": the swap space that
            holds their chunks and the pool lending the pipeline's buffers.
        lr_lambda: default schedule of every group, step -> lr multiplier.
    Thread safe: calls serialise; `prefetch` (e.g. from the autograd thread) never waits.
    """

    def __init__(self, config: OptimConfig | None = None, *,
                 param_groups: Sequence[Mapping[str, Any]] | None = None,
                 swap: SwapSpace | None = None, pool: BufferPool | None = None,
                 lr_lambda: Callable[[int], float] | None = None,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        cfg = config or OptimConfig()
        self.config = cfg
        self.decoupled = cfg.name == "adamw"
        self.max_grad_norm = cfg.max_grad_norm
        defaults = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay, "lr_lambda": lr_lambda}
        self.param_groups: list[dict[str, Any]] = []
        for k, g in enumerate(param_groups or [{}]):
            unknown = set(g) - set(defaults)
            if unknown:
                raise ValueError(f"param_groups[{k}]: unknown keys {sorted(unknown)}; known: "
                                 f"{sorted(defaults)} (partitions join with add_partition)")
            self.param_groups.append({**defaults, **g, "params": []})
        self.kernel = AdamKernel(cfg.kernel, cfg.block_elems)
        if (swap is None) != (pool is None):
            raise ValueError("pass both swap and pool (NVMe state) or neither (host state only)")
        self.swap = swap
        self.chunk_elems = resolve_chunk_elems(cfg, pool.budget if pool is not None else None)
        self._pipeline = None if swap is None else SwapPipeline(
            swap, pool, chunk_elems=self.chunk_elems, buffers=cfg.buffers, recorder=recorder)
        self.recorder = recorder
        self._parts: dict[Hashable, PartitionState] = {}
        self._round: set[Hashable] = set()  # updated in the open round ([Note: rounds])
        self._final: set[Hashable] = set()  # of those, updated with final=True
        # host partitions updated in the round: (step, copies of their state) before it
        self._backups: dict[Hashable, tuple[int, tuple[torch.Tensor | None, ...]]] = {}
        self._seg_backups: dict[Hashable, list[int]] = {}  # seg_steps before the round
        self.steps = 0  # committed rounds: the schedule's step ([Note: learning-rate schedule])
        self._lock = threading.RLock()
        self._owned: tuple = ()  # I/O objects `open` made for this optimizer, closed with it

    @classmethod
    def open(cls, config: OffloadConfig, *, rank: int = 0, nvme: bool = False,
             lr_lambda: Callable[[int], float] | None = None,
             param_groups: Sequence[Mapping[str, Any]] | None = None,
             recorder: TraceRecorder = NULL_RECORDER) -> "CpuAdam":
        """A `CpuAdam` from the whole configuration. With `nvme`, it opens its own I/O
        engine, staging pool (`io.buffer_budget`) and swap file
        (`offload-r<rank>-optim.swap` under `io.paths`), and closes them in `close()`."""
        if not nvme:
            return cls(config.optim, lr_lambda=lr_lambda, param_groups=param_groups,
                       recorder=recorder)
        engine = make_engine(config.io, recorder)
        swap = pool = None
        try:
            swap = open_swap(config.io, f"r{rank}-optim", engine)
            pool = BufferPool(config.io.buffer_budget)
            opt = cls(config.optim, swap=swap, pool=pool, lr_lambda=lr_lambda,
                      param_groups=param_groups, recorder=recorder)
        except BaseException:
            for thing in (pool, swap, engine):
                if thing is not None:
                    thing.close()
            raise
        opt._owned = (swap, pool, engine)
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
                      step: int = 0, segment_steps: Sequence[int] | None = None) -> None:
        """Registers a partition at `step` (completed updates: 0 for a fresh one, a
        checkpoint's count on resume), with zero moments unless given.

        `master` (and the moments): fp32, contiguous CPU, one element per
        partition element. tier="host": kept (not copied) and updated in place.
        tier="nvme": written to fresh swap extents chunk by chunk; not kept.

        master_is_param: the caller's fp32 parameter partition is the master
        (fp32 training keeps no second copy). It is passed to every update as
        `params_out` and updated in place there; `master` only gives the size,
        and the optimizer holds the moments alone (8 bytes per element).

        segments: (first element, elements, parameter group) of consecutive ranges
        covering the partition in order ([Note: segments]); default one segment
        of `group`. segment_steps: each segment's update count (default `step`).
        """
        with self._lock:
            tier = Tier(tier)
            if pid in self._parts:
                raise ValueError(f"partition {pid!r} is already registered")
            if step < 0:
                raise ValueError(f"partition {pid!r}: step {step} is negative")
            if not 0 <= group < len(self.param_groups):
                raise ValueError(f"group {group} out of range 0..{len(self.param_groups) - 1}")
            if not isinstance(master, torch.Tensor):
                raise TypeError(f"partition {pid!r}: master must be a torch.Tensor, got "
                                f"{type(master).__name__}")
            master = _flat(master, f"partition {pid!r} master", master.numel(), (torch.float32,))
            if master.numel() == 0:
                raise ValueError(f"partition {pid!r} is empty")
            segs = self._checked_segments(pid, master.numel(), segments, group)
            layout = ChunkLayout(master.numel(), self.chunk_elems, 2 if master_is_param else 3)
            moments = [None if t is None else _flat(t, f"partition {pid!r} {k}", master.numel(),
                                                    (torch.float32,))
                       for k, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))]
            kept = None if master_is_param else master
            if tier is Tier.HOST:
                a, s = (torch.zeros_like(master) if t is None else t for t in moments)
                part = PartitionState(pid, master.numel(), group, tier, layout, step=step,
                                      host=(kept, a, s), segments=segs)
            else:
                part = PartitionState(pid, master.numel(), group, tier, layout, segments=segs)
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
        or kept from the current extents when the partition has some."""
        keep = part.extents is not None

        def fill(_p, _i, lo, n, m_buf, a_buf, s_buf) -> None:
            for src, dst in ((master, m_buf), (exp_avg, a_buf), (exp_avg_sq, s_buf)):
                if dst is None:  # no master kept
                    continue
                if src is not None:
                    dst.copy_(src[lo:lo + n])
                elif not keep:
                    dst.zero_()
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

    def step(self, grads: Mapping[Hashable, torch.Tensor], *,
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

    def commit(self, grad_norm: float | None = None) -> None:
        """Commits the round: every update since the last commit becomes the partitions'
        state, all together ([Note: rounds]). Waits for the NVMe writes.

        Raises:
            OptimStepError: a write failed; the whole round was rolled back.
        """
        with self._lock:
            try:
                if self._pipeline is not None:
                    self._pipeline.commit()
            except Exception as e:
                raise self._failed_round(e, grad_norm) from e
            if self._round:
                self.steps += 1
            self._backups.clear()
            self._seg_backups.clear()
            self._round.clear()
            self._final.clear()

    def rollback(self) -> list[Hashable]:
        """Undoes the open round: every partition updated in it gets back its previous
        state and step ([Note: rounds]); returns their ids. Partitions updated with
        `final=True` cannot be undone: RuntimeError (after undoing the others)."""
        with self._lock:
            undone = [p for p in self._parts if p in self._round and p not in self._final]
            if self._pipeline is not None:
                self._pipeline.rollback()
            for pid, (step, saved) in self._backups.items():
                part = self._parts[pid]
                for dst, src in zip(part.host, saved):
                    if src is not None:
                        dst.copy_(src)
                part.step = step
            for pid, seg_steps in self._seg_backups.items():
                self._parts[pid].seg_steps = seg_steps
            final = [p for p in self._parts if p in self._final]
            self._backups.clear()
            self._seg_backups.clear()
            self._round.clear()
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
            runs = {p.pid: self._runs(p, (active or {}).get(p.pid), schedule_step)
                    for p in parts}  # checks `active` before anything changes
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
        g = {p.pid: _flat(grads[p.pid], f"grad of {p.pid!r}", p.numel, (torch.float32,))
             for p in parts}
        out = {pid: _flat(t, f"params_out of {pid!r}", self._parts[pid].numel, _OUT_DTYPES)
               for pid, t in params_out.items() if pid in grads}
        mins = {pid: _flat(t, f"masters of {pid!r}", self._parts[pid].numel, (torch.float32,))
                for pid, t in masters.items() if pid in grads}
        for p in parts:
            if p.master_is_param and (p.pid not in out or out[p.pid].dtype != torch.float32):
                raise ValueError(f"partition {p.pid!r}: its master is the parameter "
                                 "partition (master_is_param): pass it, fp32, in params_out")
            if p.pid in mins and not p.master_is_param:
                raise ValueError(f"partition {p.pid!r} keeps its own master: pass no masters")
        return parts, g, out, mins

    def _hyper(self, group: int, schedule_step: int) -> AdamHyper:
        grp = self.param_groups[group]
        lr = float(grp["lr"])
        if grp["lr_lambda"] is not None:
            lr *= float(grp["lr_lambda"](schedule_step))
        b1, b2 = grp["betas"]
        return AdamHyper(lr, float(b1), float(b2), float(grp["eps"]),
                         float(grp["weight_decay"]), self.decoupled)

    def _runs(self, part: PartitionState, active: Sequence[bool] | None,
              schedule_step: int | None) -> list[tuple[int, int, AdamHyper | None, int]]:
        """(first element, elements, hyper-parameters or None to leave alone, segment
        step) of the partition's update, neighbours merged ([Note: segments])."""
        if active is not None and len(active) != len(part.segments):
            raise ValueError(f"active of {part.pid!r}: {len(active)} flags, the partition has "
                             f"{len(part.segments)} segments")
        k = self.steps if schedule_step is None else schedule_step
        runs: list[list] = []
        for i, seg in enumerate(part.segments):
            on = active is None or bool(active[i])
            key = (seg.group, part.seg_steps[i]) if on else None
            if runs and runs[-1][4] == key:
                runs[-1][1] += seg.n
            else:
                runs.append([seg.lo, seg.n, self._hyper(seg.group, k) if on else None,
                             part.seg_steps[i], key])
        return [(lo, n, h, st) for lo, n, h, st, _ in runs]

    def _apply(self, runs: list, base: int, m: torch.Tensor, g: torch.Tensor, a: torch.Tensor,
               s: torch.Tensor, o: torch.Tensor | None, grad_scale: float) -> None:
        """The update of elements [base, base + m.numel()) (`m`, `a`, `s`, `o` are their
        views; `g` the whole partition's gradient) by `runs` (see `_runs`)."""
        end = base + m.numel()
        for lo, n, hyper, step in runs:
            i, j = max(lo, base), min(lo + n, end)
            if i >= j:
                continue
            mi = m[i - base:j - base]
            oi = None if o is None else o[i - base:j - base]
            if hyper is None:  # no gradient: left as it is, as torch leaves it
                if oi is not None:
                    oi.copy_(mi)
                continue
            self.kernel.update(mi, g[i:j], a[i - base:j - base], s[i - base:j - base],
                               step=step + 1, hyper=hyper, grad_scale=grad_scale, param_out=oi)

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
                self._backups[p.pid] = (p.step, tuple(None if t is None else t.clone()
                                                      for t in p.host))
            self._round.add(p.pid)
            m, a, s = p.host
            m, o = _master_and_out(m, out.get(p.pid))
            if p.pid in mins:
                m.copy_(mins[p.pid])
            with self.recorder.span("optim:update", cat="compute", track="optim",
                                    partition=str(p.pid), elems=p.numel):
                self._apply(runs[p.pid], 0, m, g[p.pid], a, s, o, grad_scale)
            p.step += 1
            self._count_segments(p, runs[p.pid], final)
            done.append(p.pid)
        if not nvme:
            return done

        def compute(p, _i, lo, n, m, a, s) -> None:
            o = out.get(p.pid)
            m, o = _master_and_out(m, None if o is None else o[lo:lo + n])
            if p.pid in mins:
                m.copy_(mins[p.pid][lo:lo + n])
            self._apply(runs[p.pid], lo, m, g[p.pid], a, s, o, grad_scale)
        then = self._parts.get(next_pid) if next_pid is not None else None
        if then is not None and (then.tier is not Tier.NVME or then.pid in g
                                 or then.pid in self._round):
            then = None
        done += self._pipeline.run(nvme, compute, then=then)
        self._round.update(p.pid for p in nvme)
        for p in nvme:
            self._count_segments(p, runs[p.pid], final=False)
        return done

    # -- reading and checkpoints -----------------------------------------------
    def _committed_host(self, part: PartitionState) -> tuple[int, tuple]:
        """(step, (master, exp_avg, exp_avg_sq)) of a host partition's committed version."""
        return self._backups.get(part.pid, (part.step, part.host))

    def read_master(self, pid: Hashable, out: torch.Tensor) -> torch.Tensor:
        """Copies partition `pid`'s committed fp32 master into `out` (any float dtype,
        same numel, rounded to nearest even); e.g. to rebuild a compute-dtype copy.
        Returns `out`."""
        with self._lock:
            part = self.partition(pid)
            if part.master_is_param:
                raise ValueError(f"partition {pid!r} keeps no master: it is the caller's "
                                 "parameter partition (master_is_param)")
            flat = _flat(out, f"read_master out of {pid!r}", part.numel, _OUT_DTYPES)
            if part.tier is Tier.HOST:
                flat.copy_(self._committed_host(part)[1][0])
            else:
                self._pipeline.read_state(part, lambda _p, _i, lo, n, m, _a, _s:
                                          flat[lo:lo + n].copy_(m))
            return out

    # -- checkpoint reader (engine checkpoints) -- begin
    def read_state_chunks(self, pid: Hashable,
                          consume: Callable[[int, int, dict[str, torch.Tensor]], None]) -> int:
        """Streams partition `pid`'s committed state ([Note: rounds]: an update in the
        open round is not seen); returns its committed step count. `consume(lo, n,
        tensors)` gets elements [lo, lo + n) as 1-D fp32 views {"master", "exp_avg",
        "exp_avg_sq"} ("master" absent where it is the parameter partition), valid
        only during the call. Host state: one call (the live tensors, or the copy an
        update in the round kept); NVMe state: one call per chunk read into a pipeline
        buffer, so the state is never held whole. Refused for a partition updated
        with final=True in the open round (its committed version is gone)."""
        with self._lock:
            part = self.partition(pid)
            if pid in self._final:
                raise RuntimeError(f"partition {pid!r} was updated in place (final=True) in "
                                   "the open round: its committed state is gone")

            def named(m, a, s) -> dict[str, torch.Tensor]:
                d = {"exp_avg": a, "exp_avg_sq": s}
                if m is not None:
                    d["master"] = m
                return d
            if part.tier is Tier.HOST:
                step, host = self._committed_host(part)
                consume(0, part.numel, named(*host))
                return step
            self._pipeline.read_state(part, lambda _p, _i, lo, n, m, a, s:
                                      consume(lo, n, named(m, a, s)))
            return part.step  # an NVMe partition's step advances at its commit
    # -- checkpoint reader -- end

    def partition_state(self, pid: Hashable) -> dict[str, torch.Tensor]:
        """{"step", "segment_steps", "exp_avg", "exp_avg_sq", "master"} of one
        partition's committed version, 1-D fp32 (step: a 0-d fp32 tensor, as torch;
        segment_steps: int64, one per segment ([Note: segments]); no "master" where it
        is the parameter partition). Host state: the live tensors (no copy); NVMe state:
        fresh tensors read chunk by chunk."""
        with self._lock:
            part = self.partition(pid)
            step = torch.tensor(float(part.step))
            if part.tier is Tier.HOST:
                k, (m, a, s) = self._committed_host(part)
                step = torch.tensor(float(k))
            else:
                m, a, s = (torch.empty(part.numel, dtype=torch.float32) for _ in range(3))
                if part.master_is_param:
                    m = None

                def consume(_p, _i, lo, n, mb, ab, sb) -> None:
                    for src, dst in ((mb, m), (ab, a), (sb, s)):
                        if src is not None:
                            dst[lo:lo + n].copy_(src)
                self._pipeline.read_state(part, consume)
            seg_steps = torch.tensor(self._seg_backups.get(pid, part.seg_steps),
                                     dtype=torch.int64)
            state = {"step": step, "segment_steps": seg_steps, "exp_avg": a, "exp_avg_sq": s}
            if m is not None:
                state["master"] = m
            return state

    def load_partition_state(self, pid: Hashable, state: Mapping[str, Any]) -> None:
        """Loads one partition's state (keys as `partition_state`; "master" optional:
        absent keeps the current master; ignored where the master is the parameter
        partition; "segment_steps" optional: absent gives every segment `step`). NVMe: written to fresh extents, then
        switched, so a failure leaves the previous state whole."""
        with self._lock:
            part = self.partition(pid)
            step, tensors = self._checked_state(part, state)
            seg_steps = self._checked_seg_steps(part, state, step)
            if pid in self._round:
                raise ValueError(f"partition {pid!r} was updated in the open round; "
                                 "commit() or rollback() it before loading state")
            if part.tier is Tier.HOST:
                for k, dst in zip(("master", "exp_avg", "exp_avg_sq"), part.host):
                    if tensors[k] is not None and dst is not None:
                        dst.copy_(tensors[k])
                part.step = step
                part.seg_steps = seg_steps
                return
            self._pipeline.discard(pid)
            new = self._write_new(part, tensors["master"], tensors["exp_avg"],
                                  tensors["exp_avg_sq"])
            part.commit(self._pipeline.swap, new, step)
            part.seg_steps = seg_steps

    @staticmethod
    def _checked_seg_steps(part: PartitionState, state: Mapping[str, Any], step: int) -> list[int]:
        got = state.get("segment_steps")
        if got is None:
            return [step] * len(part.segments)
        got = [int(x) for x in (got.tolist() if isinstance(got, torch.Tensor) else got)]
        if len(got) != len(part.segments) or any(x < 0 or x > step for x in got):
            raise ValueError(f"state of partition {part.pid!r}: segment_steps {got[:8]} do not "
                             f"fit its {len(part.segments)} segments at step {step}")
        return got

    @staticmethod
    def _checked_state(part: PartitionState, state: Mapping[str, Any]) -> tuple[int, dict]:
        missing = {"step", "exp_avg", "exp_avg_sq"} - set(state)
        if missing:
            raise ValueError(f"state of partition {part.pid!r} lacks {sorted(missing)}")
        step = int(state["step"].item() if isinstance(state["step"], torch.Tensor)
                   else state["step"])
        if step < 0:
            raise ValueError(f"state of partition {part.pid!r}: step {step} is negative")
        tensors = {}
        for k in ("master", "exp_avg", "exp_avg_sq"):
            t = state.get(k)
            tensors[k] = None if t is None else _flat(
                t.detach().to(torch.float32).contiguous(), f"state[{part.pid!r}][{k!r}]",
                part.numel, (torch.float32,))
        return step, tensors

    def state_dict(self) -> dict[str, Any]:
        """torch-style: {"state": {pid: partition_state(pid)}, "param_groups": [{"lr",
        "betas", "eps", "weight_decay", "params": [pids]}], "steps": committed rounds}. `lr_lambda` is not saved
        (as LambdaLR does not save its lambdas)."""
        with self._lock:
            groups = [{**{k: g[k] for k in _HYPER_KEYS}, "params": list(g["params"])}
                      for g in self.param_groups]
            return {"state": {pid: self.partition_state(pid) for pid in self._parts},
                    "param_groups": groups, "steps": self.steps}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads `state_dict()` output: hyper-parameters per group, then each
        partition's state. Everything is checked before anything changes."""
        with self._lock:
            groups = state_dict.get("param_groups")
            states = state_dict.get("state", {})
            if groups is None or len(groups) != len(self.param_groups):
                raise ValueError(f"state_dict has {0 if groups is None else len(groups)} "
                                 f"param groups, the optimizer {len(self.param_groups)}")
            for k, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
                if set(theirs.get("params", ())) != set(mine["params"]):
                    raise ValueError(f"param_groups[{k}] holds partitions "
                                     f"{list(theirs.get('params', ()))[:8]}, this optimizer "
                                     f"{mine['params'][:8]}")
            for pid, st in states.items():
                part = self.partition(pid)
                self._checked_seg_steps(part, st, self._checked_state(part, st)[0])
            if self._round:
                raise ValueError(f"partitions {self.round[:8]} were updated in the open "
                                 "round; commit() or rollback() before loading state")
            for mine, theirs in zip(self.param_groups, groups):
                mine.update({k: theirs[k] for k in _HYPER_KEYS if k in theirs})
                mine["betas"] = tuple(mine["betas"])
            for pid, st in states.items():
                self.load_partition_state(pid, st)
            self.steps = int(state_dict.get("steps", self.steps))
            self._round.clear()

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
            if self._owned:  # swap file removed, buffers returned, engine stopped
                swap, pool, engine = self._owned
                self._owned = ()
                swap.close()
                pool.close(force=True)
                engine.close()

    def __enter__(self) -> "CpuAdam":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
