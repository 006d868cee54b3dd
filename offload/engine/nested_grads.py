"""Gradients that reach a group in several backward passes of one `engine.backward`.

[Note: reentrant checkpoints inside a unit]
A group's gradient is reduced, and its gathered weights freed, when autograd
accumulates into its flat buffer (the post-accumulate-grad hook, `_on_grad`):
once per backward, after every view's gradient was summed. A reentrant
activation checkpoint (`torch.utils.checkpoint(fn, x, use_reentrant=True)`)
runs its recomputation's backward as a backward pass of its own, nested in the
outer one, which accumulates into every leaf it reaches. Where `fn` runs
inside a unit without being a unit itself (a whole model that is one unit, a
block that checkpoints its own sublayers), the unit's flat buffer then gets a
gradient from each nested pass and one from the outer pass: reducing at the
first freed the weights that the rest of the unit's backward still read (a
layer's backward before the checkpoint read freed memory: a loss off by 4e-3
after 3 steps, silently; the next checkpoint's recomputation raised), and an
early update ran once per piece.

So the graph task in which each unit's backward began (its outputs' gradient
hook) is recorded; an accumulation in another task (a nested pass inside the
unit) leaves the sum in the flat buffer's `.grad` and the weights gathered,
and the unit's own accumulation, or else the end of `engine.backward`, reduces
the whole sum once. A unit whose forward runs inside the recomputation (a
checkpointed layer that is a unit) begins its backward in the nested pass, so
it is reduced and freed there, as before.
"""

from __future__ import annotations

import torch

__all__ = ["NestedGrads"]


def _task() -> int:
    return torch._C._current_graph_task_id()


class NestedGrads:
    """Per group: the backward pass its unit's backward began in; the groups whose
    gradient waits for the end of `engine.backward`."""

    def __init__(self) -> None:
        self._began: dict[int, int] = {}  # gid -> graph task id
        self._deferred: set[int] = set()

    def began(self, gids: list[int]) -> None:
        """The unit needing `gids` begins its backward in the current pass."""
        task = _task()
        for gid in gids:
            self._began[gid] = task

    def defer(self, gid: int) -> bool:
        """Whether the accumulation into `gid` that is running now is one of a pass nested
        inside its unit's backward (its reduction then waits)."""
        if self._began.get(gid, _task()) != _task():
            self._deferred.add(gid)
            return True
        self._deferred.discard(gid)
        return False

    def take(self) -> list[int]:
        """After the outer pass: the groups still waiting, in order (every rank reduces
        them in the same order); forgets every pass."""
        out = sorted(self._deferred)
        self.clear()
        return out

    def clear(self) -> None:
        self._began.clear()
        self._deferred.clear()
