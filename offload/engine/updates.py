"""`GroupUpdates`: the engine's optimizer updates of one group at a time.

The update of group `gid` reads its gradient (handed over by backward for an
early update, [Note: early update], else its accumulated grad partition),
runs the optimizer on it and stages the new compute-dtype partition beside
the old one until the step commits ([Note: all or nothing] in step.py). A
mixin of `OffloadEngine`: it reads the engine's store, staged partitions,
optimizer and configuration, and keeps no state of its own.
"""

from __future__ import annotations

from concurrent.futures import wait as futures_wait

import torch

from ..store import Tier

__all__ = ["GroupUpdates", "EARLY_UPDATES_IN_FLIGHT"]

EARLY_UPDATES_IN_FLIGHT = 1  # early updates holding a gradient, at most


class GroupUpdates:
    """Mixin of `OffloadEngine`: one group's update, early (in backward) or in step()."""

    def _last_micro_step(self) -> bool:
        return self._backwards + 1 == self.cfg.engine.grad_accum_steps

    def _grad_ready(self, gid: int, shard_grad: torch.Tensor) -> None:
        """This rank's reduced gradient of `gid` for this micro-step.

        [Note: early update] Where the update of one group cannot depend on the
        others (no clipping, not fp16: `_early_allowed`), the last
        micro-step's gradient goes straight to a background thread that runs the
        group's update while backward goes on, so the optimizer state's NVMe traffic
        hides behind backward compute (without gradient accumulation the gradient
        is a HOST record where HOST has room: [Note: the gradient's fp32 copy is a
        record]). Otherwise it is accumulated in its grad partition
        and `step()` updates every group once the global norm is known."""
        if (self._last_micro_step() and self._early_allowed()
                and not self._nested.several_passes(gid)):  # see nested_grads.py
            # Backpressure: each update holds its gradient; backward waits for slow
            # (I/O-bound) ones before handing over the next rather than piling them up
            live = [f for f in self._early if not f.done()]
            if len(live) >= EARLY_UPDATES_IN_FLIGHT:
                futures_wait(live[:len(live) - EARLY_UPDATES_IN_FLIGHT + 1])
            grad = None  # None: the update takes its stored partition
            if ("g", gid) in self.store:
                self._accumulate(gid, shard_grad)
            elif not (self._early_grads_stored and self._put_early_grad(gid, shard_grad)):
                grad = shard_grad.to("cpu", torch.float32)  # the update holds its own copy
            self._has_grad.add(gid)
            self.pending_updates.add(gid, reads_master=self.master_is_param)
            self._early.append(self._updater.submit(self._update_group, gid, grad, None,
                                                    self.grad_slots.active(gid)))
            return
        self._accumulate(gid, shard_grad)

    def _early_allowed(self) -> bool:
        """Early updates need no global value (no clipping, not fp16: its overflow check
        reads every gradient, at any loss scale, 1 included) and NVMe state, which keeps
        its previous version for free (fresh extents; [Note: all or nothing])."""
        return (self.cfg.engine.dtype != "fp16" and self.optimizer.early_update_allowed()
                and self.cfg.engine.optimizer == "nvme" and self._hyper_watch.early)

    def _update_group(self, gid: int, grad: torch.Tensor | None, norm: float | None,
                      active: list[bool] | None = None) -> None:
        """Adam on group `gid` with `grad` (None: its stored, accumulated gradient), in
        the open step: the new compute-dtype partition is staged beside the old one
        and the optimizer keeps its previous state until the step commits
        ([Note: all or nothing] in step.py). In fp32 the partition is the master
        (`master_is_param`): the optimizer reads the current one and writes the new
        one into the staged partition. `active`: which segments had a gradient
        (default: as known now).
        """
        if active is None:
            active = self.grad_slots.active(gid)
        if grad is None:
            with self._stored_grad(gid) as stored:
                return self._update_group(gid, stored, norm, active)
        pkey = ("p", gid)
        self._update_order.append(gid)
        masters, where = None, None
        if self.master_is_param:
            where = self._memory_tier(pkey)
            try:
                old = self.store.fetch(pkey, to=where, pin=True).wait()  # kept till read
            finally:
                self.pending_updates.read_master(gid)
            masters = {gid: old.cpu()}
        try:
            if masters is not None and self.staged.take(gid, where):
                staged = self.staged.in_place(gid, where)
                masters = None  # the new values overwrite the current ones, read in the pass
            else:
                staged = self.staged.new(gid, self.groups[gid].shard, self.dtype)
            with staged as new:
                res = self.optimizer.update(
                    {gid: grad}, params_out={gid: new}, masters=masters,
                    loss_scale=self._grad_divisor,
                    grad_norm=norm, found_inf=False, next_pid=self._next_update.get(gid),
                    active={gid: active}, schedule_step=self.global_step)
        finally:
            self.pending_updates.done(gid)
            if where is not None:
                self.store.unpin(pkey)
        self._count_opt_bytes(res.bytes_read, res.bytes_written)

    @property
    def _grad_divisor(self) -> float:
        """What the stored gradients are divided by: the fp16 loss scale times the
        micro-steps summed (the gradient is their mean)."""
        return self.loss_scale * self.cfg.engine.grad_accum_steps

    def _count_opt_bytes(self, read: int, written: int) -> None:
        with self._io_lock:
            self._opt_bytes[0] += read
            self._opt_bytes[1] += written

    def _memory_tier(self, pkey: tuple) -> Tier:
        """Where the CPU reads or writes a parameter partition: DEVICE on a CPU device
        where that copy is valid or home, else HOST; DEVICE on a GPU for its home
        (the optimizer's output is then copied in)."""
        cpu = self.device.type == "cpu"  # the DEVICE tier is host memory
        if self._param_tier is Tier.DEVICE:
            return Tier.DEVICE
        if cpu and Tier.DEVICE in self.store.info(pkey).valid:
            return Tier.DEVICE  # HOST memory handed over to DEVICE
        return Tier.HOST
