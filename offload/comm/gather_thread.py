"""Parameter all-gathers issued from a communication thread (`comm.gather_thread`).

[Note: gather thread]
Issuing the next unit's all-gather from a module hook first waits for its shard
to be on the device (an NVMe read, a host-to-device copy): the hook, and the
compute behind it, stand still meanwhile. With the gather thread the hook only
queues the request; one thread, in queue order, waits for each shard and issues
its all-gather. Order is what keeps ranks matched: requests are queued in
the hooks' order, the same on every rank ([Note: gather order] in engine/gathering.py),
and one thread issues them first in, first out, so every rank issues its
all-gathers in one order. They go over their own process group (a second
communicator of the same ranks: with NCCL its own stream) so that they never
interleave with the gradient reductions and scalar all-reduces the training
thread issues on the main one. Without the thread, `all_gather` waits for the
shard and issues on the caller's thread, as before.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from .collectives import Collectives, Pending, user_timeout

__all__ = ["GatherIssuer", "gather_group"]


class _Issued:
    """The `work` of a `Pending` whose collective a thread issues: waits for the issue,
    then for the collective; `on_error` runs (on the waiting thread) if either failed."""

    def __init__(self, future: Future, on_error: Callable[[], None]) -> None:
        self.future = future
        self.on_error = on_error

    def wait(self) -> None:
        try:
            self.future.result().wait()
        except BaseException:
            self.on_error()
            raise


class GatherIssuer:
    """Issues all-gathers of shards that are being fetched: on the caller's thread, or
    with `gathers` (the same ranks' own group) from one thread ([Note: gather thread])."""

    def __init__(self, comm: Collectives, gathers: Collectives | None = None) -> None:
        self.comm = gathers if gathers is not None else comm
        self._thread = None if gathers is None else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="offload-gather")

    def all_gather(self, full: torch.Tensor, shard: Callable[[], torch.Tensor], *,
                   async_op: bool, on_error: Callable[[], None]) -> Pending:
        """Fills `full` with every rank's shard; `shard()` waits for this rank's. An
        error before this returns raises here; `on_error` runs for one that a later
        `wait()` of the async handle raises."""
        if self._thread is None:
            return self.comm.all_gather(full, shard(), async_op=async_op)
        future = self._thread.submit(lambda: self.comm.all_gather(full, shard(), async_op=True))
        if not async_op:  # an error raises here, to the caller
            future.result().wait()
            return Pending(None)
        return Pending(_Issued(future, on_error))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self.comm.destroy()  # its own group, made by `gather_group`


def gather_group(comm: Collectives, groups: list[list[int]]) -> Collectives:
    """A second communicator for `comm`'s ranks: `groups` lists the ranks of every group
    like `comm`'s in the job (each rank calls this with the same list)."""
    mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=user_timeout())
    return Collectives(mine, recorder=comm.recorder, name=comm.name,
                       cuda=comm.backend == "nccl")
