"""Stateless-style collectives over a torch.distributed process group.

[Note: reduce-scatter on gloo]
gloo has no reduce_scatter; there the full gradient is all-reduced and each
rank keeps its slice (twice the traffic of a reduce-scatter, same result).
NCCL uses reduce_scatter_tensor. Gradients are averaged over ranks, as data
parallelism with a mean loss expects.

Traced (when the recorder is on): each collective is an async event on the
``comm`` track from its issue until a wait saw it done, with its bytes; the time
a caller blocks in `Pending.wait` (or in a synchronous collective) is a
``wait:<collective>`` span on the caller's thread track. A world of 1 runs no
collective and records nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..trace import NULL_RECORDER, AsyncToken, TraceRecorder

__all__ = ["Collectives", "Pending", "RankFailedError", "backend_for", "device_backend"]


def device_backend(group: object | None = None, cuda: bool | None = None) -> str:
    """The backend that carries the engine's tensors over `group`: "nccl" where they are
    CUDA tensors (`cuda`; None: CUDA is here) and the group sends those over NCCL (a
    plain "nccl" group, or one made with a per-device config such as
    "cpu:gloo,cuda:nccl"), else the group's backend for CPU tensors ("gloo"). The
    collectives pick NCCL's own calls (a reduce-scatter, CUDA-side scalars) only
    where this is "nccl"."""
    return backend_for(str(dist.get_backend(group)), str(dist.get_backend_config(group)),
                       torch.cuda.is_available() if cuda is None else cuda)


def backend_for(backend: str, config: str, cuda: bool) -> str:
    """`device_backend` from a group's backend name, its per-device config
    ("cpu:gloo,cuda:nccl"; "cuda:nccl" for a plain NCCL group) and whether CUDA is here."""
    served = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    if cuda and served.get("cuda") == "nccl":
        return "nccl"
    return served.get("cpu", backend)


def user_timeout() -> datetime.timedelta | None:
    """The default group's timeout (what the user gave `init_process_group`), for a group
    the engine makes: torch gives a new group its own 30-minute default, not the default
    group's, so a background save's barrier waited 30 minutes for a hung rank where
    training's collectives gave up at the user's timeout. None where the backend does
    not say (torch's default then)."""
    g = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return g._get_backend(torch.device(device)).options._timeout  # type: ignore
        except (AttributeError, RuntimeError):
            continue
    return None


class RankFailedError(RuntimeError):
    """Another rank failed the operation this rank was in ([Note: ranks agree])."""


@dataclass
class Pending:
    """An async collective: `wait()` blocks for it and runs its completion once."""

    work: object | None
    finish: Callable[[], None] | None = None
    recorder: TraceRecorder = NULL_RECORDER
    token: AsyncToken | None = None  # the collective's async event, ended by the wait

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter_ns()
            self.work.wait()
            t1 = time.perf_counter_ns()
            self.work = None
            if self.token is not None:
                self.recorder.complete(f"wait:{self.token.name}", t0, t1, cat="wait")
                self.recorder.async_end(self.token, ts_ns=t1)
                self.token = None
        if self.finish is not None:
            fn, self.finish = self.finish, None
            fn()


class Collectives:
    """Collectives of one job; a world of 1 (or no process group) makes them copies."""

    def __init__(self, group: object | None = None, *,
                 recorder: TraceRecorder = NULL_RECORDER, name: str = "",
                 cuda: bool | None = None) -> None:
        self.recorder = recorder
        self.name = name  # the group's role in the trace's args ("dp", "tp"); "" for the world
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        # `cuda`: the engine's tensors are CUDA tensors (None: CUDA is here)
        self.backend = device_backend(group, cuda) if self.distributed else "none"
        # NCCL's tensors go to the GPU that is current now (initialize has set the
        # engine's): a later torch.cuda.set_device of the program's own would otherwise
        # send them from another GPU than the communicator's
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self.issued = 0  # collectives this rank started on the group (the ranks' count agrees)

    def destroy(self) -> None:
        """Frees this process's part of `group`, a group the caller made for its own use
        (never the job's default group): a training that makes engines or saves again
        and again does not pile up communicators (sockets, threads, GPU memory)."""
        if self.group is None or not (dist.is_available() and dist.is_initialized()):
            return
        group, self.group = self.group, None
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *,
                   async_op: bool = False) -> Pending:
        """Fills the flat `full` (world x shard numel) with every rank's `shard`."""
        if full.numel() != shard.numel() * self.world:
            raise ValueError(f"all_gather: full has {full.numel()} elements, expected "
                             f"{self.world} x {shard.numel()}")
        if self.world == 1:
            full.copy_(shard)
            return Pending(None)
        token = self._begin("all-gather", full)
        if self.backend == "nccl":
            work = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=True)
        else:
            work = dist.all_gather(list(full.chunk(self.world)), shard, group=self.group,
                                   async_op=True)
        return self._then(work, None, async_op, token)

    def reduce_scatter_mean(self, full_grad: torch.Tensor, *, async_op: bool = False,
                            out_dtype: torch.dtype | None = None) -> tuple[Pending, torch.Tensor]:
        """This rank's slice of the mean of `full_grad` over ranks: (handle, slice).

        The sum runs in `full_grad`'s dtype (the bytes on the wire); the slice is
        `out_dtype` (default the same), divided by the world size in that dtype, so a
        bf16 reduction gives an fp32 mean without a second rounding. An fp16 one is
        divided before the sum, which could overflow where the mean does not (as
        DDP's fp16 hook: a second rounding, exact for a power-of-two world, and
        values below world x 6e-8 flushed to zero). The slice is
        valid once the handle is waited on. `full_grad` may be overwritten; with a
        world of 1 the slice is `full_grad` itself (no copy; `out_dtype` must be its
        dtype). See [Note: reduce-scatter on gloo].
        """
        if full_grad.numel() % self.world:
            raise ValueError(f"reduce_scatter: gradient has {full_grad.numel()} elements, "
                             f"not a multiple of the world size {self.world}")
        out_dtype = full_grad.dtype if out_dtype is None else out_dtype
        if self.world == 1:
            if out_dtype != full_grad.dtype:
                raise ValueError(f"reduce_scatter: a world of 1 keeps the gradient's dtype "
                                 f"{full_grad.dtype}, asked for {out_dtype}")
            return Pending(None), full_grad
        n = full_grad.numel() // self.world
        out = torch.empty(n, dtype=out_dtype, device=full_grad.device)
        # fp16's range ends at 65504: a sum of ranks' finite gradients overflowed where
        # their mean did not, and the step was skipped as an overflow; divided first,
        # as DDP's fp16 compression hook does
        first = full_grad.dtype == torch.float16
        if first:
            full_grad.div_(self.world)
        after = 1 if first else self.world
        token = self._begin("reduce-scatter", full_grad)
        if self.backend == "nccl":
            red = out if out_dtype == full_grad.dtype else torch.empty(
                n, dtype=full_grad.dtype, device=full_grad.device)
            work = dist.reduce_scatter_tensor(red, full_grad, group=self.group, async_op=True)

            def finish_nccl() -> None:
                if red is not out:
                    out.copy_(red)
                if after > 1:
                    out.div_(after)
            return self._then(work, finish_nccl, async_op, token), out
        work = dist.all_reduce(full_grad, group=self.group, async_op=True)
        lo = self.rank * n

        def finish() -> None:
            out.copy_(full_grad[lo:lo + n])
            if after > 1:
                out.div_(after)
        return self._then(work, finish, async_op, token), out

    def all_reduce_sum(self, tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Sums `tensor` over the group's ranks, in place (valid once the handle is
        waited on); a world of 1 leaves it as it is."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM, async_op)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, async_op: bool) -> Pending:
        if self.world == 1:
            return Pending(None)
        token = self._begin("all-reduce", tensor)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._then(work, None, async_op, token)

    def broadcast_first(self, tensor: torch.Tensor) -> None:
        """Sets `tensor` (on the CPU) to the value the group's first rank holds, in place,
        as DDP syncs module states from rank 0; a world of 1 leaves it as it is."""
        if self.world == 1:
            return
        src = dist.get_global_rank(self.group or dist.group.WORLD, 0)
        sent = tensor.to(self.device) if self.backend == "nccl" else tensor  # NCCL: device
        token = self._begin("broadcast", sent)
        self._then(dist.broadcast(sent, src=src, group=self.group, async_op=True), None,
                   False, token)
        if sent is not tensor:
            tensor.copy_(sent)

    def first_rank_value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The first rank's value of `tensor` (a new tensor) where this rank's differs
        from it, else None (`tensor` is not changed): [Note: rank 0's weights] in
        offload/engine/__init__.py. Every rank of the group calls it."""
        got = tensor.detach().clone()
        self.broadcast_first(got)
        return None if _same_values(got, tensor.detach()) else got

    def _begin(self, op: str, tensor: torch.Tensor) -> AsyncToken | None:
        if not self.recorder.enabled:
            return None
        args = {"bytes": tensor.numel() * tensor.element_size(), "backend": self.backend,
                "dtype": str(tensor.dtype).removeprefix("torch."), "world": self.world}
        if self.name:
            args["group"] = self.name
        return self.recorder.async_begin(op, "comm", "comm", args)

    def _then(self, work: object, finish: Callable[[], None] | None, async_op: bool,
              token: AsyncToken | None = None) -> Pending:
        self.issued += 1
        p = Pending(work, finish, self.recorder, token)
        if not async_op:
            p.wait()
        return p

    def sum_scalars(self, values: list[float]) -> list[float]:
        """Sums a few floats over ranks (fp64)."""
        return self._reduce_scalars(values, dist.ReduceOp.SUM)

    def _reduce_scalars(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        if self.backend == "nccl":
            t = t.to(self.device)
        self._all_reduce(t, op, False)
        return t.cpu().tolist()

    def every_rank(self, *values: float) -> list[float]:
        """Every rank's `values`, in rank order: one all-reduce of `world` numbers per
        value, each rank's at its own place (value i of rank r at i x world + r)."""
        mine = [0.0] * (self.world * len(values))
        for i, v in enumerate(values):
            mine[i * self.world + self.rank] = v
        return self.sum_scalars(mine)

    def min_max(self, *values: float) -> list[tuple[float, float]]:
        """Each value's (least, greatest) over the group's ranks, in one all-reduce of
        two fp64 numbers per value whatever the world size: where they are equal,
        every rank holds that value."""
        got = self._reduce_scalars([*values, *(-v for v in values)], dist.ReduceOp.MAX)
        n = len(values)
        return [(-got[n + i], got[i]) for i in range(n)]

    def every_rank_object(self, obj: object) -> list[object]:
        """Every rank's `obj` (picklable), in rank order: for what is rare and small,
        as the values an error names."""
        if self.world == 1:
            return [obj]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        self.issued += 1
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def agree(self, error: BaseException | None, what: str, flag: bool = False) -> int:
        """[Note: ranks agree] Where each rank runs its part of `what` (a step's updates,
        a checkpoint's writes) and a failure on one must stop every rank before any
        commits, each calls this once at the same point with its outcome, in place
        of a barrier: it raises `error` on the rank that failed (after telling the
        others), and RankFailedError on the others; returns where every rank got
        this far without one, with how many ranks passed `flag` (a yes-or-no each
        rank decided alone, counted in the same sum). (A rank that never gets here,
        e.g. killed, leaves the others waiting for the process group's timeout.)"""
        failed, flagged = self.sum_scalars([0.0 if error is None else 1.0, float(flag)])
        if error is not None:
            raise error
        if failed:
            raise RankFailedError(f"{what}: {int(failed)} other rank(s) of {self.world} failed "
                                  "(their error says why); this rank's part was undone with "
                                  "theirs")
        return int(flagged)

    @contextlib.contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Runs the block's part on every rank, then `agree`s on its outcome: the
        block's error raises here, RankFailedError where another rank's block failed."""
        error = None
        try:
            yield
        except Exception as e:
            error = e
        self.agree(error, what)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal elements, NaN where the other has NaN (what a rank compares with rank 0's
    weights and buffers after a broadcast: [Note: rank 0's weights])."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
