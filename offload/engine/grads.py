"""`GradPartitions`: the engine's fp32 gradient partitions, records in the store.

Each group's reduced gradient is accumulated in its partition ("g", gid)
between backward and step (or handed to an early update, [Note: early
update] in engine.py), read for the global norm and by the update, and freed
once the update read it. A mixin of `OffloadEngine`: it reads the engine's
store, groups, collectives and configuration, and keeps no state of its own
beyond the engine's `_has_grad` and `grad_slots`; `_on_grad` starts each group's
reduction as backward produces its gradient (the engine's `_reductions`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator

import torch

from ..io import host_copy
from ..store import BudgetExceededError, Tier
from .one_thread import one_call
from .tensor_parallel import GradSquares

log = logging.getLogger(__name__)

__all__ = ["GradPartitions"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GradPartitions:
    """Storing, summing, reading and dropping the step's gradient partitions."""

    @one_call("engine.zero_grad()", outer=True, sealed=True)  # [Note: one thread at a time]
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients of the step in progress, as torch does: updates that
        already ran for them in the background are undone, so the next `step()`
        changes nothing. step() clears gradients itself; calling this at any point
        is safe. Gradients are always dropped, never kept as zeros: with
        `set_to_none=False` a parameter that gets no gradient in a later step is
        left alone, where torch's AdamW would decay it (a warning says so, once)."""
        self._check_open()
        self._warn_window_drop("engine.zero_grad()", self._step_awaits_more)
        self._step_awaits_more = False
        if not set_to_none and not self._warned_zero_fill:
            self._warned_zero_fill = True
            log.warning("engine.zero_grad(set_to_none=False): the engine keeps no zero-filled "
                        "gradients; a parameter without a gradient in a step is not updated, "
                        "as after set_to_none=True (torch's AdamW would still apply weight "
                        "decay and decay its moments)")
        with self._interrupts.held():  # [Note: Ctrl-C at a safe point] in interrupts.py
            self._zeroed = self._zeroed or bool(self._backwards) and self._whole.world > 1
            self._drop_step()

    def _warn_window_drop(self, how: str, awaited: bool) -> None:
        """[Note: zero_grad in the window] Says so, once, where `how` drops the gradients
        right after a step() that waited for more micro-batches (`awaited`)."""
        if awaited and self._backwards and not self._warned_window_drop:
            self._warned_window_drop = True
            log.warning(
                "%s after a step() that waited for more micro-batches (%d of "
                "grad_accum_steps=%d ran) dropped their gradients: the step starts over, and "
                "a loop that does so after every micro-batch never updates. step() "
                "clears the gradients itself when it updates: leave %s out of the "
                "loop, or call it only after a step() that returned True",
                how, self._backwards, self.cfg.engine.grad_accum_steps, how)

    def _on_grad(self, gid: int, flat: torch.Tensor) -> None:
        """The post-accumulate-grad hook of group `gid`'s flat weights (it holds neither
        the engine nor the group: [Note: hooks on tensors hold the engine weakly])."""
        st = self._states[gid]
        if not self._in_backward:
            flat.grad = None
            self._refuse_plain_backward()
        if self._nested.defer(gid):  # [Note: reentrant checkpoints inside a unit]
            return  # the sum stays in flat.grad, the weights gathered
        grad = flat.grad
        flat.grad = None
        if self.comm.world > 1:  # summed across ranks in engine.reduce_dtype
            full = grad.to(_DTYPES[self.cfg.engine.reduce_dtype])
            del grad
            self._rank_order.check_grad(gid)  # [Note: ranks run the same units]
            self.grad_slots.share(gid, len(st.group.slots))
            out_dtype = torch.float32
        else:  # [Note: the gradient's fp32 copy is a record]
            full, out_dtype = grad, grad.dtype
            del grad
        pending, out = self.comm.reduce_scatter_mean(full, async_op=True,
                                                     out_dtype=out_dtype)
        inner = pending.finish

        def finish() -> None:
            if inner is not None:
                inner()
            self._grad_ready(gid, out)
        pending.finish = finish
        self._reductions.append(pending)
        # engine.reductions_in_flight stay in flight behind the next groups'
        # backward; a synchronous one (a world of 1) finishes here.
        keep = self.cfg.engine.reductions_in_flight
        while self._reductions and (len(self._reductions) > keep
                                    or self._reductions[0].work is None):
            self._reductions.pop(0).wait()
        if st.active == 0:
            self._free(st)

    def _reduce_nested_grads(self) -> None:
        """After the outer backward pass: reduces each group whose gradient came only from
        passes nested in its unit's backward ([Note: reentrant checkpoints inside a unit]
        in nested_grads.py)."""
        gids = self._nested.take()
        for i, gid in enumerate(gids):
            try:
                self._on_grad(gid, self._states[gid].flat)
            except BaseException:  # the step fails: no sum may stay for the next backward
                for rest in gids[i + 1:]:
                    self._states[rest].flat.grad = None
                raise

    def _drop_nested_grads(self) -> None:
        """The end of a backward: the sums nested passes left (where it failed) are
        dropped, and its forwards forgotten ([Note: a gradient in several passes])."""
        for gid in self._nested.take():
            self._states[gid].flat.grad = None
        self._nested.clear()

    def _accumulate(self, gid: int, shard_grad: torch.Tensor) -> None:
        key = ("g", gid)
        self._has_grad.add(gid)
        if key not in self.store:
            self._put_grad(gid, shard_grad, self._grad_tier)
            return
        self.store.fetch(key, to=self._grad_where).wait()
        with self.store.modify(key, self._grad_where) as g:
            g.add_(shard_grad.to(g.device))
        if self._grad_tier is Tier.NVME:
            self.store.evict(key)

    def _put_grad(self, gid: int, shard_grad: torch.Tensor, tier: Tier) -> None:
        """Stores `shard_grad` (any float dtype; the sum of a world of 1 is the unit's
        own gradient in the compute dtype) as the fp32 grad partition of `gid`, home
        `tier`: converted straight into the record's memory.

        [Note: the gradient's fp32 copy is a record]
        A gradient leaves backward in the compute dtype, and the optimizer reads it
        in fp32. Converting the whole unit's gradient into a tensor of its own first
        kept a second, unbudgeted fp32 copy alive for as long as the update that
        read it: in `bench oversized` (64 MiB per MLP weight) that copy, and the next
        unit's beside it, were what put peak RSS above the budgets. With a world of
        1 there is no reduction, so the conversion writes into the record the store
        allocates under its budgets, and an early update reads its gradient from
        there (HOST: never NVMe; when HOST has no room, the update keeps a copy of
        its own as before). bf16/fp16 to fp32 is exact, so the numbers are those of
        converting first."""
        with self.store.create(("g", gid), shard_grad.numel(), torch.float32, kind="grad",
                               tier=tier) as t:
            host_copy(t, shard_grad.reshape(-1))  # one memcpy where no conversion

    def _put_early_grad(self, gid: int, shard_grad: torch.Tensor) -> bool:
        """Stores an early update's gradient in HOST; False when no room can be made."""
        try:
            self._put_grad(gid, shard_grad, Tier.HOST)
        except BudgetExceededError as e:
            log.debug("early update of group %d keeps its own gradient: %s", gid, e)
            return False
        return True

    @property
    def _grad_where(self) -> Tier:
        """Where grad partitions are read and summed: their home, or HOST for NVMe."""
        return Tier.HOST if self._grad_tier is Tier.NVME else self._grad_tier

    @contextlib.contextmanager
    def _stored_grad(self, gid: int) -> Iterator[torch.Tensor]:
        """The stored gradient of `gid` (pinned, no copy on a CPU host); the partition is
        freed afterwards."""
        key = ("g", gid)
        where = Tier.HOST if self.store.info(key).home is Tier.HOST else self._grad_where
        grad = self.store.fetch(key, to=where, pin=True).wait()
        try:
            yield grad.cpu()
        finally:
            self.store.unpin(key)
            self.store.free(key)

    def _grad_norm(self, gids: list[int], scale: float) -> tuple[float | None, bool]:
        need = self.cfg.optim.max_grad_norm > 0 or self.cfg.engine.dtype == "fp16"
        if not need:
            return None, False
        squares = GradSquares(self.comm, self.tp)  # sharded weights counted over TP
        for gid in gids:
            squares.add(self.groups[gid], self.store.fetch(("g", gid), to=self._grad_where).wait())
            if self._grad_tier is Tier.NVME:
                self.store.evict(("g", gid))
        total = squares.total()
        norm = math.sqrt(total) / scale if math.isfinite(total) else float("inf")
        return norm, not math.isfinite(norm)

    def _drop_grads(self, gids: list[int]) -> None:
        for gid in gids:
            self.store.free(("g", gid))
        self._has_grad.clear()
        self.grad_slots.clear()


def refuse_backward_args(given: dict) -> None:
    """`engine.backward(loss)` takes none of torch's `loss.backward` arguments: a clear
    error naming them and what to do instead, where Python's said "unexpected
    keyword"."""
    if given:
        raise TypeError(
            f"engine.backward(loss) takes no {', '.join(sorted(given))}: the engine gives a "
            "unit's weights back once its backward ran (retain_graph= would keep a graph "
            "over weights no longer held) and its gradients go to the engine's partitions, "
            "not to .grad (inputs=, create_graph=). Backward two losses of one forward as "
            "their sum, engine.backward(loss_a + loss_b); for gradients of the inputs, call "
            "torch.autograd.grad(loss, inputs) through engine(...)")
