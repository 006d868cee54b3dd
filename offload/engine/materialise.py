"""Meta parameters made at `initialize`: each group's by its modules' own initialisers
(`_materialise`), seeded per group, with every other tensor the initialisers could
write held apart as scratch ([Note: initialisers write scratch])."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from .absent import AbsentWeight
from .checkpoint import SafetensorsCheckpoint
from .meta import SkipMetaNormal
from .params_view import point_weight_list
from .units import Group

__all__ = ["Lineage", "has_own_init", "scratch_for_others"]

Rule = Callable[[nn.Module], None]


def has_own_init(model: nn.Module) -> bool:
    """A model with its own `_init_weights(module)` (a transformers model, or one's own
    that has one): how it initialises its modules."""
    return callable(getattr(model, "_init_weights", None))


def _is_pretrained(m: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (transformers is not imported for the check)."""
    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(m, mu.PreTrainedModel)


class Lineage:
    """Each module's parent, its place in `model.apply` order (children first), and
    the `_init_weights` that initialises it (`rule`).

    [Note: whose _init_weights] As transformers' `initialize_weights` (its
    `smart_apply`) hands a model's modules to `_init_weights`: each module to the
    nearest transformers model at or above it, so the vision tower of a Llava, the
    encoder of a VisionEncoderDecoderModel, a Llama inside a model of one's own, is
    initialised by its own `_init_weights` and config, not the outer model's. A root
    that is not a transformers model but has `_init_weights` (a model of one's own)
    covers the modules no transformers model is above; without one they have none."""

    def __init__(self, model: nn.Module) -> None:
        self.parent: dict[int, nn.Module] = {}
        self.order: dict[int, int] = {}
        self.rule: dict[int, Rule | None] = {}

        def visit(m: nn.Module, rule: Rule | None) -> None:
            rule = m._init_weights if _is_pretrained(m) else rule
            self.rule.setdefault(id(m), rule)
            for child in m.children():
                if id(child) not in self.order:
                    self.parent.setdefault(id(child), m)
                    visit(child, rule)
            self.order.setdefault(id(m), len(self.order))
        visit(model, model._init_weights if has_own_init(model) else None)

    def with_ancestors(self, mods: list[nn.Module]) -> list[nn.Module]:
        """`mods` and every module above them, in `apply` order (children first)."""
        out: dict[int, nn.Module] = {}
        for m in mods:
            while m is not None and id(m) not in out:
                out[id(m)] = m
                m = self.parent.get(id(m))
        return sorted(out.values(), key=lambda m: self.order.get(id(m), -1))


@contextlib.contextmanager
def scratch_for_others(mods: list[nn.Module]) -> Iterator[None]:
    """[Note: initialisers write scratch]
    While initialisers run over `mods` (a group's modules and those above them), every
    tensor they can reach that they are not there to make is scratch: parameters
    already handed to the engine (stand-ins: a module whose parameters are in two
    groups, trainable and frozen, is initialised twice), real parameters and real
    buffers. Those are the user's, which the engine only reads (docs/engine.md): a
    rule run for another group wrote them before (T5's root rule writes its real
    `shared` embedding, a root's `reset_parameters` its real `scale`), the user's
    tensor changed, and a failed `initialize` put back the changed tensor. Scratch of
    a module in `mods` is a copy (a rule may read it: a target copied from its online
    weights; a stand-in's holds NaN, so a value copied from it is refused), of a
    module only below them meta (no memory; writes do nothing); a tensor several
    modules share has one scratch. On exit each is put back untouched and what the
    rules wrote there is discarded. Meta tensors stay in place: the ones being made
    are the rules' to write."""
    inside, seen = {id(m) for m in mods}, set()
    found: list[tuple[dict, str, torch.Tensor, nn.Module]] = []
    for top in mods:  # a rule may write below its module too (T5's root: self.shared)
        for m in top.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for table in (m._parameters, m._buffers):
                for name, v in table.items():
                    if v is not None and (isinstance(v, AbsentWeight) or not v.is_meta):
                        found.append((table, name, v, m))
    copied = {id(v) for _, _, v, m in found if id(m) in inside}
    scratch: dict[int, torch.Tensor] = {}
    for table, name, v, _ in found:  # every copy made before the first is put in place
        if id(v) not in scratch:
            device = "cpu" if id(v) in copied else "meta"
            if isinstance(v, AbsentWeight):  # NaN: a rule that copies it is caught
                t = torch.full(v.shape, float("nan"), dtype=torch.float32, device=device)
            elif device == "cpu":
                t = v.detach().clone()
            else:
                t = torch.empty_like(v, device="meta")
            scratch[id(v)] = (nn.Parameter(t, requires_grad=v.requires_grad)
                              if isinstance(v, nn.Parameter) else t)
    try:
        for table, name, v, _ in found:
            table[name] = scratch[id(v)]
        yield
    finally:
        for table, name, v, m in found:
            table[name] = v
            point_weight_list(m, name)


def _materialise(model: nn.Module, g: Group, seed: int,
                 ckpt: SafetensorsCheckpoint | None, lineage: Lineage) -> torch.Tensor:
    """The group's full fp32 flat buffer (padded), initialising meta parameters.

    [Note: meta initialisation] Each module's `reset_parameters` (or
    `_reset_parameters`, nn.MultiheadAttention's) runs on the group's modules and
    every module above them, children first, as they run when the model is built
    on the CPU: a parent's rule for its children (a zeroed residual projection,
    the weights of its nn.ParameterList) overrides theirs. Modules under a
    transformers model are then initialised by its `_init_weights` ([Note: whose
    _init_weights]), called on the same modules in the same order, as its
    `initialize_weights` would: a parent's rule (GPT-2's scaled residual
    projections) overrides its children's. Parameters of other groups are still
    meta there (untouched: `normal_` skipped, [Note: normal_ on meta tensors] in
    meta.py), and real or handed-over ones are scratch ([Note: initialisers write
    scratch]). A meta parameter the rules leave unset (NaN) is refused, naming it."""
    full = torch.zeros(g.padded, dtype=torch.float32)
    fresh = list(g.slots)  # the slots the model initialises: [Note: weights a checkpoint lacks]
    if ckpt is not None:
        fresh = []
        for s in g.slots:
            t = ckpt.find(s.names)
            if t is None:
                fresh.append(s)
                continue
            if tuple(t.shape) != tuple(s.shape):
                raise ValueError(f"checkpoint tensor for {s.fqn} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(s.shape)}")
            full[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        if not fresh:
            return full
    meta = [s for s in fresh if s.param.is_meta]  # a real (CPU) weight keeps its values
    if meta:
        owners: list[nn.Module] = []
        for s in meta:
            mod = s.uses[0][0]
            if not any(mod is o for o in owners):
                owners.append(mod)
        _run_rules(owners, lineage, seed * 1_000_003 + g.gid)
    for s in fresh:
        mod, name = s.uses[0]
        p = mod._parameters[name]
        if tuple(p.shape) != tuple(s.shape):
            raise ValueError(f"parameter {s.fqn} changed shape from {tuple(s.shape)} to "
                             f"{tuple(p.shape)} during initialisation")
        if s.param.is_meta and torch.isnan(p.detach()).any():  # [Note: meta initialisation]
            raise ValueError(_unset_message(s.fqn, mod, lineage))
        full[s.offset:s.offset + s.numel].copy_(p.detach().reshape(-1))
    return full


def _run_rules(owners: list[nn.Module], lineage: Lineage, seed: int) -> None:
    """[Note: meta initialisation] The owners' meta parameters made on the CPU and set by
    the initialisers of the owners and the modules above them, children first."""
    mods = lineage.with_ancestors(owners)  # children first: [Note: meta initialisation]
    with torch.random.fork_rng(devices=[]), scratch_for_others(mods), SkipMetaNormal():
        torch.manual_seed(seed)
        for mod in owners:
            _unset_on_cpu(mod)
        for mod in mods:
            init = getattr(mod, "reset_parameters", None) or \
                getattr(mod, "_reset_parameters", None)  # nn.MultiheadAttention's
            if callable(init):
                init()
        with torch.no_grad():
            for mod in mods:
                rule = lineage.rule.get(id(mod))  # [Note: whose _init_weights]
                if rule is not None:
                    rule(mod)


def _unset_message(fqn: str, mod: nn.Module, lineage: Lineage) -> str:
    """Why meta parameter `fqn` of `mod` has no values, and what to do."""
    if isinstance(mod, parametrize.ParametrizationList):
        return (f"parameter {fqn} was built on meta and cannot be made there: it is what "
                "a parametrization (torch.nn.utils.parametrizations.weight_norm, ...) "
                "stores, and reset_parameters() and _init_weights write the weight it "
                "computes, never its original tensors; build the parametrized module on "
                "the CPU (with torch.device('cpu'): ...)")
    hf = " nor an _init_weights" if lineage.rule.get(id(mod)) is not None else ""
    return (f"parameter {fqn} was built on meta and nothing initialised it (neither a "
            f"reset_parameters() of {type(mod).__name__} or of the modules above it{hf} "
            "sets it, or one copies it from a weight of another group, made before and no "
            "longer there), so it has no values: build that module on the CPU (with "
            "torch.device('cpu'): ...), or give it or its parent a reset_parameters()")


def _unset_on_cpu(mod: nn.Module) -> None:
    """[Note: meta initialisation] The module's meta parameters become CPU tensors of NaN
    for its initialiser to fill (one it leaves is then refused, never trained as
    whatever memory held); its buffers and other parameters stay as they are."""
    for n, p in list(mod._parameters.items()):
        if p is not None and p.is_meta:
            # made here, not by `to_empty`: its `_apply` gives a real parameter of the
            # module new storage in place (`param.data = ...`), losing the values held
            mod._parameters[n] = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype),
                                              requires_grad=p.requires_grad)
            point_weight_list(mod, n)  # torch's RNN modules keep a list of their weights
