"""`ModuleHooks`: the engine's module and autograd hooks around each unit.

Before a unit's forward its groups are gathered and bound (and the access
trace records them); after it they are freed, and a hook on each output that
needs a gradient re-gathers them before the unit's backward ([Note: gathered
weights and autograd] in engine.py). The root module's hooks hold the engine
for one thread ([Note: one thread at a time] in one_thread.py). A mixin of
`OffloadEngine`: it keeps no state of its own.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .absent import AbsentWeight
from .gathering import in_backward
from .saved_weights import (calls_functorch, close_all, close_scope, open_scope,
                            refused_by_functorch)
from .tensor_parallel import refuse_layer_outputs
from .units import Unit, copy_weight_views, hooks_last, output_tensors

__all__ = ["ForwardPass", "ModuleHooks", "IN_BACKWARD"]

# the engines whose backward() runs now, in any thread: [Note: backward runs here]
IN_BACKWARD: weakref.WeakSet = weakref.WeakSet()


class ForwardPass:
    """[Note: a forward awaiting its backward]
    A save between a training forward and its backward was taken: the RNG states it
    holds are those after the forward's dropout, and the BatchNorm statistics those
    the forward updated, while the activations are lost, so the resumed run, doing
    that micro-batch again, drew other dropout masks and counted the batch in the
    statistics twice. Each forward of the model in training mode with autograd on
    makes a mark, held by the backward hooks it registers on its units' outputs (so
    it lives as long as its graph) and kept weakly in `engine._awaiting` until a
    backward ends; a save refuses while one is there (`check_between_steps`). A
    forward whose graph was dropped, or that raised, or ran in evaluation mode or
    under no_grad, holds nothing back."""

    __slots__ = ("__weakref__",)


class ModuleHooks:
    """Mixin of `OffloadEngine`: the hooks `initialize` registers on the model."""

    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not in_backward():  # [Note: one thread at a time] in one_thread.py
            self._check_open()
            self._one_thread.enter("the model's forward", direct=True)
            self._weight_writes.take()  # what a direct call that raised left
            close_all(self._saved_scopes)  # [Note: weights saved for a backward]
            self._interrupts.direct_enter()  # [Note: Ctrl-C at a safe point]
            # [Note: a TP group reads the same rows] in rank_order.py
            self._rank_order.forward_called(args, kwargs)
            self._nested.autograd_forward = torch.is_grad_enabled()
            if torch.is_grad_enabled() and module.training:  # [Note: a forward awaiting
                self._pass = ForwardPass()  # its backward]
                self._awaiting.add(self._pass)
            if self.tp is not None:  # [Note: per-layer outputs under tensor parallelism]
                refuse_layer_outputs(module, kwargs)

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        if in_backward():
            return
        if self._one_thread.refused_here():  # the engine's state is another thread's call's
            self._one_thread.leave()
            return
        autograd, self._nested.autograd_forward = self._nested.autograd_forward, False
        self._rank_order.forward_ended()
        e = sys.exc_info()[1] if out is None else None
        if e is not None and self._pass is not None:  # [Note: a forward awaiting its
            self._awaiting.discard(self._pass)  # backward]: no backward of it comes
        self._pass = None
        direct = self._one_thread.direct_only()
        noted = None
        if e is None and direct:  # [Note: a call that a Ctrl-C fails] in interrupts.py
            try:
                self._interrupts.deliver_noted()
            except BaseException as k:
                e = noted = k
        if e is None and not autograd:
            try:  # another rank's evaluation raised after its last unit's check
                self._rank_order.check_evaluation_end()
            except BaseException as k:
                e = noted = k
        # the model called directly, outside every engine call, raised: undone and told
        # to the other ranks as engine(...) does ([Note: a rank whose model raised])
        undo = e is not None and direct
        alone = self._undo_forward(e) if undo else None
        self._one_thread.leave()
        self._interrupts.direct_leave(failed=e is not None)
        if undo:  # an exception from this hook would be dropped by torch
            self._after_failed_pass(e, alone, raises=False)
        if noted is not None:  # after a forward that returned, it is not
            raise noted

    def _make_pre(self, unit: Unit) -> Callable:
        def pre(module: nn.Module, args: Any) -> None:
            if not in_backward():  # a submodule called by itself: [Note: one thread at a
                self._check_open()  # time] in one_thread.py
                self._one_thread.unit_enter(unit.name, id(unit))
            self._interrupts.safe_point()  # [Note: Ctrl-C at a safe point] in interrupts.py
            _refuse_functorch(unit.name)
            self._weight_writes.before(unit, self._states)  # see weight_writes.py
            hooks_last(module, self._last_hooks[id(module)])
            # a forward without autograd (evaluation, generate) is not part of a
            # training step: it leaves the access trace and the plan alone
            training = torch.is_grad_enabled() or in_backward()
            if not in_backward():  # a recomputation repeats the backward's order
                self._rank_order.check_unit(unit, backward=False,  # see rank_order.py
                                            autograd=training)
            self._spans.forward_begin(unit.name)
            if not in_backward() and (training or self._nested.autograd_forward):
                # [Note: a gradient in several passes] in nested_grads.py
                self._nested.forward(unit.needs, checkpointed=not training)
            for gid in unit.needs:
                st = self._states[gid]
                if training:
                    self.trace.record(gid)
                self._gather(st)
                self._bind(st)
                st.active += 1
            if training:
                self._prefetch()
                if not in_backward() and torch.is_grad_enabled():
                    self._open_saved_scope(unit)  # [Note: weights saved for a backward]
            else:  # [Note: forward-only prefetch] in forward_prefetch.py
                self._ahead.started(unit, lambda g: self._states[g].gathered
                                    or self._states[g].pending is not None)
        return pre

    def _make_post(self, unit: Unit) -> Callable:
        def post(module: nn.Module, args: Any, out: Any) -> Any:
            # registered with always_call: also after the unit's forward (or a hook) raised,
            # also where the model is called directly, not through the engine
            failed = out is None and sys.exc_info()[1] is not None
            backward = in_backward()
            if not backward and (self._one_thread.unit_leave(id(unit), entered=False)
                                 or self._one_thread.refused_here()):
                return None  # refused (its own call, or the model's whose unit it is: the
                # root's hook, after this one, leaves that): the weights are another call's
            try:
                return self._unit_post(unit, out, failed, backward)
            finally:
                if not backward:
                    self._one_thread.unit_leave(id(unit), entered=True)
        return post

    def _unit_post(self, unit: Unit, out: Any, failed: bool, backward: bool) -> Any:
        # [Note: weights saved for a backward] in saved_weights.py
        if not backward and close_scope(self._saved_scopes, unit) and failed \
                and refused_by_functorch(sys.exc_info()[1]):
            self._saved_hooks_on[id(unit)] = False
        if not failed and not backward:  # [Note: outputs that view the weights]
            out = copy_weight_views(out, {
                self._states[gid].flat.untyped_storage().data_ptr()
                for gid in unit.needs if self._states[gid].gathered} - {0})
        self._spans.forward_end(unit.name, backward)
        written = [] if backward else self._weight_writes.written(unit, self._states)
        try:
            for st in written:
                self._keep_written(st)
        finally:
            for gid in unit.needs:
                st = self._states[gid]
                st.active = max(0, st.active - 1)
                if st.active == 0 and not backward:
                    if failed and st.gathered:
                        self._orphan(st)  # the traceback's frames hold its views
                    else:
                        self._free(st)
        self._weight_writes.refuse(unit, written, failed)  # [Note: weights written in
        if failed:  # a forward] in weight_writes.py
            return None
        if torch.is_grad_enabled() and not backward:
            versions = self._versions(unit)
            for t in output_tensors(out):
                if t.requires_grad:
                    t.register_hook(self._make_pre_backward(unit, versions, self._pass))
        return out

    def _versions(self, unit: Unit) -> tuple[int, ...]:
        """[Note: a graph of older weights] in engine.py: the changes of unit's groups."""
        return tuple(self._states[gid].version for gid in unit.needs)

    def _open_saved_scope(self, unit: Unit) -> None:
        hooks_on = self._saved_hooks_on.get(id(unit))
        if hooks_on is None:  # torch.func in its forward: no hooks
            hooks_on = self._saved_hooks_on[id(unit)] = not calls_functorch(unit.module)
        if not hooks_on:
            return
        versions = self._versions(unit)
        own = {self._states[gid].flat.untyped_storage().data_ptr(): (gid, unit, versions)
               for gid in unit.needs if self._states[gid].gathered}
        own.pop(0, None)
        open_scope(self._saved_scopes, unit, own, self._use_saved)

    def _use_saved(self, saved: Any) -> None:
        """A weight a backward unpacked ([Note: weights saved for a backward]): the unit's
        backward hook runs first where its group is not gathered or has changed."""
        if (not self._states[saved.gid].gathered
                or self._versions(saved.unit) != saved.versions):
            self._pre_backward(saved.unit, saved.versions)

    def _refuse_module_load(self, module: nn.Module, state_dict: Mapping[str, Any],
                            prefix: str, *args: Any) -> None:
        """A load_state_dict pre-hook on every module of the model: `model.load_state_dict`
        outside a `full_weights` block loaded the buffers of the modules it reached
        first, then raised at the first stand-in (with `assign=True` it took every
        tensor, and the engine refused each later call, with no way back); inside a
        read-only block, or a block without some of the module's weights, it loaded
        what the block then discarded, or failed half way. Refused before the first
        module loads anything."""
        # [Note: calls inside a full_weights block]: only what a writable block holds, of
        # every weight it loads (the root's buffers load before its children's weights)
        if not self.registered.writable or any(
                isinstance(p, AbsentWeight) and prefix + name in state_dict
                for name, p in module.named_parameters(remove_duplicate=False)):
            raise RuntimeError(
                f"{type(module).__name__}.load_state_dict(...) on a model the engine holds: "
                "its weights live in the engine's partitions, not in the modules. Load "
                "with engine.load_state_dict(state_dict) (weights and buffers, checked "
                "first), or call it inside `with engine.full_weights(writable=True):` "
                "holding every weight it loads (no modules named, or this one). Nothing "
                "was loaded")

    def _refuse_plain_backward(self) -> None:
        """[Note: backward runs here] A backward the engine did not start (`loss.backward()`,
        `torch.autograd.backward`) would not be counted as a micro-step, nor scaled
        for fp16, nor waited for: refused at its first hook, before any gradient is
        reduced or any update runs (on a closed engine, saying it is closed)."""
        if not self._in_backward:
            self._check_open()
            if any(e is not self for e in IN_BACKWARD):
                raise RuntimeError(
                    "another engine's backward (engine.backward of a model fed by this "
                    "engine's model's output) reached this engine's model, whose weights "
                    "need a gradient: each engine's backward runs its own model's graph. "
                    "Freeze this model's weights for that backward (requires_grad_(False): "
                    "the gradient still flows through it, as a GAN's generator trains "
                    "through a frozen discriminator), or take the gradient at the boundary "
                    "(g = torch.autograd.grad(loss, out)[0], then that engine's "
                    "backward((out * g).sum())), or detach() between the models, or wrap "
                    "both in one engine. Nothing was accumulated")
            raise RuntimeError(
                "a backward through the engine's model ran outside engine.backward() (e.g. "
                "loss.backward()); call engine.backward(loss) instead: it counts the "
                "micro-step for engine.grad_accum_steps, scales the loss for fp16 and waits "
                "for the gradients' reduction. torch.autograd.grad of the inputs through "
                "the model works; of the weights, use engine.backward")

    def _make_pre_backward(self, unit: Unit, versions: tuple[int, ...],
                           forward: ForwardPass | None = None) -> Callable:
        # `forward` is held as long as the graph: [Note: a forward awaiting its backward]
        def hook(grad: torch.Tensor, forward: ForwardPass | None = forward) -> None:
            self._pre_backward(unit, versions)
        return hook

    def _pre_backward(self, unit: Unit, versions: tuple[int, ...]) -> None:
        """Before `unit`'s backward (`versions`: its groups' at its forward): gathers."""
        if versions != self._versions(unit):  # [Note: a graph of older weights], engine.py
            raise RuntimeError(
                f"backward: the forward of {unit.name or 'the model'} ran before the "
                "weights changed (a step(), load_state_dict() or writable full_weights() "
                "since), so its gradient would mix the old activations with the new "
                "weights; run the forward again after the change (torch refuses such a "
                "graph too: its saved weights were modified in place)")
        if not self._in_backward:  # [Note: gradients of the inputs] in gathering.py
            self._input_gradient_pass(unit)
            return
        self._interrupts.safe_point()  # [Note: Ctrl-C at a safe point] in interrupts.py
        # the hook fires for each output with a gradient, and that number may differ
        # between ranks: the first of each unit in a backward checks (its groups may
        # be gathered ahead, and its prefetch issue all-gathers: a failed rank's
        # notice must meet a check), and a later one where it gathers again
        first = id(unit) not in self._backward_units
        if first or any(not self._states[gid].gathered for gid in unit.needs):
            self._backward_units.add(id(unit))
            self._rank_order.check_unit(unit, backward=True)
        self._spans.backward_begin(unit.name)
        self._nested.began(unit.needs)  # [Note: reentrant checkpoints inside a unit]
        self._free_gradless(unit.needs)  # [Note: weights without a gradient in backward]
        early_master = (self.master_is_param and self._last_micro_step()
                        and self._early_allowed())
        for gid in unit.needs:
            if early_master:
                self.pending_updates.expect(gid)
            st = self._states[gid]
            if not st.gathered:  # the saved views see the refilled storage
                self.trace.record(gid)
                self._gather(st)
            if not self._bound(st):  # [Note: recomputation without the unit's hooks]
                self._bind(st)
        self._prefetch()


def _refuse_functorch(unit: str) -> None:
    """[Note: a weight swapped in for one call] in params_view.py: a torch.func
    transform (grad, vmap, jacrev, functional_call's grad) wraps the tensors it traces;
    the unit's weights are gathered into the engine's own buffers, which it cannot
    wrap, and the first gather raised "Cannot access data pointer of Tensor that
    doesn't have storage" from inside the engine."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(
            f"unit {unit!r} ran under a torch.func transform (grad, vmap, jacrev, ...), "
            "which the engine does not support: it gathers each unit's weights into "
            "buffers of its own, which the transform cannot trace. For gradients of the "
            "inputs use torch.autograd.grad through engine(...); for torch.func, use a "
            "plain copy of the model (engine.full_weights() gives its weights)")
