"""Stateless-style collectives over a torch.distributed process group.

[Note: reduce-scatter on gloo]
gloo has no reduce_scatter; there the full gradient is all-reduced and each
rank keeps its slice (twice the traffic of a reduce-scatter, same result).
NCCL uses reduce_scatter_tensor. Gradients are averaged over ranks, as data
parallelism with a mean loss expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Collectives", "Pending"]


@dataclass
class Pending:
    """An async collective: `wait()` blocks for it and runs its completion once."""

    work: object | None
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            fn, self.finish = self.finish, None
            fn()


class Collectives:
    """Collectives of one job; a world of 1 (or no process group) makes them copies."""

    def __init__(self, group: object | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else "none"

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Fills the flat `full` (world x shard numel) with every rank's `shard`."""
        if full.numel() != shard.numel() * self.world:
            raise ValueError(f"all_gather: full has {full.numel()} elements, expected "
                             f"{self.world} x {shard.numel()}")
        if self.world == 1:
            full.copy_(shard)
            return Pending(None)
        if self.backend == "nccl":
            work = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op)
        else:
            work = dist.all_gather(list(full.chunk(self.world)), shard, group=self.group,
                                   async_op=async_op)
        return Pending(work if async_op else None)

    def reduce_scatter_mean(self, full_grad: torch.Tensor, *,
                            async_op: bool = False) -> tuple[Pending, torch.Tensor]:
        """This rank's slice of the mean of `full_grad` over ranks: (handle, slice).

        The slice is valid once the handle is waited on. `full_grad` may be
        overwritten; with a world of 1 the slice is `full_grad` itself (no copy).
        See [Note: reduce-scatter on gloo].
        """
        if full_grad.numel() % self.world:
            raise ValueError(f"reduce_scatter: gradient has {full_grad.numel()} elements, "
                             f"not a multiple of the world size {self.world}")
        if self.world == 1:
            return Pending(None), full_grad
        n = full_grad.numel() // self.world
        out = torch.empty(n, dtype=full_grad.dtype, device=full_grad.device)
        if self.backend == "nccl":
            work = dist.reduce_scatter_tensor(out, full_grad, group=self.group, async_op=True)
            return self._then(work, lambda: out.div_(self.world), async_op), out
        work = dist.all_reduce(full_grad, group=self.group, async_op=True)
        lo = self.rank * n

        def finish() -> None:
            out.copy_(full_grad[lo:lo + n]).div_(self.world)
        return self._then(work, finish, async_op), out

    def _then(self, work: object, finish: Callable[[], None], async_op: bool) -> Pending:
        p = Pending(work, finish)
        if not async_op:
            p.wait()
        return p

    def sum_scalars(self, values: list[float]) -> list[float]:
        """Sums a few floats over ranks (fp64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        if self.backend == "nccl":
            t = t.cuda()
        dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)
