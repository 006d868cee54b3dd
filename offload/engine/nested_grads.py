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

[Note: a gradient in several passes]
A unit that runs inside a reentrant checkpoint and also elsewhere in the
same forward (a shared layer, checkpointed in one of its uses) gets its
gradient in two passes of its own: the recomputation's nested pass, where its
backward begins, and the outer pass (or another checkpoint's). Each pass
reduces it. Summed into the grad partition that is right, but an early
update ([Note: early update] in updates.py) ran at the first and the second
found the group's new parameters already staged: every step failed. The
checkpoint's first pass runs the unit's forward with autograd off inside a
forward with autograd on, so the forward counts each group's uses in the
micro-step and marks those run that way; a group marked and used more than
once may get its gradient in several passes, and takes no early update: its
gradient is summed, and step() updates it.
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
        self.autograd_forward = False  # the model's forward runs, with autograd on
        self._uses: dict[int, int] = {}  # gid -> unit forwards of the micro-step
        self._checkpointed: set[int] = set()  # run in a reentrant checkpoint's first pass

    def forward(self, gids: list[int], checkpointed: bool) -> None:
        """The unit needing `gids` runs its forward in the micro-step; `checkpointed`: with
        autograd off, inside a forward with autograd on ([Note: a gradient in several
        passes])."""
        for gid in gids:
            self._uses[gid] = self._uses.get(gid, 0) + 1
            if checkpointed:
                self._checkpointed.add(gid)

    def several_passes(self, gid: int) -> bool:
        """Whether `gid`'s gradient may come in more than one backward pass of the
        micro-step ([Note: a gradient in several passes])."""
        return gid in self._checkpointed and self._uses.get(gid, 0) > 1

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
        them in the same order); forgets every pass (not the forwards)."""
        out = sorted(self._deferred)
        self._began.clear()
        self._deferred.clear()
        return out

    def clear(self) -> None:
        """The micro-step's backward has ended: forgets its passes and forwards."""
        self.take()
        self._uses.clear()
        self._checkpointed.clear()
