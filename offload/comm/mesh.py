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

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..trace import NULL_RECORDER, TraceRecorder
from .collectives import Collectives, device_backend, user_timeout

__all__ = ["ParallelMesh"]


# how long a rank whose model raised mid-pass waits for its TP group to say the same
# ([Note: a pass that raised under tensor parallelism] in offload/engine/rank_order.py)
FAILED_PASS_WAIT_S = 30.0


@dataclass
class ParallelMesh:
    """This rank's DP and TP groups; `dp` and `tp` are their traced collectives, `world`
    those of every rank (for the gradient norm over sharded and replicated weights);
    `control` this rank's TP group again, on gloo with a timeout of
    `FAILED_PASS_WAIT_S`, used only after a pass raised."""

    dp: Collectives
    tp: Collectives
    world: Collectives
    control: Collectives

    @classmethod
    def build(cls, tp_size: int, *, recorder: TraceRecorder = NULL_RECORDER,
              cuda: bool | None = None) -> "ParallelMesh":
        """Splits the default process group into DP x `tp_size`; raises `ValueError`
        when there is no process group or its size is not a multiple of `tp_size`.
        `cuda`: the engine computes on CUDA (None: CUDA is here)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"tp.size = {tp_size} needs torch.distributed initialised: "
                             "call torch.distributed.init_process_group() before initialize "
                             "(under torchrun too, which starts the processes only), on a "
                             f"multiple of {tp_size} ranks")
        world = dist.get_world_size()
        if world % tp_size:
            raise ValueError(f"tp.size = {tp_size} does not divide the {world} ranks of the "
                             "job; use a divisor of the world size")
        from torch.distributed.device_mesh import init_device_mesh
        device = "cuda" if device_backend(cuda=cuda) == "nccl" else "cpu"
        mesh = init_device_mesh(device, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"),
                                backend_override=_with_user_timeout(
                                    device, {"dp": world // tp_size, "tp": tp_size}, world))
        def group(name: str) -> Collectives:
            return Collectives(mesh.get_group(name), recorder=recorder, name=name, cuda=cuda)
        dp, tp = group("dp"), group("tp")
        try:  # every rank makes every TP group ([Note: mesh layout]), in one order
            control, _ = dist.new_subgroups_by_enumeration(
                [list(range(d, d + tp_size)) for d in range(0, world, tp_size)],
                timeout=datetime.timedelta(seconds=FAILED_PASS_WAIT_S), backend="gloo")
        except BaseException:
            _destroy_each(dp, tp)
            raise
        return cls(dp=dp, tp=tp, world=Collectives(recorder=recorder, cuda=cuda),
                   control=Collectives(control, cuda=False))

    def tp_failed_together(self) -> str | None:
        """[Note: a pass that raised under tensor parallelism] in rank_order.py: called
        by a rank whose forward or backward raised. None where every rank of its TP
        group raised too, with as many TP collectives started (none is left waiting in
        one); else what the others did instead."""
        start = time.monotonic()
        try:
            got = self.control.every_rank(float(self.tp.issued + 1))
        except Exception as e:  # a timeout, or a rank that is gone
            if time.monotonic() - start < 0.9 * FAILED_PASS_WAIT_S:
                return (f"another rank of its TP group is gone ({' '.join(str(e).split())})"
                        [:300])
            return (f"the other ranks of its TP group did not stop with it within "
                    f"{FAILED_PASS_WAIT_S:g} s: they wait inside a collective of that pass "
                    "that this rank will never start")
        if any(x != self.tp.issued + 1 for x in got):
            return ("the ranks of its TP group stopped after different numbers of "
                    "tensor-parallel collectives, one of which is left unpaired")
        return None

    def close(self) -> None:
        """Frees the DP, TP and control groups the mesh made (`Collectives.destroy`), each
        whatever the others do."""
        _destroy_each(self.dp, self.tp, self.control)

    @property
    def dp_groups(self) -> list[list[int]]:
        """The ranks of every DP group of the job ([Note: mesh layout])."""
        tp, dp = self.tp.world, self.dp.world
        return [[d * tp + t for d in range(dp)] for t in range(tp)]


def _with_user_timeout(device: str, sizes: dict[str, int], world: int
                       ) -> dict[str, tuple[str, Any]] | None:
    """The mesh's groups that are not the whole job with the timeout the user gave
    `init_process_group` (`user_timeout`): torch gives each new group its own 30-minute
    default, so a rank waited that long in a DP collective for a hung one. A dimension
    over the whole job takes the default group itself (an override would make another
    group over every rank). On CUDA the groups keep NCCL's options as torch derives
    them (a new options object would drop the user's NCCL settings): None there, and
    where the default group says no timeout."""
    timeout = user_timeout()
    if timeout is None or device == "cuda":
        return None
    from torch._C._distributed_c10d import Backend

    return {dim: ("gloo", Backend.Options("gloo", timeout))
            for dim, size in sizes.items() if size < world} or None


def _destroy_each(*groups: Collectives) -> None:
    """Destroys every group, each whatever the others do; raises the first failure."""
    failure = None
    for g in groups:
        try:
            g.destroy()
        except Exception as e:  # noqa: BLE001 - the rest are freed first
            failure = failure or e
    if failure is not None:
        raise failure
