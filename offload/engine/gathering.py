"""Gathering a group's full weights for its unit, binding them to the modules, and
giving them back: the engine's part between the store's partitions and the model's
forward and backward (a mixin of `OffloadEngine`).

[Note: gather order] below; [Note: gathered weights borrow the record] and
[Note: kept weights] in warm.py; [Note: registered parameters] in params_view.py.

[Note: gradient hooks on parameters]
A hook registered with `p.register_hook` on a parameter (before `initialize`: the
stand-in shares the original's hook dict, so its handle still removes it; or
after, on the stand-in) is registered on each view `_bind` makes of it, before
the engine's own: it runs on that use's gradient, in the compute dtype, and
what it returns is what reaches the partition. torch runs a leaf's hooks once
on the sum of its uses; a parameter used twice in one backward (tied weights,
a module called twice) runs them once per use here, which gives torch's sum
for a hook linear in the gradient (a mask, a scale). A post-accumulate-grad
hook is refused: `.grad` never holds the engine's gradients.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from ..comm import Pending
from ..store import BudgetExceededError, Tier, footprint
from .eviction import sooner_than
from .forward_prefetch import arriving
from .grad_slots import dense_grad, sparse_grad_use
from .params_view import point_weight_list
from .units import Group, not_compiled
from .warm import borrow, kept_view, unborrow

log = logging.getLogger(__name__)

__all__ = ["GatheredWeights", "GroupState", "in_backward"]


@not_compiled  # [Note: torch.compile] in units.py
def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward."""
    return torch._C._current_graph_task_id() != -1


class GroupState:
    """One group's gathered weights: the flat buffer, its views and its all-gather."""

    __slots__ = ("group", "flat", "gathered", "active", "pending", "borrowed", "views",
                 "version", "bound")

    def __init__(self, group: Group, dtype: torch.dtype, device: torch.device) -> None:
        self.group = group
        self.flat = torch.empty(group.padded, dtype=dtype, device=device)
        self.flat.untyped_storage().resize_(0)
        self.flat.requires_grad_(group.requires_grad)
        self.gathered = False
        self.active = 0
        self.pending: Pending | None = None  # an all-gather in flight into `flat`
        self.borrowed = 0  # bytes of the pinned record whose memory `flat` holds:
        # [Note: gathered weights borrow the record] in warm.py
        self.views: list[torch.Tensor] = []  # bound: [Note: kept weights] in warm.py
        self.version = 0  # changes of its weights: [Note: a graph of older weights]
        self.bound = 0  # flat's version when bound: [Note: weights written in a forward]


class GatheredWeights:
    """Gathers, binds and frees the groups' full weights (mixed into `OffloadEngine`)."""

    def weights_changed(self, gids: Iterable[int]) -> None:
        """[Note: a graph of older weights] in engine.py: the groups `gids` hold other
        weights now."""
        for gid in gids:
            self._states[gid].version += 1

    def _gather(self, st: GroupState) -> None:
        """Makes the group's full weights valid in `flat` (waits for them)."""
        with self._spans.use(("p", st.group.gid)):
            if st.pending is None and not st.gathered:
                self._start_gather(st, async_op=False)
            if st.pending is not None:
                pending, st.pending = st.pending, None
                pending.wait()

    def _start_gather(self, st: GroupState, async_op: bool) -> None:
        """Fetches the shard to DEVICE and starts the all-gather into `flat`.

        [Note: gather order] Every rank must issue all-gathers in the same
        order, so they are requested only from the module hooks' thread, in use
        order or in the plan's order, never from I/O completion callbacks (and
        issued there, or in that order by [Note: gather thread]).
        """
        key = ("p", st.group.gid)
        fetch = self.store.fetch(key, to=Tier.DEVICE, pin=True)

        def unpin() -> None:  # a fetch that failed never pinned: its own error stands
            if fetch.settle():
                self.store.unpin(key)
        room = footprint(st.group.shard * self.dtype.itemsize)
        if st.group.requires_grad and self._borrowing.take(room):
            try:  # [Note: gathered weights borrow the record] in warm.py
                borrow(st.flat.untyped_storage(), fetch.wait())
            except BaseException:
                self._borrowing.give(room)
                unpin()
                raise
            st.borrowed, st.gathered = room, True
            return
        try:
            self._warm.fill(st.flat.untyped_storage(), st.group.padded * st.flat.element_size())
            # `.data` has its own version counter: refilling the storage must not look
            # like an in-place change to the views autograd saved (they see the same bytes)
            pending = self._gathers.all_gather(st.flat.data, fetch.wait, async_op=async_op,
                                               on_error=unpin)
        except BaseException:
            unpin()
            raise

        def finish() -> None:
            self.store.unpin(key)
            st.gathered = True
        pending.finish = finish
        st.pending = pending

    def _free(self, st: GroupState) -> None:
        self._gradless_gathered.discard(st.group.gid)
        if st.gathered:
            self.unbind(st.group.gid)
            kept = kept_view(st.views)  # [Note: kept weights] in warm.py
            if kept is not None:
                self._leave_with_kept(st, kept)
            elif st.borrowed:
                self._warm.vacate(st.flat.untyped_storage())  # the record's memory goes back
                self._return(st)
            else:
                self._warm.drain(st.flat.untyped_storage())
            st.gathered = False
        st.views.clear()

    def _keep_written(self, st: GroupState) -> None:
        """[Note: weights written in a forward] in weight_writes.py: a borrowed record's
        memory, which the forward wrote, is the stored partition; it becomes its only
        copy, and graphs of its weights before the write are of older ones."""
        if st.borrowed:
            with self.store.modify(("p", st.group.gid), Tier.DEVICE):
                pass
            self.weights_changed([st.group.gid])

    def _leave_with_kept(self, st: GroupState, kept: int) -> None:
        """The gathered storage stays with the view kept ([Note: kept weights] in
        warm.py), a borrowed record's memory copied first; `flat` takes a fresh one."""
        storage = st.flat.untyped_storage()
        if st.group.gid not in self._kept_warned:
            self._kept_warned.add(st.group.gid)
            log.warning(
                "a tensor bound to parameter %r inside a unit's forward is still referenced "
                "after the unit: its group's gathered weights (%.1f MiB) stay allocated "
                "outside the memory budgets while it is. Kept by the program (a module "
                "attribute, a list): keep a .clone() instead, or read engine.full_weights(); "
                "passed to an activation checkpoint (transformers' DeBERTa-v2 encoder passes "
                "its rel_embeddings to each checkpointed layer), the checkpoint holds it "
                "until its backward, and the numbers are torch's either way",
                st.group.slots[kept % len(st.group.slots)].names[0],
                storage.nbytes() / 2**20)
        if st.borrowed:
            unborrow(storage)
            self._return(st)
        else:
            self._warm.disown(storage.nbytes())
        self._fresh_storage(st)

    def _fresh_storage(self, st: GroupState) -> None:
        """`flat` takes a new storage without memory; the old one goes with its last view.
        Made outside inference mode (an error inside a forward under the user's
        `torch.inference_mode()` lands here): an inference tensor as `flat` would make
        every later gather's weights invisible to autograd, and its unit stop training."""
        with torch.inference_mode(False):
            fresh = torch.empty(st.group.padded, dtype=st.flat.dtype, device=st.flat.device)
        fresh.untyped_storage().resize_(0)
        st.flat.data = fresh

    def _return(self, st: GroupState) -> None:
        """Drops the pin of a borrowed record (its memory is no longer `flat`'s)."""
        self._borrowing.give(st.borrowed)
        st.borrowed = 0
        self.store.unpin(("p", st.group.gid))

    def unbind(self, gid: int) -> None:
        """Points the group's module attributes back at their registered stand-ins
        ([Note: registered parameters]): a use outside the unit raises, naming it."""
        for slot in self.groups[gid].slots:
            for module, name in slot.uses:
                module.__dict__.pop(name, None)
                point_weight_list(module, name)  # [Note: RNN weight lists] in params_view.py

    def _gradless(self, st: GroupState) -> bool:
        """Whether no gradient can reach the group in this backward: frozen, at
        initialize or since ([Note: freezing after initialize] in params_view.py)."""
        return not st.flat.requires_grad or all(
            self.registered.frozen(st.group.gid, i) for i in range(len(st.group.slots)))

    def _free_gradless(self, keep: list[int]) -> None:
        """[Note: weights without a gradient in backward] A group that gets a gradient
        is freed once it arrives (`_on_grad`); one that cannot (frozen) has no such
        moment, and stayed gathered until the backward ended: with a frozen base (LoRA,
        a frozen encoder) every layer's full weights at once, outside the budgets. At
        each unit's backward, a frozen group gathered in this backward is freed once
        nothing but the engine holds its storage: autograd releases a node's saved
        tensors (views of it, `.t()` of a view) when the node has run, so no node that
        reads it is left. A holder that stays (retain_graph, a view kept by the
        model) keeps it gathered until the backward ends, as before. So does a view
        itself held in Python: a non-reentrant checkpoint's recomputation keeps the
        frozen weights its ops save (those that need no gradient) as the views
        themselves until the node that reads them runs, which the storage's count
        does not show; freed, the group's storage went to that view with a warning
        that the user kept it ([Note: kept weights] in warm.py)."""
        for gid in list(self._gradless_gathered):
            st = self._states[gid]
            if gid in keep or st.active or st.pending is not None or not st.gathered:
                continue
            # holders: `flat`, each bound view, and the storage object asked here
            if torch._C._storage_Use_Count(st.flat.untyped_storage()._cdata) \
                    <= 2 + len(st.views) and kept_view(st.views, (
                        use for slot in st.group.slots for use in slot.uses)) is None:
                self._free(st)

    def _bound(self, st: GroupState) -> bool:
        """Whether the group's module attributes are views of its gathered weights."""
        module, name = st.group.slots[0].uses[0]
        return name in module.__dict__

    def _bind(self, st: GroupState) -> None:
        """Points every module attribute of the group's parameters at fresh views of `flat`.

        [Note: recomputation without the unit's hooks] An activation-checkpoint
        recomputation through the unit's module (`torch.utils.checkpoint` around a
        block) re-binds in the unit's forward hook; one that calls the unit's
        `forward` itself (transformers' checkpointed layers, a tensor-parallel block)
        runs no hook, so the unit's backward hook binds the weights it gathers: the
        recomputation's ops read views whose gradient hooks collect its gradients."""
        self.registered.check_installed(st.group.gid)
        # Views made while autograd is off (a backward hook, no_grad) would cut the
        # weights out of the graph of an activation-checkpoint recomputation.
        with torch.set_grad_enabled(torch.is_grad_enabled() or in_backward()):
            pieces = st.flat.split(st.group.split_sizes)  # [Note: one split per use]
            for i, (slot, piece) in enumerate(zip(st.group.slots, pieces)):
                view = piece.view(slot.shape)
                if view.requires_grad and self.registered.frozen(st.group.gid, i):
                    view = view.detach()  # [Note: freezing after initialize]
                if view.requires_grad:  # [Note: parameters without a gradient]
                    for hook in self.registered.grad_hooks(st.group.gid, i):
                        view.register_hook(hook)  # [Note: gradient hooks on parameters]
                    view.register_hook(self.grad_slots.hook(st.group.gid, i,
                                                            self.registered.frozen))
                for module, name in slot.uses:  # before _parameters: [Note: registered
                    # parameters] in params_view.py; [Note: sparse gradients] in grad_slots.py
                    module.__dict__[name] = dense_grad(view) if sparse_grad_use(module, name) \
                        else view
                st.views.append(view)
        st.bound = st.flat._version
        if in_backward() and self._gradless(st):  # [Note: weights without a gradient in
            self._gradless_gathered.add(st.group.gid)  # backward]

    def _prefetch(self) -> None:
        """Follows the plan: the next group's all-gather starts now (it runs behind this
        unit's compute), the groups after it start moving towards DEVICE, each only
        where room can be made without evicting a copy needed no later than it, or
        else into HOST ([Note: staging in HOST] in eviction.py)."""
        for i, gid in enumerate(self.trace.upcoming(self.cfg.engine.prefetch_depth)):
            st = self._states[gid]
            if st.gathered or st.pending is not None:
                continue
            gather = i == 0 and self.comm.world > 1  # a collective: every rank issues it
            key = ("p", gid)
            if not gather and arriving(self.store, key):
                continue
            sooner = sooner_than(self.trace, gid, self.staged, self.pending_updates)
            to = Tier.DEVICE
            if not gather and not self.store.fits_sparing(key, Tier.DEVICE, sooner):
                if Tier.HOST in self.store.info(key).valid:
                    continue  # staged already: its use hands it up
                if not self.store.fits_sparing(key, Tier.HOST, sooner):
                    return  # the groups after it are needed later still: [Note: prefetch room]
                to = Tier.HOST
            try:
                if gather:
                    self._start_gather(st, async_op=True)
                elif self.store.prefetch(key, to=to) is None:
                    return  # its room is on its way: the next unit asks again
            except BudgetExceededError as e:  # no room now: the use fetches on demand
                log.debug("prefetch of group %d skipped: %s", gid, e)
                return

    def _input_gradient_pass(self, unit) -> None:
        """[Note: gradients of the inputs] A unit's backward that `engine.backward()` did
        not start. `torch.autograd.grad(loss, inputs)` (adversarial examples,
        saliency) runs the units' backward but no parameter's `AccumulateGrad`: the
        unit's weights are gathered as for a backward, no micro-step is counted, no
        gradient is reduced, and what was gathered is freed when autograd's pass
        ends (a callback queued on it). A pass that would accumulate a parameter's
        gradient (`loss.backward()`, or `autograd.grad` of the weights) is refused
        before anything is gathered, as is `create_graph=True` (a gradient penalty's
        second backward would read weights freed after the first)."""
        task = torch._C._current_graph_task_id()
        if self._input_pass != task:  # the pass's first unit: what it is is known now
            if any(torch._C._will_engine_execute_node(
                    torch.autograd.graph.get_gradient_edge(st.flat).node)
                   for st in self._states if st.flat.requires_grad):
                self._refuse_plain_backward()
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "torch.autograd.grad(..., create_graph=True) through the model (a "
                    "gradient penalty) is not supported: the second backward would need the "
                    "weights the first one gathered; torch.autograd.grad without "
                    "create_graph (input gradients: adversarial examples, saliency) is")
            self._input_pass = task  # free its gathers at its end
            torch.autograd.Variable._execution_engine.queue_callback(self._end_input_pass)
        for gid in unit.needs:
            st = self._states[gid]
            if not st.gathered:
                self._gather(st)
            if not self._bound(st):
                self._bind(st)

    def _end_input_pass(self) -> None:
        self._input_pass = None
        self._release_gathered()
