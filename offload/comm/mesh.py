"""The ranks of a job as a DP x TP mesh: data parallelism (ZeRO-3 partitioning) over
one dimension, tensor parallelism (Domino-sliced Linear layers) over the other.

[Note: mesh layout]
Rank r is at (r // tp, r % tp): the ranks of one TP group are consecutive (on a
multi-GPU host, one node's GPUs share their fast links), and each DP group holds
the ranks with the same TP index, which hold the same TP shard of every
sharded weight: ZeRO partitions and reduces over those ranks only. Built with
`torch.distributed.device_mesh.init_device_mesh`, on the CPU (gloo) or CUDA
(NCCL), one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..trace import NULL_RECORDER, TraceRecorder
from .collectives import Collectives, device_backend

__all__ = ["ParallelMesh"]


@dataclass
class ParallelMesh:
    """This rank's DP and TP groups; `dp` and `tp` are their traced collectives, `world`
    those of every rank (for the gradient norm over sharded and replicated weights)."""

    dp: Collectives
    tp: Collectives
    world: Collectives

    @classmethod
    def build(cls, tp_size: int, *, recorder: TraceRecorder = NULL_RECORDER,
              cuda: bool | None = None) -> "ParallelMesh":
        """Splits the default process group into DP x `tp_size`; raises `ValueError`
        when there is no process group or its size is not a multiple of `tp_size`.
        `cuda`: the engine computes on CUDA (None: CUDA is here)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"tp.size = {tp_size} needs torch.distributed: start the job "
                             "with torchrun (or init_process_group) on a multiple of "
                             f"{tp_size} ranks")
        world = dist.get_world_size()
        if world % tp_size:
            raise ValueError(f"tp.size = {tp_size} does not divide the {world} ranks of the "
                             "job; use a divisor of the world size")
        from torch.distributed.device_mesh import init_device_mesh
        device = "cuda" if device_backend(cuda=cuda) == "nccl" else "cpu"
        mesh = init_device_mesh(device, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        def group(name: str) -> Collectives:
            return Collectives(mesh.get_group(name), recorder=recorder, name=name, cuda=cuda)
        return cls(dp=group("dp"), tp=group("tp"), world=Collectives(recorder=recorder,
                                                                       cuda=cuda))

    def close(self) -> None:
        """Frees the DP and TP groups the mesh made (`Collectives.destroy`)."""
        self.dp.destroy()
        self.tp.destroy()

    @property
    def dp_groups(self) -> list[list[int]]:
        """The ranks of every DP group of the job ([Note: mesh layout])."""
        tp, dp = self.tp.world, self.dp.world
        return [[d * tp + t for d in range(dp)] for t in range(tp)]
