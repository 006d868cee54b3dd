"""The engine under tensor parallelism (`tp.size > 1`): the DP x TP mesh, the model's
blocks made tensor-parallel before it is partitioned, and the gradient norm over
sharded and replicated weights.

[Note: ZeRO-3 over DP, tensor parallelism over TP]
`initialize` cuts the model's known transformer blocks over the TP group
(`offload.comm.domino.parallelize`); each rank then holds its TP slice of the
cut weights and the whole of the others, and the engine partitions that model
over the DP group only: all-gathers and gradient reduce-scatters run between
the ranks that hold the same slices. A tensor-parallel block is always one
unit (gathered whole), since its pieces use its layers in turn. Replicated
weights have equal gradients on the TP ranks ([Note: which gradients are
reduced over TP] in offload/comm/tensor_parallel.py), so each TP rank updates
its copy the same way and they stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Collectives
from ..comm.domino import DominoBlock, TensorParallelPlan, parallelize, tp_blocks
from ..comm.mesh import ParallelMesh
from ..config import ConfigError, OffloadConfig
from ..optim import grad_sq_sum
from ..trace import NULL_RECORDER, TraceRecorder
from .units import Group

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["GradSquares", "TensorParallel", "full_state_dict"]


@dataclass
class TensorParallel:
    """The mesh and what `parallelize` did to the model."""

    mesh: ParallelMesh
    plan: TensorParallelPlan

    @staticmethod
    def check(model: nn.Module, cfg: OffloadConfig, *, restored: bool) -> None:
        """`setup`'s refusals, with no collective: `ConfigError` naming `tp.size` where
        the model cannot be cut (`restored`: as for `setup`). `initialize` runs it
        where every rank hears of one rank's refusal: in `setup` a rank that refused
        left the others waiting in its first broadcast."""
        if cfg.tp.size == 1:
            return
        if restored:
            raise ConfigError(f"tp.size = {cfg.tp.size}: checkpoints and resume are not "
                              "supported with tensor parallelism yet; load the weights into "
                              "the model on the CPU before offload.initialize")
        try:
            tp_blocks(model, cfg.tp.size)
        except (TypeError, ValueError) as e:  # a layer that is no Linear is a TypeError
            raise ConfigError(f"tp.size: {e}") from e

    @classmethod
    def setup(cls, model: nn.Module, cfg: OffloadConfig, *, restored: bool,
              recorder: TraceRecorder = NULL_RECORDER, keep_undo: bool = False,
              cuda: bool | None = None) -> "TensorParallel | None":
        """None for `tp.size = 1`; else the mesh, with `model`'s blocks made
        tensor-parallel in place. `restored`: weights come from a checkpoint
        (refused: checkpoints hold full tensors, a rank holds slices). A refusal
        leaves `model` as it was; `keep_undo`: `plan.undo()` can put it back later
        too, until `plan.commit()` ([Note: undoing parallelize] in
        offload/comm/domino.py)."""
        if cfg.tp.size == 1:
            return None
        cls.check(model, cfg, restored=restored)
        try:
            mesh = ParallelMesh.build(cfg.tp.size, recorder=recorder, cuda=cuda)
            plan = parallelize(model, mesh.tp, cfg.domino.pieces, recorder=recorder,
                               keep_undo=keep_undo)
        except (TypeError, ValueError) as e:  # a layer that is no Linear is a TypeError
            raise ConfigError(f"tp.size: {e}") from e
        return cls(mesh, plan)

    @property
    def blocks(self) -> list[DominoBlock]:
        return self.plan.blocks

    def sharded(self, name: str) -> bool:
        return name in self.plan.sharded

    def full_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole tensor `name` whose slice on this rank is `shape`."""
        spec = self.plan.sharded.get(name)
        if spec is None:
            return tuple(shape)
        return tuple(n * self.mesh.tp.world if d == spec.dim else n for d, n in enumerate(shape))

    def full(self, name: str, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The whole tensor `name` (on the CPU) from this rank's `value`: its TP slices
        all-gathered and put together where it is cut, else `value`. Every rank of the
        TP group calls it, for the same names in the same order."""
        import torch.distributed as dist
        if not self.sharded(name):
            return value
        mine = value.to(device).contiguous()  # NCCL gathers device tensors
        shards = [torch.empty_like(mine) for _ in range(self.mesh.tp.world)]
        dist.all_gather(shards, mine, group=self.mesh.tp.group)
        return self.plan.unshard(name, [s.cpu() for s in shards])


class GradSquares:
    """Sums of squares of this rank's gradient partitions, added group by group, and
    the global sum over every rank: as torch's clip_grad_norm_ of the whole model,
    each weight's gradient counted once. Under tensor parallelism each TP slice is
    a different part of a weight (summed over all ranks) while a replicated weight
    is on every TP rank (its sum over all ranks divided by tp.size)."""

    def __init__(self, comm: Collectives, tp: TensorParallel | None) -> None:
        self.comm, self.tp = comm, tp
        self.sharded = 0.0
        self.replicated = 0.0

    def add(self, group: Group, grad: torch.Tensor) -> None:
        """`grad`: this rank's partition of `group`'s gradient (its DP slice)."""
        total = grad_sq_sum([grad])
        if self.tp is None or not math.isfinite(total):
            self.replicated += total
            return
        lo = self.comm.rank * group.shard
        cut = 0.0
        for s in group.slots:
            if not self.tp.sharded(s.fqn):
                continue
            a, b = max(s.offset, lo), min(s.offset + s.numel, lo + group.shard)
            if a < b:
                cut += grad_sq_sum([grad[a - lo:b - lo]])
        self.sharded += cut
        self.replicated += total - cut

    def total(self) -> float:
        if self.tp is None:
            (total,) = self.comm.sum_scalars([self.replicated])
            return total
        sharded, replicated = self.tp.mesh.world.sum_scalars([self.sharded, self.replicated])
        return sharded + replicated / self.tp.mesh.tp.world


def refuse_layer_outputs(model: nn.Module, kwargs: dict) -> None:
    """[Note: per-layer outputs under tensor parallelism]
    transformers collects `output_hidden_states` and `output_attentions` with hooks on
    its own block classes, which tensor parallelism replaces by Domino blocks: the
    hidden states came back empty, and the attentions one per batch piece, each with
    this rank's heads only, with no error. Asked for (in the call or the model's
    config), the forward raises first, on every rank alike, before any collective."""
    config = getattr(model, "config", None)
    for key in ("output_hidden_states", "output_attentions"):
        on = kwargs.get(key)
        if on is None:
            on = getattr(config, key, False)
        if on is True:
            raise ValueError(f"{key}=True with tp.size > 1 is not supported: tensor "
                             "parallelism runs each block in pieces over its ranks' heads, "
                             "and would return them empty or partial; call the model "
                             f"without it (and set config.{key} = False), or train with "
                             "tp.size 1")


def full_state_dict(engine: "OffloadEngine") -> dict[str, Any]:
    """The model's full weights on every rank: the engine's state dict (gathered over
    DP), its TP slices put together. Every rank calls it; for tests and export."""
    sd = engine.state_dict(rank0_only=False)
    tp = getattr(engine, "tp", None)
    if tp is None:
        return sd
    return {name: tp.full(name, value, engine.device) for name, value in sd.items()}
