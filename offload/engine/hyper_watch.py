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

[Note: every rank steps with the same values]
Each rank updates its own partitions with its own optimizer's values: an lr (or
betas, eps, weight decay) written on some ranks only (`if rank == 0:` around a
warm-up, a scheduler stepped on one rank) trained the elements rank 0 owns at one
lr and rank 1's at another, silently. So at every `step()` the ranks compare a
crc32 of each group's values as `step()` reads them (lr, betas, eps, weight_decay;
not `lr_lambda`, a function each rank holds its own copy of) before the step's
agreement ([Note: ranks agree] in offload/comm/collectives.py): one all-reduce of
the least and greatest crc, two numbers whatever the world size; a world of 1
computes nothing. Where they differ, the ranks' values are gathered (that once)
and every rank's step fails as a whole naming the first group and key that
differ and each rank's value, every partition as before it, as a state dict
that differs between ranks is refused. Values that changed between backward and
step on every rank alike are compared as they are at `step()`: where updates ran
early with others, that rank's step fails anyway (the note above).
"""

from __future__ import annotations

import logging
import zlib
from typing import Any


from ..comm import Collectives
from .rank_agreement import Section, attr, first_difference
from ..optim import CpuAdam
from ..optim.torch_view import value_change

log = logging.getLogger(__name__)

__all__ = ["HyperWatch"]


class HyperWatch:
    """[Note: values written between backward and step] for one engine."""

    def __init__(self, ranks: Collectives) -> None:
        """`ranks`: every rank of the job, which must step with the same values ([Note:
        every rank steps with the same values])."""
        self.early = True  # False once a loop wrote values between backward and step()
        self._before: list[tuple] | None = None  # the groups' values at the last backward
        self._ranks = ranks if ranks.world > 1 else None

    def backward_begins(self, opt: CpuAdam) -> None:
        """Notes the values at the start of the step's last backward."""
        if self.early and self._before is None:
            self._before = opt.values()

    def step_begins(self, opt: CpuAdam, updated_early: bool) -> Exception | None:
        """Compares the values now with those at the last backward, and with every
        other rank's now (a collective: every rank calls it at each step); returns the
        error that fails this step (values that differ between ranks, or changed after
        updates ran early), or None."""
        before, self._before = self._before, None
        now = opt.values()
        apart = self._ranks_apart(now)
        changed = None if before is None else self._changed(before, now, updated_early)
        return apart or changed

    def _changed(self, before: list[tuple], now: list[tuple], updated_early: bool
                 ) -> Exception | None:
        """[Note: values written between backward and step]"""
        diffs = (value_change(b, n) for b, n in zip(before, now))
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

    def _ranks_apart(self, now: list[tuple]) -> Exception | None:
        """[Note: every rank steps with the same values] (`now`: each group's): the error
        naming the first value that differs between ranks, or None."""
        if self._ranks is None:
            return None
        items = [(f"param_groups[{g}][{key!r}]", (attr(key, value),))
                 for g, values in enumerate(now) for key, value in _compared(values)]
        (least, most), = self._ranks.min_max(float(zlib.crc32(repr(items).encode())))
        if least == most:
            return None
        return ValueError(first_difference(Section("", items, _SAME_VALUES),
                                           self._ranks.every_rank_object(items)))

    def forget(self) -> None:
        """The step was undone: the next one notes its values afresh."""
        self._before = None


_SAME_VALUES = ("each rank updates its own partitions with its own values, so every rank's "
                "step failed and is undone; write the optimizer's values on every rank (a "
                "scheduler stepped on each), then run the step's micro-batches again")


def _compared(values: tuple) -> tuple[tuple[str, Any], ...]:
    """A group's values as the ranks compare them: `group_values` without lr_lambda."""
    lr, beta1, beta2, eps, weight_decay, _ = (
        v + 0.0 if isinstance(v, float) else v for v in values)  # -0.0 is 0.0
    return (("lr", lr), ("betas", (beta1, beta2)), ("eps", eps),
            ("weight_decay", weight_decay))
