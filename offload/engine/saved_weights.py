"""[Note: weights saved for a backward] A unit's weights are freed after its forward
(they read zeros, [Note: freed gathers read zeros] in warm.py) and gathered again by
a hook on each of its outputs that needs a gradient, before autograd reaches the
unit. A backward can reach the unit by another path: a tensor kept on the module
(an auxiliary loss stashed on `self`) that the loss adds, or an output in a form the
hooks' walk misses. Its ops then ran on the freed weights: the gradient of the
unit's input came out wrong (zero, or of the wrong sign), silently.

So while a unit's forward records a graph, every tensor autograd saves that views a
gathered group of the unit is packed with its group (`torch.autograd.graph`'s
saved-tensor hooks); when autograd unpacks it in a backward and the group is not
gathered, or its weights changed since, the unit's backward hook runs first, as its
output's would: it gathers the unit's groups (or refuses an older graph). Where
other saved-tensor hooks are on already (a non-reentrant activation checkpoint,
`save_on_cpu`, the user's own), the unit's hooks wrap them: each tensor is packed
by theirs, and unpacked by theirs after the unit's groups are made valid. They once
stood aside, on the grounds that such hooks keep the tensors: `save_on_cpu` on a
CPU device keeps the weight's view itself (`tensor.cpu()` is the tensor), and so
may the user's, and an auxiliary loss's backward read the freed weights as zeros
(3e-2 off torch after three steps, silently). torch.func's
transforms (grad, vjp, jacrev) refuse to run under any saved-tensor hooks: a unit whose
forward's code names one gets no hooks; one called from elsewhere fails the unit's
first forward, and its hooks stay off from then on."""

from __future__ import annotations

from types import CodeType
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .gathering import in_backward
from .units import not_compiled

if TYPE_CHECKING:
    from .units import Unit

__all__ = ["FUNCTORCH_REFUSED", "SavedScope", "calls_functorch", "close_all", "close_scope",
           "open_scope", "refused_by_functorch"]

_top = torch._C._autograd._top_saved_tensors_default_hooks


class _Saved:
    """A tensor saved in a unit's forward: a detached alias (the saved tensor's own
    Python object is not held: an op that saves its output, `tanh`, would make a
    cycle through it that the collector cannot break, and a graph never run
    backward kept its activations for good) with its version at the save, checked
    at the unpack as torch checks it without hooks; `gid`: the group whose gathered
    weights it views (None: another tensor), `unit` and `versions` its forward's."""

    __slots__ = ("tensor", "version", "gid", "unit", "versions")

    def __init__(self, tensor: torch.Tensor, gid: int | None = None, unit: Any = None,
                 versions: tuple[int, ...] = ()) -> None:
        self.tensor, self.version = tensor.detach(), tensor._version
        self.gid, self.unit, self.versions = gid, unit, versions


class _Wrapped:
    """A tensor packed by other hooks under a unit's (`SavedScope.outer`): what theirs
    gave, and the group it views."""

    __slots__ = ("inner", "gid", "unit", "versions")

    def __init__(self, inner: Any, gid: int, unit: Any, versions: tuple[int, ...]) -> None:
        self.inner, self.gid, self.unit, self.versions = inner, gid, unit, versions


class SavedScope:
    """The saved-tensor hooks of one unit's forward: `storages` maps the data pointer
    of each gathered group's storage (this unit's and the enclosing units') to the
    group and its unit; `use(saved)` makes a saved view's weights valid; `outer`: the
    hooks of another kind these wrap (pack, unpack), or None."""

    __slots__ = ("unit", "storages", "use", "outer")

    def __init__(self, unit: "Unit", storages: dict[int, tuple[int, Any, tuple[int, ...]]],
                 use: Callable[[Any], None], outer: tuple[Callable, Callable] | None) -> None:
        self.unit, self.storages, self.use, self.outer = unit, storages, use, outer

    @not_compiled  # [Note: torch.compile] in units.py
    def pack(self, t: torch.Tensor) -> Any:
        try:  # a weight's view is not counted as kept ([Note: kept weights] in warm.py)
            found = self.storages.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own
            return t if self.outer is None else self.outer[0](t)
        if self.outer is not None:
            inner = self.outer[0](t)
            return inner if found is None else _Wrapped(inner, *found)
        return _Saved(t) if found is None else _Saved(t, *found)

    @not_compiled  # [Note: torch.compile] in units.py
    def unpack(self, packed: Any) -> torch.Tensor:
        if self.outer is not None:
            if type(packed) is _Wrapped:
                if in_backward():
                    self.use(packed)
                packed = packed.inner
            return self.outer[1](packed)
        if type(packed) is not _Saved:
            return packed
        t = packed.tensor
        if t._version != packed.version:  # torch's own check, which hooks turn off
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified "
                f"by an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                f"{t._version}; expected version {packed.version} instead (saved in the "
                f"forward of unit {getattr(self.unit, 'name', '') or '<root>'!r})")
        if packed.gid is not None and in_backward():  # not a look at grad_fn._saved_*
            self.use(packed)
        return t


def open_scope(scopes: list[SavedScope], unit: "Unit",
               own: dict[int, tuple[int, Any, tuple[int, ...]]],
               use: Callable[[_Saved], None]) -> None:
    """Pushes the hooks of `unit`'s forward (`own`: its gathered groups) onto autograd's
    stack and `scopes`, unless hooks of another kind are on top or hooks are off."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return
    top = _top(False)
    below = getattr(top[0], "__self__", None) if top is not None else None
    # the hooks of another kind this scope wraps: those on top, or those the enclosing
    # unit's scope on top wraps (a unit inside a checkpointed unit saves through the
    # checkpoint too, or its recomputation's saves pair with the wrong tensors)
    wrapped = below.outer if isinstance(below, SavedScope) else top
    outer = scopes[-1] if scopes else None
    scope = SavedScope(unit, own if outer is None else {**outer.storages, **own}, use,
                       wrapped)
    torch._C._autograd._push_saved_tensors_default_hooks(scope.pack, scope.unpack)
    scopes.append(scope)


def close_scope(scopes: list[SavedScope], unit: "Unit") -> bool:
    """Pops `unit`'s hooks, where its forward pushed them (returned) and they are on
    top."""
    if not scopes or scopes[-1].unit is not unit:
        return False
    _pop(scopes.pop())
    return True


# torch.func's grad, vjp, jacrev and hessian raise this where saved-tensor hooks are on
_FUNCTORCH = "don't yet support saved tensor hooks"

FUNCTORCH_REFUSED = (
    "torch.func's grad, vjp, jacrev or hessian ran inside a unit's forward, which torch "
    "refuses while saved-tensor hooks are on, and the engine's were: they gather a "
    "unit's weights for a backward that reaches them by a path other than the unit's "
    "outputs ([Note: weights saved for a backward] in offload/engine/saved_weights.py). "
    "They are off for that unit from now on (such a path then reads its freed weights "
    "as zeros: return from the unit what the loss uses). The forward was undone: run "
    "it again")


# what a forward's code names where it runs a torch.func transform
_TRANSFORMS = frozenset({"func", "functorch", "vmap", "grad_and_value", "vjp", "jvp",
                         "jacrev", "jacfwd", "hessian"})


def calls_functorch(module: nn.Module) -> bool:
    """Whether the forward of `module` or of a module under it names a torch.func
    transform (`torch.func.grad`, `vmap`, ...; its nested functions' code too): its unit's
    hooks stay off from the first forward. One called from elsewhere fails the first
    forward instead (`refused_by_functorch`)."""
    seen: set[CodeType] = set()
    for m in module.modules():
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if code is not None and code not in seen:
            seen.add(code)
            if _names(code) & _TRANSFORMS:
                return True
    return False


def _names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def refused_by_functorch(e: BaseException | None) -> bool:
    """Whether `e` is torch.func's refusal of saved-tensor hooks."""
    return isinstance(e, RuntimeError) and _FUNCTORCH in str(e)


def close_all(scopes: list[SavedScope]) -> None:
    """Pops every scope a forward left: torch skips the forward hooks that pop them
    when a unit's forward raises a KeyboardInterrupt or SystemExit, and the hooks
    would stay on for the program's own autograd code."""
    while scopes:
        _pop(scopes.pop())


def _pop(scope: SavedScope) -> None:
    top = _top(False)
    if top is not None and top[0] == scope.pack:
        torch._C._autograd._pop_saved_tensors_default_hooks()
