"""The model's parameters as torch sees them after `initialize`.

[Note: registered parameters]
As FSDP2 re-registers each parameter as a sharded one, `initialize` puts one
stand-in `nn.Parameter` per original parameter back into every module
attribute that held it (`module._parameters[name]`, same object under each
tied name): `model.named_parameters()`, `model.parameters()`,
`sum(p.numel() ...)`, `p.requires_grad` and `p.shape` read as on the plain
model, in the original order. The stand-in is an `AbsentWeight` (absent.py):
it holds no storage, so reading its data never touches freed memory; it
raises an error that names `engine.full_weights()` instead. Its dtype is the
compute dtype (`engine.dtype`), the dtype the model computes in, as after
`model.to(dtype)`; `dtypes` keeps each parameter's original dtype, the one
`state_dict()` and `save_pretrained()` write.

While a unit runs, its modules' attributes are views of the gathered flat
buffer, set in the module's `__dict__` (which attribute lookup reads before
`nn.Module.__getattr__` consults `_parameters`); outside, the `__dict__`
entry is removed and `module.weight` is the registered stand-in again.
The engine keeps its trainable state in its partitions, never in these
stand-ins: they are views for the user, not state (nothing is trained,
checkpointed or counted through them).

[Note: a weight swapped in for one call]
`torch.func.functional_call` (and `torch.nn.utils.stateless`) puts the caller's
tensors into `module._parameters` for one call; the engine binds its gathered
views in `__dict__`, which attribute lookup reads first, so the call computed
with the engine's weights and ignored the caller's (its gradients None), without
a word. A unit's gather now checks that `_parameters` still holds what the
engine registered, and raises naming the parameter. torch.func's transforms
(grad, vmap, jacrev) are refused at the unit's first hook, before the gather.

[Note: absent gradients]
The gradients are reduced into the engine's partitions (over every rank, in
host memory or on NVMe), never into the parameters' `.grad`. Left None, a
loop written for torch would clip with `torch.nn.utils.clip_grad_norm_`
(which skips parameters without a gradient and returns 0) and silently train
unclipped. Between a backward and the step that uses its gradients, each
parameter that had a gradient (not frozen, and used by a forward since the last
step, as torch's) has therefore a `.grad` that is an `AbsentWeight` that raises,
on any computation, an error naming `optim.max_grad_norm`; `p.grad is None`
is False, as in torch after a backward, and `model.zero_grad()` sets it to
None as torch does.

[Note: a .grad the program dropped]
A torch loop drops gradients through `.grad`: `model.zero_grad()` before
skipping a batch, or `p.grad = None` to leave one parameter out of the step.
The engine's gradients are not in `.grad`, so it reads what the program did to
the `.grad`s it showed (`dropped_grads`) before each backward and each step
that would use them. Every one of them None: the step's gradients are dropped,
as by `engine.zero_grad()` (updates that ran early are undone), so the step
changes nothing and a backward starts the step over, as in torch. Some of
them None, or any set to a tensor: the engine cannot take one parameter's
gradient out of its partitions (nor use one the program made), so that
backward or step raises, naming the parameter and the fix (freeze it before
the forward; drop all of them). With several data-parallel ranks, they agree
on it in the collective each call runs anyway, and a drop on some ranks only
raises on every rank (the ranks of one tensor-parallel group are not
compared, as for freezing). Until that backward or step the step stays open
(save_checkpoint refuses), as it is only then that the `.grad`s are read.

[Note: RNN weight lists]
torch's RNN modules (LSTM, GRU, RNN) also keep their weights in a list,
`_flat_weights`, refreshed from the attributes at each forward. Left alone,
the list would hold the original parameters after `initialize` and, after
each forward, the unit's gathered views: memory outside the budgets, kept
until the module's next forward. Wherever the engine sets such an attribute
behind `__setattr__` (registering, unbinding), `point_weight_list` points the
list's entry at what the attribute now is.

[Note: freezing after initialize]
torch reads `requires_grad` when the forward builds the graph, and again when
backward reaches the parameter: a parameter frozen before either gets no
gradient from that backward (its gradient hooks still run; `.grad` is left as
it was), and its optimizer skips it when `.grad` is None (no weight decay, no
moment decay, no step count) while keeping its moments for when it trains
again. The engine does the same: when a unit binds its weights, a view of a
parameter whose stand-in has `requires_grad` False is detached, so it has no
gradient, and the gradient hook of a view whose stand-in was frozen after the
forward hands on zeros and records no gradient, so its segments are left
alone by the update ([Note: parameters without a gradient] in grad_slots.py)
unless an earlier micro-batch of the step gave one; unfrozen, it trains on
from its kept moments and step count. This covers what trained at initialize: a parameter
frozen then has no optimizer state (nor an fp32 master), so unfreezing it
raises at the next backward, naming the recipe for progressive unfreezing
(initialize with all that will train trainable, then freeze what waits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from .absent import (AbsentWeight, WeightHome, absent_grad_message, absent_message,
                     closed_message)
from .units import Group, Unit

if TYPE_CHECKING:
    from ..comm import Collectives

__all__ = ["RegisteredParams", "point_weight_list", "state_entries", "all_dropped"]


def point_weight_list(module: nn.Module, name: str) -> None:
    """[Note: RNN weight lists]: the entry of attribute `name` in the module's list of
    weights (torch's RNN modules) becomes what `module.name` is now."""
    names = getattr(module, "_flat_weights_names", None)
    weights = module.__dict__.get("_flat_weights")
    if names and isinstance(weights, list) and name in names and len(weights) == len(names):
        weights[names.index(name)] = getattr(module, name)


# [Note: engine.zero_grad on some ranks]
# `engine.zero_grad()` drops the step's gradients at once, and a `step()` with no
# backward since returned False at once, with no collective. On one rank only (`if rank
# == 1: engine.zero_grad()`), its step() returned False alone while the others' step()
# waited at its check; they raised at that rank's next forward, and from then on the
# ranks ran one iteration apart, each step averaging two iterations' gradients, with no
# error. So on a job of several ranks a window `engine.zero_grad()` dropped is noted,
# and that rank's next step() still runs the step's check and agreement, saying it
# dropped its gradients, as a `.grad` the program dropped does ([Note: a .grad the
# program dropped]): where every rank did, nothing changes; where some did, every rank
# raises (the others' step fails, its gradients dropped too), and the ranks go on
# together. A backward after the drop starts a new window and forgets it: where the
# others went on to their step, the rank-order check meets it there ([Note: ranks run
# the same units] in rank_order.py), and the ranks' windows may legitimately differ
# in emptiness after an error both saw (one had dropped its window, the other not),
# so comparing flags there would raise where nothing is wrong.


def all_dropped(dropping: int, world: int, after: str = "") -> bool:
    """Whether every rank's program dropped every `.grad` (`dropping` of `world` did);
    raises where some ranks did and others did not, `after` ending the message."""
    if 0 < dropping < world:
        raise RuntimeError(
            f"the program dropped the step's gradients (model.zero_grad() or "
            f"engine.zero_grad()) after the backward on {dropping} of {world} ranks and "
            "kept them on the others: drop the "
            "gradients on every rank at the same point, as DDP asks, or on none; to start "
            "the step over now, call engine.zero_grad() on every rank" + after)
    return dropping == world


def _plain() -> torch._C.DisableTorchFunctionSubclass:
    """Reads of the stand-ins' `requires_grad`, `.grad` and hooks past their
    `__torch_function__` ([Note: weights read through the registered parameters] in
    absent.py), which a metadata read need not meet: 0.2 us where 0.9 us, several per
    unit and step."""
    return torch._C.DisableTorchFunctionSubclass()


class RegisteredParams:
    """One stand-in parameter per slot of every group, with its original dtype."""

    def __init__(self, model: nn.Module, groups: list[Group], units: list[Unit],
                 dtype: torch.dtype, device: torch.device) -> None:
        first: dict[int, str] = {}  # each parameter's first name, as torch lists it
        for name, p in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
        unit_of: dict[int, str] = {}
        for u in units:
            for gid in u.needs:
                unit_of.setdefault(gid, u.name)
        modules = dict(model.named_modules(remove_duplicate=False))

        def parent(unit: str) -> tuple[str, str] | None:  # the likeliest reader of its weight
            if unit not in modules or not unit:
                return None
            name = unit.rpartition(".")[0]  # containers only call their children
            while name and isinstance(modules[name], (nn.ModuleList, nn.ModuleDict,
                                                      nn.Sequential)):
                name = name.rpartition(".")[0]
            return (name, type(modules[name]).__name__)
        self.groups = groups
        self.stand_ins: list[list[nn.Parameter]] = []
        self.dtypes: list[list[torch.dtype]] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(stand-in) -> (gid, slot)
        # id(full weight) -> (gid, slot) from `summon` until `register` ([Note: calls
        # inside a full_weights block] in full_weights.py)
        self._summoned: dict[int, tuple[int, int]] = {}
        self.summoned_weights: dict[int, list[nn.Parameter]] = {}  # gid -> what `summon` put
        self.writable = False  # whether the block that summoned them writes them back
        self._names: dict[tuple[int, int], str] = {}  # (gid, slot) -> its first name
        self._grads: list[tuple[nn.Parameter, AbsentWeight]] = []  # [Note: absent gradients]
        self._shown: list[tuple[nn.Parameter, AbsentWeight]] = []  # what show_grads showed
        for g in groups:
            row = []
            for i, s in enumerate(g.slots):
                name = first.get(id(s.param), s.fqn)
                unit = unit_of.get(g.gid, "?")
                absent = AbsentWeight(s.shape, dtype, device,
                                      absent_message(name, unit, parent(unit)), name=name)
                p = nn.Parameter(absent, requires_grad=g.requires_grad)
                hooks = s.param._backward_hooks if s.param is not None else None
                if hooks:  # [Note: gradient hooks on parameters]: the original's dict, so
                    p._backward_hooks = hooks  # the user's handles still remove them
                p.home = WeightHome(*s.uses[0])  # [Note: weights read through the
                # registered parameters] in absent.py
                self._where[id(p)] = (g.gid, i)
                self._names[(g.gid, i)] = name
                row.append(p)
                if g.requires_grad:
                    self._grads.append((p, AbsentWeight(s.shape, dtype, device,
                                                        absent_grad_message(name), True,
                                                        name)))
            self.stand_ins.append(row)
            self.dtypes.append([s.param.dtype if s.param is not None else dtype
                                for s in g.slots])

    def register(self, gid: int) -> None:
        """Puts the group's stand-ins into every module attribute that held its
        parameters (the originals, or the weights `summon` put there, are dropped by
        the caller)."""
        self._install(gid, self.stand_ins[gid])
        for p in self.summoned_weights.pop(gid, ()):
            del self._summoned[id(p)]

    def summon(self, gid: int, weights: list[nn.Parameter]) -> None:
        """Puts the group's full `weights` (one per slot) where its stand-ins are, until
        `register(gid)`; `locate` finds them meanwhile ([Note: calls inside a
        full_weights block] in full_weights.py)."""
        self._install(gid, weights)
        self.summoned_weights[gid] = weights
        self._summoned.update((id(p), (gid, i)) for i, p in enumerate(weights))

    def check_installed(self, gid: int) -> None:
        """[Note: a weight swapped in for one call] Raises where a module attribute of
        group `gid` holds another tensor than the one `register` or `summon` put there."""
        params = self.summoned_weights.get(gid) or self.stand_ins[gid]
        for slot, p in zip(self.groups[gid].slots, params):
            for (module, name), fqn in zip(slot.uses, slot.names):
                if module._parameters.get(name) is not p:
                    raise RuntimeError(
                        f"{fqn} holds another tensor than the parameter the engine "
                        "registered (torch.func.functional_call, torch.nn.utils.stateless "
                        "or code that swaps module._parameters for a call): the engine "
                        "computes with its own gathered weights and would ignore it, "
                        "silently. Call the model with its own weights; to run it with "
                        "others, load them (engine.load_state_dict, or "
                        "engine.full_weights(writable=True)); for gradients of the "
                        "inputs, torch.autograd.grad through engine(...) works")

    def _install(self, gid: int, params: list[nn.Parameter]) -> None:
        for slot, p in zip(self.groups[gid].slots, params):
            for module, name in slot.uses:
                module._parameters[name] = p
                point_weight_list(module, name)

    def show_grads(self, had: Callable[[int, int], bool]) -> None:
        """[Note: absent gradients] After a backward: each parameter that had a gradient
        in the step so far (`had(gid, slot)`) shows a stand-in `.grad` that names where
        its gradient is; the others (frozen, or unused by the forwards) none, as in
        torch."""
        self._shown = []
        with _plain():
            for p, g in self._grads:
                shown = had(*self._where[id(p)])
                p.grad = g if shown else None
                if shown:
                    self._shown.append((p, g))

    def hide_grads(self) -> None:
        """After the step (or its gradients dropped): `.grad` is None again, as torch's
        after `zero_grad()`."""
        with _plain():
            for p, _ in self._grads:
                p.grad = None
        self._shown = []

    def close(self) -> None:
        """At the engine's close: the stand-ins (and the gradients' shown since the last
        backward) say that the engine is closed and its weights gone, rather than name
        `engine.full_weights()`, which a closed engine refuses."""
        for (gid, slot), name in self._names.items():
            self.stand_ins[gid][slot].message = closed_message(name)
            self.stand_ins[gid][slot].home = None
        for p, g in self._grads:
            g.message = closed_message(self._names[self._where[id(p)]])

    def locate(self, p: torch.Tensor, summoned: bool = False) -> tuple[int, int] | None:
        """(gid, slot index) of a registered stand-in (or, with `summoned`, of a full
        weight `summon` put in its place); None for any other tensor."""
        where = self._where.get(id(p))
        return self._summoned.get(id(p)) if where is None and summoned else where

    def grad_hooks(self, gid: int, slot: int) -> list:
        """[Note: gradient hooks on parameters] The hooks registered on the slot's
        stand-in (`p.register_hook`), in their order."""
        with _plain():
            hooks = self.stand_ins[gid][slot]._backward_hooks
        return list(hooks.values()) if hooks else []

    def name(self, gid: int, slot: int) -> str:
        """The parameter's name in the model (its first, where tied)."""
        return self._names[(gid, slot)]

    def frozen(self, gid: int, slot: int) -> bool:
        """Whether a parameter that trained at initialize has `requires_grad` False now:
        [Note: freezing after initialize]."""
        with _plain():
            return not self.stand_ins[gid][slot].requires_grad

    def check_frozen_agree(self, comm: Collectives, refused: bool = False,
                           dropped: bool = False) -> bool:
        """Raises on every rank where a parameter is frozen on some ranks and trains on
        others ([Note: freezing after initialize]): its update would average one rank's
        gradient with another's zeros, or, frozen whole, a group's reduction would
        wait for a rank that has none. `refused`: this rank refused the backward
        (`check_trainable`, `dropped_grads`); the others then raise too instead of
        waiting for it. `dropped`: the program dropped every `.grad` shown on this
        rank ([Note: a .grad the program dropped]); returns whether it did on every
        rank, and raises where only some did. One sum over ranks, before a backward."""
        if comm.world == 1:
            return dropped
        slots = [(g.gid, i) for g in self.groups if g.requires_grad for i in range(len(g.slots))]
        counts = comm.sum_scalars([1.0 if self.frozen(*s) else 0.0 for s in slots]
                                  + [1.0 if refused else 0.0, 1.0 if dropped else 0.0])
        dropping, others = int(counts.pop()), int(counts.pop())
        if others and not refused:
            raise RuntimeError(
                f"{others} other rank(s) refused this backward (their error names the "
                "parameter and the cause); this backward changed nothing")
        if refused:
            return False  # its own error says why
        split = [s for s, c in zip(slots, counts) if 0 < c < comm.world]
        if split:
            raise RuntimeError(
                f"parameter {self.name(*split[0])!r} is frozen (requires_grad False) on "
                f"{int(counts[slots.index(split[0])])} of {comm.world} ranks and trains on the "
                "others: set the same requires_grad on every rank before the forward (as DDP "
                "asks); this backward changed nothing")
        return all_dropped(dropping, comm.world, "; this backward changed nothing")

    def dropped_grads(self) -> tuple[bool, RuntimeError | None]:
        """[Note: a .grad the program dropped] Whether the program set every `.grad`
        shown since the last backward to None, and the error a backward or step
        raises where it dropped only some of them or set one to a tensor. Reads the
        `.grad`s `show_grads` showed: those set to None since (`model.zero_grad()`,
        `p.grad = None`), those set to another tensor, those as shown."""
        dropped, replaced, kept = [], [], 0
        with _plain():
            grads = [(p, g, p.grad) for p, g in self._shown]
        for p, g, now in grads:
            if now is g:
                kept += 1
            else:
                (dropped if now is None else replaced).append(self._names[self._where[id(p)]])
        if replaced:
            return False, RuntimeError(
                f"the .grad of parameter {replaced[0]!r} was set to a tensor after the "
                "backward: the engine keeps the gradients in its partitions and cannot use "
                "one the program made. Drop the step's gradients (model.zero_grad() or "
                "engine.zero_grad()) and run its micro-batches again; to clip, set "
                "optim.max_grad_norm")
        if dropped and kept:
            more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
            return False, RuntimeError(
                f"the .grad of parameter {dropped[0]!r}{more} was set to None after the "
                f"backward while {kept} other parameter(s) kept theirs: the engine cannot "
                "take one parameter's gradient out of its partitions, only drop the step's "
                "whole (model.zero_grad() or engine.zero_grad(); a step() that raises this "
                "has dropped them). To leave a parameter out of the updates, set its "
                "requires_grad to False before the forward, then run the step's "
                "micro-batches again")
        return bool(dropped), None

    def check_trainable(self, model: nn.Module) -> None:
        """Raises where what trains goes beyond `initialize`'s: a parameter frozen at
        initialize whose `requires_grad` was set (the engine holds no optimizer state
        for it, so no step would update it), or a trainable parameter added since (an
        adapter: the step would never update it). torch's optimizer follows neither
        change either, but a torch user sees no `.grad` or an unused optimizer; here
        nothing would show it. Freezing a parameter that trained at initialize works
        as in torch ([Note: freezing after initialize])."""
        with _plain():
            trains = [(name, p, p.requires_grad) for name, p in model.named_parameters()]
        for name, p, requires_grad in trains:
            where = self._where.get(id(p))
            if where is None:
                if requires_grad:
                    raise RuntimeError(
                        f"parameter {name!r} was added to the model after initialize: the "
                        "engine does not hold it and no step would update it; add it (or "
                        "the adapter) before offload.initialize, or set its requires_grad "
                        "to False")
            elif requires_grad and not self.groups[where[0]].requires_grad:
                raise RuntimeError(
                    f"parameter {name!r}: requires_grad was set to True after initialize, "
                    "where it was frozen, so the engine holds no optimizer state for it and "
                    "no step would update it; set it back. For progressive unfreezing, "
                    "initialize with every parameter that will train trainable, then freeze "
                    "what waits (requires_grad_(False)) and unfreeze it when its turn comes, "
                    "as in torch; or load engine.state_dict() into a fresh model with the "
                    "new requires_grad and initialize that (Adam's state starts afresh)")


def state_entries(module: nn.Module, prefix: str = ""
                  ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every entry torch's `state_dict` would hold,
    in its order: each module's parameters, then its persistent buffers, then its
    children; a module (or a parameter) registered under several names appears
    under each."""
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, p, True
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, b, False
    for name, child in module._modules.items():
        if child is not None:
            yield from state_entries(child, prefix + name + ".")
