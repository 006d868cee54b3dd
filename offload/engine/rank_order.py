"""A cheap check that every rank runs the same unit at the same point of a step.

[Note: ranks run the same units]
Every rank must issue the same all-gathers and reductions in the same order,
so every rank must run the same units in the same order (as DDP requires).
Every block of collectives (a unit's forward: its all-gathers; a unit's
backward: its re-gathers; a group's gradient reduction: the all-reduce of
which parameters had a gradient, then the reduce-scatter) starts with a
check: each rank puts h = the block's number at its own place in a vector
of `world` zeros, and one all-reduce sums them, so every rank learns every
rank's block; they agree iff all are the same. Inside a block the
collectives follow from its number, so ranks that part ways meet at two
checks, of the same size: the mismatch raises on every rank there, naming
what each rank runs, instead of pairing one rank's all-gather with another's
and hanging, aborting inside gloo or mixing weights. A backward starts with a
check of its own: a rank whose loss code raised, and that went on to its next
forward, meets the others' backward there. So do a step (its agreement on the
outcome), a checkpoint save and a read of the whole weights: a rank that
skipped step() meets the other's step at its next check, where both raise
(`on_missed_step`: the skipping rank drops its step's gradients, whatever call
met the check, as the failed step dropped the other's; and the access trace is
ended only past the step's check, so both record the next step from the same
point). A forward without autograd ends with a check of its own
(`check_evaluation_end`). Cost: one all-reduce of `world`
numbers per block and per evaluation (a host synchronisation with NCCL);
`engine.check_rank_order = false` turns it off.

Under tensor parallelism the checks, and a step's agreement on its outcome, run
over every rank of the job (the mesh's `world`), not the DP group alone: with
one DP rank they ran over nobody, and a rank whose loss code raised paired its
next forward's TP all-reduces with the other's backward ones.

[Note: a pass that raised under tensor parallelism]
The TP layers all-reduce inside a unit's forward and backward, between two
checks. A rank whose pass raised there may leave the other ranks of its TP
group waiting inside one of those all-reduces, which it will never start; its
next collective would pair with theirs: a rank that went on to its next batch
summed its activations with the others' from another layer and stepped on the
result, with no error, while they waited. So a rank whose forward or backward
raised first asks its TP group, over a gloo group of their own with a timeout
(`ParallelMesh.tp_failed_together`), whether every one of them raised too, with
as many TP collectives started (the same data makes the same error likely on
all); it asks first, before undoing its pass, whose length differs between
ranks. If all did, none is left waiting, and the ranks go on as above. If not,
or the pass was interrupted (Ctrl-C, an exit), the engine refuses every call
from then on, saying why (an interrupt goes on as itself, with why logged).
The other ranks are released only when this process ends: under gloo by the
closed connection, under NCCL (which does not see a peer leave) when torchrun
ends the job because this rank exited with a non-zero status, or at the
process group's timeout. A pass stopped by a check (`RankOrderError`) asks
nothing: every rank raised at that check, outside every TP collective, and
one that raised at a check outside any pass (a backward's first, a step's)
would never answer.

[Note: a TP group reads the same rows]
The ranks of a TP group hold slices of the same layers and sum their partial
outputs: each must run the same batch. Ranks that read different rows (a loop
that skipped a failed batch on one rank only) summed activations of two
batches, with no error. So under tensor parallelism each check also carries,
on the first check of a forward, a crc32 of the bytes and shapes of the
tensors the model was called with (`tensors_crc32`), in a second slot per
rank: where the ranks agree on the check but two ranks of one TP group called
the model with different tensors, every rank raises there, before any TP
collective of that forward. Other checks carry NaN there (no comparison); the
payload is 2 x world numbers instead of world, on every check, so that the
checks' sizes always match.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from typing import Any, Callable

import torch

from ..comm import Collectives
from ..comm.mesh import ParallelMesh
from .units import Unit

log = logging.getLogger(__name__)

__all__ = ["RankOrder", "RankOrderError", "raised_by_the_model"]

BACKWARD = -0.5  # a backward's start; reads are -1 - gid, blocks of a step 1, 2, ...
STEP = -0.25  # a step's first collective (engine.step())
SAVE = -0.75  # a checkpoint save's first collective (save_checkpoint)
EVAL_END = -0.875  # the end of a forward without autograd (check_evaluation_end)
FAILED = -(2.0 ** 52)  # a rank whose model raised ([Note: a rank whose model raised])
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # offload/
# the package's files that call a model's own code, not the engine's: the GPT the demo
# and benchmarks train, and the Domino blocks that run a model's layers in pieces (their
# only collectives are TP all-reduces, whose count `alone` compares before any notice)
_MODEL_CODE = frozenset(os.path.join(_PACKAGE, *f.split("/")) for f in (
    "cli/gpt.py", "comm/domino.py", "comm/blocks.py"))
READS = "state_dict, full_weights, named_weights, save_pretrained or load_state_dict"
READ_FIX = ("these gather every rank's shard: call them on every rank at the same point, "
            "not under `if rank == 0` (state_dict keeps the weights on rank 0 only, and "
            "save_pretrained writes on rank 0 only, by themselves)")
EVAL_FIX = ("a forward under torch.no_grad (an evaluation) gathers every rank's shards "
            "too: run it on every rank, over the same number of batches (each its own "
            "shard of the evaluation set), not under `if rank == 0`, as under FSDP or "
            "DeepSpeed's ZeRO-3")
CALL_FIX = ("every rank calls engine.step() after the same backward calls, and "
            "save_checkpoint() at the same point of the loop, not under `if rank == 0` "
            "(each rank updates and saves its own shard; save_checkpoint writes what rank 0 "
            "must by itself)")


class RankOrderError(RuntimeError):
    """Ranks met at different points of a step, or another rank's model raised: raised
    on every rank at the same check, so none of them tells the others again."""


def raised_by_the_model(e: BaseException) -> bool:
    """[Note: a rank whose model raised] Whether `e`, caught by the engine's forward or
    backward, came from the user's code (the model, an autograd function) and not
    from the engine's own hooks: no frame below the catching one is the package's,
    but for those that run a model's own code (`_MODEL_CODE`). Only then are the
    other ranks at a check, where a notice pairs up; an error inside a hook may
    leave them in an all-gather or a reduction."""
    if not isinstance(e, Exception) or isinstance(e, RankOrderError):
        return False  # Ctrl-C, exit: every rank gets its own
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    while tb is not None:
        f = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if f.startswith(_PACKAGE + os.sep) and f not in _MODEL_CODE:
            return False
        tb = tb.tb_next
    return True


def tensors_crc32(args: Any, kwargs: Any) -> float:
    """A crc32 of the dtypes, shapes and bytes of every tensor in `args` and `kwargs`
    (inside tuples, lists and dicts, keys in sorted order), as a float: a forward's
    arguments ([Note: a TP group reads the same rows]), or the values each rank
    writes its shards from (`load_state_dict`, a writable `full_weights` block)."""
    crc = 0

    def walk(v: Any, depth: int) -> None:
        nonlocal crc
        if isinstance(v, torch.Tensor):
            crc = zlib.crc32(f"{v.dtype}{tuple(v.shape)}".encode(), crc)
            if v.layout == torch.strided and not v.is_meta and v.numel():
                data = v.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
                crc = zlib.crc32(data.numpy(), crc)
        elif depth < 8 and isinstance(v, (tuple, list)):
            for x in v:
                walk(x, depth + 1)
        elif depth < 8 and isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], depth + 1)
    walk((args, kwargs), 0)
    return float(crc)


class RankOrder:
    """Checks, before each block of collectives (a unit's forward, its backward, a
    group's gradient reduction), that every rank is at the same block."""

    def __init__(self, comm: Collectives, units: list[Unit], enabled: bool,
                 mesh: ParallelMesh | None = None) -> None:
        self._comm = comm  # every rank of the job (under tensor parallelism, the mesh's)
        self._mesh = mesh
        self._index = {id(u): i for i, u in enumerate(units)}
        self._n = len(units)
        self._names = [u.name for u in units]
        self._unit_of: dict[int, str] = {}
        for u in units:
            for gid in u.needs:
                self._unit_of.setdefault(gid, u.name)
        self.enabled = enabled and comm.world > 1
        self._rows = math.nan  # the fingerprint the next check carries (under TP)
        # called where this rank meets another's step() at any other point (it skipped
        # its own step): the engine drops its step's gradients, as the failed step did
        self.on_missed_step: Callable[[], None] | None = None

    def forward_called(self, args: Any, kwargs: Any) -> None:
        """The model was called with `args` and `kwargs` (not in a backward): under tensor
        parallelism, the forward's first check compares them over each TP group
        ([Note: a TP group reads the same rows])."""
        if self.enabled and self._mesh is not None:
            try:
                self._rows = tensors_crc32(args, kwargs)
            except Exception as e:  # a tensor without bytes to read: not compared
                log.debug("no fingerprint of the forward's arguments: %s", e)
                self._rows = math.nan

    def forward_ended(self) -> None:
        """The model's forward returned or raised: a fingerprint no check carried is
        dropped."""
        self._rows = math.nan

    def check_unit(self, unit: Unit, backward: bool, autograd: bool = True) -> None:
        """Before the collectives of `unit`'s forward (or backward); a forward without
        autograd (evaluation under torch.no_grad) is a point of its own, half way: it
        prefetches no group, so one rank's evaluation beside another's training
        forward would pair their all-gathers wrongly and wait for the timeout."""
        if self.enabled:
            self._check(1 + self._index[id(unit)] + (self._n if backward else 0)
                        + (0 if autograd else 0.5))

    def check_evaluation_end(self) -> None:
        """At the end of a forward without autograd (an evaluation), which no backward's
        check follows: a rank whose evaluation raised after its last unit's check told
        the others at their next check, and that was their next batch's training
        forward, which failed in its place: the ranks went on a batch apart (one
        trained batch 2, the other batch 3 at the same step). They meet here now, and
        every rank's evaluation raises."""
        if self.enabled:
            self._check(EVAL_END)

    def check_backward(self) -> None:
        """Before a backward's first collective (the agreement on what trains, its size
        the model's): a rank that skipped its backward (its loss code raised) meets
        another's backward here, at a check of the same size, not inside gloo."""
        if self.enabled:
            self._check(BACKWARD)

    def check_grad(self, gid: int) -> None:
        """Before the reduction of group `gid`'s gradient."""
        if self.enabled:
            self._check(1 + 2 * self._n + gid)

    def check_step(self) -> None:
        """Before a step's first collective (the ranks' agreement on its outcome): a rank
        that skipped step() meets another's step here, at a check of the same size,
        not inside the agreement's sum."""
        if self.enabled:
            self._check(STEP)

    def check_save(self) -> None:
        """Before a checkpoint save's first collective, as `check_step`."""
        if self.enabled:
            self._check(SAVE)

    def check_read(self, gid: int) -> None:
        """Before the all-gather of group `gid`'s whole weights (state_dict, full_weights,
        named_weights, save_pretrained, load_state_dict): numbers below zero, apart
        from every block of a step, so a rank that reads the weights while another
        trains (`if rank == 0: engine.state_dict()`, fine under DDP) raises on both
        instead of pairing its all-gathers with the other's forward and waiting for
        the process group's timeout."""
        if self.enabled:
            self._check(-1.0 - gid)

    def alone(self, e: BaseException) -> str | None:
        """[Note: a pass that raised under tensor parallelism] Why the engine cannot go
        on after its forward or backward raised `e`, where a rank of its TP group may
        be left inside a collective of the pass; None where the ranks go on (no tensor
        parallelism, or every TP rank raised alike). Asked first, before the pass is
        undone: the ranks' undo takes unequal times. A `RankOrderError` needs no
        asking: every rank of the job raised it at one check, one all-reduce that no
        rank inside a TP collective could have joined."""
        if self._mesh is None or isinstance(e, RankOrderError):
            return None
        why = ("it was interrupted (Ctrl-C, an exit)" if not isinstance(e, Exception)
               else self._mesh.tp_failed_together())
        if why is None:
            return None
        return (f"rank {self._comm.rank}'s forward or backward stopped in the middle of a "
                f"tensor-parallel pass, and {why}. The engine refuses every call from now "
                "on (going on would pair this rank's sums with theirs from another layer): "
                "end this process with a non-zero exit status (raise, or sys.exit(1)), "
                "which torchrun answers by ending the other ranks (gloo also releases "
                "them when this process ends; under NCCL they wait until the process "
                "group's timeout otherwise), and start again from saved weights. Under "
                "tensor parallelism, code that may raise on one rank only (a hook, a "
                "check of the data) belongs outside the engine's forward")

    def failed(self, e: BaseException) -> None:
        """[Note: a rank whose model raised] This rank's forward or backward raised in
        the user's code: the other ranks, at their next check, learn it there and
        raise, undoing their pass as this rank undid its own. The ranks then go on
        from the same point, none a batch ahead, and each error names its cause."""
        if self.enabled and raised_by_the_model(e):
            try:
                self._points(FAILED)
            except Exception as e:  # the model's error is what the rank raises
                log.debug("telling the other ranks of a failed pass failed: %s", e)

    def _describe(self, h: float) -> str:
        """What block number `h` is (the inverse of the checks' numbering)."""
        n = self._n
        if h == BACKWARD:
            return "a backward (engine.backward)"
        if h == STEP:
            return "engine.step()"
        if h == SAVE:
            return "save_checkpoint()"
        if h == EVAL_END:
            return "the end of a forward without autograd (an evaluation)"
        if h < 0:
            return f"the all-gather of group {int(-1 - h)}'s whole weights ({READS})"
        k = int(h) - 1
        if h != int(h):
            return (f"the forward of unit {self._names[k % n]!r} without autograd "
                    "(an evaluation under torch.no_grad)")
        if k < 2 * n:
            return (f"the {'backward' if k >= n else 'forward'} of unit "
                    f"{self._names[k % n]!r}")
        gid = k - 2 * n
        return f"the gradient reduction of group {gid} (unit {self._unit_of.get(gid, '?')!r})"

    def _points(self, h: float) -> tuple[list[float], list[float] | None]:
        """Every rank's point, this rank's `h`, and under tensor parallelism every rank's
        fingerprint ([Note: a TP group reads the same rows]; else None): one
        all-reduce of `world` numbers each."""
        if self._mesh is None:
            return self._comm.every_rank(float(h)), None
        rows, self._rows = self._rows, math.nan
        got = self._comm.every_rank(float(h), rows)
        return got[:self._comm.world], got[self._comm.world:]

    def _check_rows(self, h: float, rows: list[float]) -> None:
        """[Note: a TP group reads the same rows] Raises RankOrderError on every rank
        where two ranks of one TP group called the model with different tensors."""
        tp = self._mesh.tp.world
        for first in range(0, len(rows), tp):
            group = rows[first:first + tp]
            if any(math.isnan(x) for x in group) or len(set(group)) == 1:
                continue
            ranks = ", ".join(str(first + i) for i in range(tp))
            raise RankOrderError(
                f"ranks {ranks} (one tensor-parallel group) called the model with different "
                f"tensors before {self._describe(h)}: every rank of a TP group must run "
                "the same batch (they hold slices of the same layers and sum their "
                "outputs), so this forward stops on every rank. Give each TP group's ranks "
                "the same rows (their DP rank's share); where a batch failed on one rank, "
                "skip it on every rank, not on that rank alone")

    def _check(self, h: float) -> None:
        """Raises RankOrderError on every rank if the ranks do not all contribute `h`."""
        got, rows = self._points(h)
        failed = [str(r) for r, x in enumerate(got) if x == FAILED]
        if failed:
            who = (f"rank {failed[0]} raised in its model's forward or backward (its own "
                   "error says" if len(failed) == 1 else f"ranks {', '.join(failed)} raised in "
                   "their models' forward or backward (their own errors say")
            raise RankOrderError(
                f"{who} why) while rank {self._comm.rank} ran {self._describe(h)}; this rank's"
                " pass stops with it and the step is left as it was: go on with "
                "the next batch on every rank (or stop every rank)")
        if any(x != h for x in got):
            others = "; ".join(f"rank {r} runs {self._describe(x)}"
                               for r, x in enumerate(got) if x != h)
            # a rank reads the whole weights (this one included, for a read's check)
            fix = (CALL_FIX if STEP in got or SAVE in got
                   else READ_FIX if any(x <= -1 for x in got)
                   else EVAL_FIX if EVAL_END in got or any(x > 0 and x != int(x) for x in got)
                   else None)
            if STEP in got and h != STEP and self.on_missed_step is not None:
                try:
                    self.on_missed_step()
                except Exception as e:  # the order's error is what the rank raises
                    log.debug("dropping the step another rank took failed: %s", e)
            raise RankOrderError(
                f"rank {self._comm.rank} runs {self._describe(h)} while another rank runs "
                f"something else at this point of the step ({others}: another module, a "
                "skipped backward, or a collective such as state_dict() that every rank must "
                "call): " + (fix or "every rank must run the same modules in the same "
                "order each step, forward and backward (as under DDP), so that their "
                "all-gathers and reductions pair up. Run every module on every rank, and "
                "let every rank's loss depend on the same modules (e.g. add an unused "
                "branch's output times 0), or keep modules that may be skipped inside a "
                "larger unit (raise engine.group_size) so the skip happens within one unit; "
                "where one rank's step raised (its model or its loss code), skip that batch "
                "on every rank, not on that rank alone"))
        if rows is not None:
            self._check_rows(h, rows)
