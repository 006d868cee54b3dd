"""Tensor-parallel Linear layers (Megatron-style): column-parallel layers hold a slice
of the output features, row-parallel layers a slice of the input features, so a
column layer followed by a row layer needs one all-reduce in forward (the row
layer's partial sums) and one in backward (the column layer's input gradient).

[Note: which gradients are reduced over TP]
The input of a column-parallel layer is the same on every TP rank (replicated);
each rank's slice of the weight sees only part of the output's gradient, so
the input's gradient is a partial sum: `_ColumnLinear.backward` all-reduces it
over TP, asynchronously, while it computes the weight's gradient (the two
need only the output gradient), and waits before returning. Everything after
that all-reduce is replicated: the row layer's output (all-reduced in
forward), its bias, LayerNorms, embeddings. Their gradients come from the
same values on every TP rank and are equal there, so they are reduced over
DP only, as any weight; only the sliced weights' gradients differ by TP rank,
and they are the gradients of different parameters.

Weights are stored as their module stored them: `nn.Linear` (out, in) or the
transposed GPT-2 `Conv1D` (in, out), so an unsharded state dict loads into the
original model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..trace import NULL_RECORDER, TraceRecorder
from .collectives import Collectives, Pending

__all__ = ["ColumnParallel", "RowParallel", "ShardSpec", "check_cut"]


@dataclass(frozen=True)
class ShardSpec:
    """How a weight is cut over TP ranks: along `dim`, whose length is `parts` equal
    blocks (3 for a fused q/k/v projection) each cut into tp contiguous slices, so a
    rank holds its slice of every block (its heads of q, of k and of v)."""

    dim: int
    parts: int = 1

    def check(self, shape: torch.Size | tuple[int, ...], size: int) -> None:
        """Raises `ValueError` where a tensor of `shape` cannot be cut over `size` ranks."""
        if shape[self.dim] % (self.parts * size):
            raise ValueError(f"cannot cut {self.parts} x {size} slices of {tuple(shape)} "
                             f"along dim {self.dim}: not a multiple")

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s slice of `full` (a copy)."""
        self.check(full.shape, size)
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(size, dim=self.dim)[rank] for b in blocks],
                         dim=self.dim).clone()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full weight from every rank's slice, in rank order."""
        per_rank = [s.chunk(self.parts, dim=self.dim) for s in shards]
        return torch.cat([torch.cat([blocks[i] for blocks in per_rank], dim=self.dim)
                          for i in range(self.parts)], dim=self.dim)


def _layout(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, transposed) of an `nn.Linear` or a GPT-2 `Conv1D` (in, out)."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight, module.bias, True
    raise TypeError(f"{type(module).__name__} is not an nn.Linear or a Conv1D: it cannot be "
                    "made tensor-parallel")


def check_cut(module: nn.Module, column: bool, parts: int, size: int) -> None:
    """Raises what `ColumnParallel(module, parts=parts)` (`column`) or `RowParallel(module)`
    would raise over `size` ranks, making nothing: a layer that is no Linear
    (`TypeError`), meta weights or widths that do not split (`ValueError`)."""
    weight, bias, transposed = _layout(module)
    if weight.is_meta:
        raise ValueError(_META)
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    ShardSpec(out_dim if column else in_dim, parts if column else 1).check(weight.shape, size)
    if column and bias is not None:
        ShardSpec(0, parts).check(bias.shape, size)


_META = ("tensor parallelism slices real weights: build the model on the CPU before "
         "offload.initialize (meta parameters cannot be cut)")


class _ParallelLinear(nn.Module):
    """Shared by both kinds: this rank's slice as parameters, in the module's layout."""

    def __init__(self, module: nn.Module, spec: ShardSpec, bias_spec: ShardSpec | None,
                 tp: Collectives, recorder: TraceRecorder) -> None:
        super().__init__()
        weight, bias, self.transposed = _layout(module)
        if weight.is_meta:
            raise ValueError(_META)
        self.spec = spec
        self.tp = tp
        self.recorder = recorder
        self.weight = nn.Parameter(spec.shard(weight.detach(), tp.rank, tp.world),
                                   requires_grad=weight.requires_grad)
        if bias is None:
            self.bias = None
        else:
            b = bias.detach() if bias_spec is None else bias_spec.shard(bias.detach(), tp.rank,
                                                                        tp.world)
            self.bias = nn.Parameter(b.clone(), requires_grad=bias.requires_grad)

    def linear_weight(self) -> torch.Tensor:
        """The weight as F.linear takes it, (out, in)."""
        return self.weight.t() if self.transposed else self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, tp {self.tp.rank}/{self.tp.world}"


class ColumnParallel(_ParallelLinear):
    """Output features cut over TP (q/k/v by heads, MLP up and gate): the input is
    replicated, the output is this rank's slice. Backward all-reduces the input's
    gradient behind the weight gradient ([Note: which gradients are reduced over TP])."""

    def __init__(self, module: nn.Module, tp: Collectives, *, parts: int = 1,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        _, _, transposed = _layout(module)
        out_dim = 1 if transposed else 0
        super().__init__(module, ShardSpec(out_dim, parts), ShardSpec(0, parts), tp, recorder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ColumnLinear.apply(x, self.linear_weight(), self.bias, self.tp, self.recorder)


class RowParallel(_ParallelLinear):
    """Input features cut over TP (attention output projection, MLP down): `forward`
    returns this rank's partial sum, without the bias; the caller all-reduces it
    (`Domino` does, piece by piece) and `finish` adds the replicated bias."""

    def __init__(self, module: nn.Module, tp: Collectives, *,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        _, _, transposed = _layout(module)
        super().__init__(module, ShardSpec(0 if transposed else 1), None, tp, recorder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.linear_weight())

    def start(self, partial: torch.Tensor) -> Pending:
        """Starts summing `partial` over TP in place; nothing may read it before
        `finish`. Its autograd graph is untouched: the sum's gradient with respect
        to each rank's partial is the (replicated) output gradient itself."""
        return self.tp.all_reduce_sum(partial.detach(), async_op=True)

    def finish(self, partial: torch.Tensor, pending: Pending) -> torch.Tensor:
        """Waits for `start`'s all-reduce; the full output plus the bias."""
        return _FinishReduce.apply(partial, self.bias, pending)


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp: Collectives, recorder: TraceRecorder) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.tp, ctx.recorder = tp, recorder
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = pending = None
        if need_x:
            grad_x = grad.matmul(weight)
            pending = ctx.tp.all_reduce_sum(grad_x, async_op=True)
        grad_w = grad_b = None
        with ctx.recorder.span("tp:weight-grad", cat="compute", track="compute"):
            g2 = grad.reshape(-1, grad.shape[-1])
            if need_w:
                grad_w = g2.t().matmul(x.reshape(-1, x.shape[-1])).to(weight.dtype)
            if need_b and ctx.has_bias:
                grad_b = g2.sum(0)
        if pending is not None:
            pending.wait()
        return grad_x, grad_w, grad_b, None, None


class _FinishReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, bias: torch.Tensor | None,
                pending: Pending) -> torch.Tensor:
        pending.wait()
        ctx.has_bias = bias is not None
        return partial + bias if bias is not None else partial.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad, grad_b, None
