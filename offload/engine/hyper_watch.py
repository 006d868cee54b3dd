"""Whether a step's updates may run during its last backward, given how the user's
loop sets the optimizer's values.

[Note: values written between backward and step]
torch's optimizer reads each group's lr (and betas, eps, weight decay) when
`step()` runs, so a loop may set them anywhere before it: after the previous
step (a scheduler's `step()`), before the forward, or between `backward` and
`step()` (a warm-up that sets lr just before stepping, as the Transformer's
"Noam" wrapper does). The engine's early updates ([Note: early update] in
updates.py) run during the last backward, so they use the values as they were
when it ran. `step()` compares each group's values then with those at
`step()`. Where they differ after updates ran early, the step cannot be
trained as torch would (its gradients went into those updates): it fails as
a whole (StepFailedError, every partition as before it), updates wait for
`step()` from then on, as torch's do, and running its micro-batches again
trains as torch. Where no update ran early, nothing fails.

Noting the loop's habit in a first step that runs no update early was
measured and left out: that step then holds every gradient until `step()`,
as a step with clipping does, which the minimum working set of early updates
has no room for (a budget at that minimum failed its first step).

The optimizer refuses a step whose updates saw two sets of values, whoever
wrote them ([Note: one set of values per round] in optim/optimizer.py).
"""

from __future__ import annotations

import logging

from ..optim import CpuAdam
from ..optim.torch_view import value_change

log = logging.getLogger(__name__)

__all__ = ["HyperWatch"]


class HyperWatch:
    """[Note: values written between backward and step] for one engine."""

    def __init__(self) -> None:
        self.early = True  # False once a loop wrote values between backward and step()
        self._before: list[tuple] | None = None  # the groups' values at the last backward

    def backward_begins(self, opt: CpuAdam) -> None:
        """Notes the values at the start of the step's last backward."""
        if self.early and self._before is None:
            self._before = opt.values()

    def step_begins(self, opt: CpuAdam, updated_early: bool) -> Exception | None:
        """Compares the values now with those at the last backward; returns the error
        that fails this step (values changed after updates ran early), or None."""
        before, self._before = self._before, None
        if before is None:
            return None
        diffs = (value_change(b, n) for b, n in zip(before, opt.values()))
        changed = [f"param_groups[{g}]: {d}" for g, d in enumerate(diffs) if d]
        if not changed:
            return None
        self.early = False
        log.warning("the optimizer's values changed between backward and step() (%s): "
                    "updates wait for step() from now on", "; ".join(changed))
        if not updated_early:
            return None
        return ValueError(
            f"the optimizer's values changed between backward and step() ({'; '.join(changed)})"
            ", after this step's updates had run during its last backward with the earlier "
            "ones (engine.optimizer = \"nvme\" overlaps them); updates now wait for step(), "
            "as torch's do, so running this step's micro-batches again trains as torch. "
            "To keep the overlap, set values before the last backward (e.g. scheduler.step() "
            "right after engine.step())")

    def forget(self) -> None:
        """The step was undone: the next one notes its values afresh."""
        self._before = None
