"""Partitioning a model into units and groups.

A **unit** is the module whose hooks gather a group: a module whose subtree
holds at most `group_size` parameters is one unit with all of them; a bigger
module recurses into its children and keeps only its own direct parameters
(size-based wrapping, as FSDP's auto-wrap policy). Each unit's trainable and
frozen parameters form one **group** each: a flat buffer padded so every
rank's partition is a multiple of `SHARD_ALIGN` elements (4 KiB of bf16).

A parameter shared by several modules (tied weights) belongs to the first
group that meets it; every unit whose modules use it lists that group in its
`needs`, so it is gathered wherever it is used.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cached_property
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["Slot", "Group", "Unit", "build_units", "eager", "EngineHook", "hooks_last",
           "output_tensors", "static_order", "SHARD_ALIGN", "NOT_PICKLABLE", "copy_weight_views",
           "WRAPPED", "mark_wrapped"]

SHARD_ALIGN = 2048  # elements: 4 KiB of a 2-byte dtype, 8 KiB of fp32


@dataclass
class Slot:
    """One original parameter inside a group's flat buffer."""

    fqn: str
    shape: torch.Size
    offset: int  # elements into the flat buffer
    param: nn.Parameter | None  # the original, until it is materialised and dropped
    uses: list[tuple[nn.Module, str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # fqn of every use (tied weights)

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Group:
    gid: int
    slots: list[Slot]
    numel: int          # elements before padding
    shard: int          # elements per rank
    world: int
    requires_grad: bool
    base: int = 0       # elements of the groups before it: its place in the model's weights

    def origin(self, rank: int) -> int:
        """The model-wide index of `rank`'s partition's first element, the same on any
        number of ranks (bf16 moments' rounding: [Note: stochastic rounding] in
        offload/optim/codec.py)."""
        return self.base + rank * self.shard

    @property
    def padded(self) -> int:
        return self.shard * self.world

    @cached_property
    def split_sizes(self) -> list[int]:
        """Elements of each slot in order, then the padding (if any): the flat buffer
        split into them gives every parameter's view (one SplitBackward node)."""
        sizes = [s.numel for s in self.slots]
        return sizes + [self.padded - self.numel] if self.padded > self.numel else sizes


@dataclass
class Unit:
    module: nn.Module
    name: str
    needs: list[int]  # gids gathered before this unit runs


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _subtree_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# [Note: containers are not units] Their forward is never called (a ModuleList's
# modules are called one by one, a ParameterList's parameters read by the parent), so
# hooks on them would never gather; as FSDP's size-based auto-wrap excludes them.
_MODULE_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


# [Note: modules that read their children's weights] nn.MultiheadAttention's forward
# passes `self.out_proj.weight` to F.multi_head_attention_forward without calling
# `out_proj`, so `out_proj` as a unit of its own was never gathered when the attention
# ran ("parameter 'out_proj.weight' is used outside the forward of unit ..."): such a
# module is one unit whatever its size, as if listed in `engine.whole_modules`.
_READS_CHILDREN = (nn.MultiheadAttention,)


def _own_scope(module: nn.Module) -> list[nn.Module]:
    """The modules whose direct parameters a unit that is not whole holds: its own and
    those of its parameter containers."""
    return [module] + [c for c in module.children() if isinstance(c, _PARAM_CONTAINERS)]


def _called_inside(model: nn.Module) -> frozenset[int]:
    """[Note: modules called from outside their parent] The modules that hold, strictly
    inside them, one a library calls by itself: transformers' encoder-decoder
    `generate` runs `model.get_encoder()(...)` before any forward of the model, so a
    T5 or BART small enough to be one unit (`<root>`) was never gathered for it
    ("parameter 'shared.weight' is used outside the forward of unit '<root>'").
    Such an ancestor is split into units however small, so the encoder has its own."""
    getter = getattr(model, "get_encoder", None)
    if not callable(getter) or not getattr(getattr(model, "config", None),
                                           "is_encoder_decoder", False):
        return frozenset()
    try:
        encoder = getter()
    except Exception:  # noqa: BLE001 - a model whose getter fails has no such call
        return frozenset()
    path = next((n for n, m in model.named_modules() if m is encoder and n), None)
    if path is None:
        return frozenset()
    parts = path.split(".")
    return frozenset(id(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))


def _choose(module: nn.Module, name: str, group_size: int,
            out: list[tuple[nn.Module, str, bool]], whole: frozenset[int],
            split: frozenset[int] = frozenset()) -> None:
    if id(module) in whole or isinstance(module, _READS_CHILDREN) or (
            _subtree_params(module) <= group_size and id(module) not in split
            and not isinstance(module, _MODULE_CONTAINERS)):
        if any(True for _ in module.parameters()):
            out.append((module, name, True))
        return
    if any(p is not None for m in _own_scope(module) for p in m._parameters.values()):
        out.append((module, name, False))
    for child_name, child in module.named_children():
        if not isinstance(child, _PARAM_CONTAINERS):
            _choose(child, f"{name}.{child_name}" if name else child_name, group_size, out,
                    whole, split)


def build_units(model: nn.Module, group_size: int, world: int,
                whole: list[nn.Module] = ()) -> tuple[list[Unit], list[Group]]:
    """Splits `model` into units and their groups; changes nothing in the model. Each
    module of `whole` is one unit (or inside one), whatever its size."""
    chosen: list[tuple[nn.Module, str, bool]] = []
    _choose(model, "", group_size, chosen, frozenset(id(m) for m in whole),
            _called_inside(model))
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    # every (module, attribute) that holds each parameter, for tied weights
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                uses.setdefault(id(p), []).append((mod, pname))
    owner: dict[int, int] = {}  # id(param) -> gid
    groups: list[Group] = []
    units: list[Unit] = []
    for module, name, whole in chosen:
        scope = list(module.modules()) if whole else _own_scope(module)
        fresh: dict[bool, list[Slot]] = {True: [], False: []}
        for mod in scope:
            for pname, p in mod._parameters.items():
                if p is None or id(p) in owner or any(id(p) == id(s.param)
                                                      for lst in fresh.values() for s in lst):
                    continue
                fqn = f"{names.get(id(mod), '')}.{pname}".lstrip(".")
                aliases = [f"{names.get(id(m), '')}.{n}".lstrip(".") for m, n in uses[id(p)]]
                fresh[p.requires_grad].append(Slot(fqn, p.shape, 0, p, uses[id(p)], aliases))
        for trainable in (True, False):
            slots = fresh[trainable]
            if not slots:
                continue
            off = 0
            for s in slots:
                s.offset = off
                off += s.numel
            shard = _round_up(max(1, -(-off // world)), SHARD_ALIGN)
            g = Group(len(groups), slots, off, shard, world, trainable,
                      base=sum(h.numel for h in groups))
            groups.append(g)
            for s in slots:
                owner[id(s.param)] = g.gid
        needs = sorted({owner[id(p)] for mod in scope for p in mod._parameters.values()
                        if p is not None})
        units.append(Unit(module, name or "<root>", needs))
    return units, groups


def static_order(units: list[Unit]) -> list[int]:
    """The groups a training step is expected to use, in order, before one has been
    recorded: the units' forward in module order (`build_units` lists a module
    before the modules inside it, in registration order), then their backward in
    the reverse order of their forwards' ends (a unit's forward ends after those of
    the units inside it). A guess the first step checks as it goes: a model that
    runs its modules in another order breaks it at the first difference, and that
    step fetches on demand from there ([Note: the access trace] in
    offload/planner/access.py)."""
    ends: list[Unit] = []
    open_: list[Unit] = []  # the units whose forward has begun and not ended
    for u in units:
        while open_ and not any(m is u.module for m in open_[-1].module.modules()):
            ends.append(open_.pop())
        open_.append(u)
    ends += reversed(open_)
    return ([g for u in units for g in u.needs]
            + [g for u in reversed(ends) for g in u.needs])


def output_tensors(obj: Any, _seen: set[int] | None = None) -> Iterable[torch.Tensor]:
    """The tensors in a module's output: nested in dicts, lists, tuples, transformers'
    `ModelOutput`, dataclasses and the attributes of other plain objects (a tensor
    missed here would let a backward through the unit run on freed weights)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    seen = set() if _seen is None else _seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, (dict, Mapping)):
        values: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        values = obj
    elif hasattr(obj, "to_tuple"):  # transformers' ModelOutput
        values = obj.to_tuple()
    elif is_dataclass(obj):
        values = [getattr(obj, f.name) for f in fields(obj)]
    else:
        values = [v for _, v in _attributes(obj)]
    for v in values:
        yield from output_tensors(v, seen)


def copy_weight_views(obj: Any, storages: set[int]) -> Any:
    """[Note: outputs that view the weights] A unit may return a view of its own gathered
    weights (a learned position table's `self.weight[:n]`, a class token's
    `self.tok.expand(b, -1, -1)`); the unit's post-hook then frees that storage, and the
    view would read zeros or reused memory downstream, silently. Each such output
    (`storages`: data pointers of the unit's gathered flat buffers) becomes a clone,
    which autograd differentiates as the view; other outputs are left as they are.
    Tuples are rebuilt; lists, dicts (`ModelOutput`), dataclasses and other objects
    are changed in place."""
    if not any(_views(t, storages) for t in output_tensors(obj)):
        return obj
    return _copy_views(obj, storages, set())


def _views(t: torch.Tensor, storages: set[int]) -> bool:
    return t.layout == torch.strided and t.untyped_storage().data_ptr() in storages


def _copy_views(obj: Any, storages: set[int], seen: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone() if _views(obj, storages) else obj
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module)):
        return obj
    seen.add(id(obj))
    if isinstance(obj, tuple):
        items = [_copy_views(v, storages, seen) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, (list, deque)):
        items = [_copy_views(v, storages, seen) for v in obj]
        obj.clear()
        obj.extend(items)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            obj[k] = _copy_views(v, storages, seen)
    elif is_dataclass(obj):
        for f in fields(obj):
            object.__setattr__(obj, f.name, _copy_views(getattr(obj, f.name), storages, seen))
    else:
        for k, v in _attributes(obj):
            setattr(obj, k, _copy_views(v, storages, seen))
    return obj


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """A plain object's attributes: its `__dict__`'s and its classes' `__slots__`
    (attrs' classes, `dataclass(slots=True)` subclasses) that are set."""
    found = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found.append((name, getattr(obj, name)))
    return found


def hooks_last(module: nn.Module, hook_ids: list[int]) -> None:
    """[Note: our forward hooks run last] A unit's forward hook gives its weights back,
    so a forward hook the user registers on the unit's module after `initialize` (torch
    runs them in registration order) would find them gone. Each call, the unit's forward
    pre-hook moves the engine's forward hooks of `module` to the end of its hook order:
    torch reads that order only after the forward returns. A hook registered with
    `prepend=True` still runs before them. The unit's pre-hook is registered with
    `prepend=True`: a pre-hook of the user's that computes a weight from the unit's
    parameters (`nn.utils.weight_norm`, `spectral_norm`, `prune`) runs after the gather."""
    hooks = module._forward_hooks
    for hid in hook_ids:
        if hid in hooks:
            hooks.move_to_end(hid)


_NOT_COMPILED: set[Any] = set()  # code objects dynamo skips, once it is imported


def not_compiled(fn: Callable) -> Callable:
    """[Note: torch.compile] `fn`'s own frame is left to run as it is: dynamo compiled
    each engine function the engine's forward called (an empty graph, broken at
    `os.getpid`, with its warning), and each hook's wrapper once per hook, up to its
    recompile limit (8, with a warning at the limit)."""
    _NOT_COMPILED.add(fn.__code__)
    return fn


def _skip_not_compiled() -> None:
    skip = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    for code in _NOT_COMPILED if skip is not None else ():
        skip(code)


def eager(fn: Callable, recursive: bool = True) -> Callable:
    """[Note: torch.compile] A unit's hooks gather, bind, free and move records: work
    on the store that torch.compile cannot trace (it failed inside them, deep in
    dynamo). Each hook, and the engine's own `forward` frame (`recursive=False`: what
    it calls still compiles), is left out of compilation, so `torch.compile(engine)`,
    a model compiled before `initialize` (its names then start with `_orig_mod.`, as
    torch's own) and compiled blocks all run: the graphs break at the units' hooks,
    which run eagerly. `torch.compiler.disable` imports the compiler (seconds, and
    what a process that never compiles should not load): it is applied at the first
    call after something else imported it."""
    disabled = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        _skip_not_compiled()  # at each call: torch._dynamo.reset() forgets it
        if disabled is None:
            disabled = torch.compiler.disable(fn, recursive=recursive)
        return disabled(*args, **kwargs)
    not_compiled(call)
    return call


NOT_PICKLABLE = (
    "a model given to offload.initialize (or its engine) cannot be pickled, so torch.save(model) "
    "and sending it to another process do not work: its weights live in the engine's "
    "partitions, not in the model. Save the weights with engine.save_pretrained(dir) or "
    "torch.save(engine.state_dict(), path) (full weights, on rank 0), or the training state "
    "with engine.save_checkpoint(dir)")


def weak_hook(owner: Any, method: Callable, *args: Any) -> Callable:
    """`method(owner, *args, *hook_args)` as a hook on a tensor that holds `owner` weakly.

    [Note: hooks on tensors hold the engine weakly] A hook registered on a tensor
    that lives as long as the engine (a group's flat parameter) closes a cycle,
    engine -> tensor -> hook -> engine, that Python's collector cannot see through:
    torch does not traverse a tensor's hooks while C++ also holds the tensor. An
    engine dropped without `close()` was then never collected, and its finalizer
    (which gives back the threads, the buffers and the swap files) never ran. Once
    the engine is gone the hook does nothing."""
    ref = weakref.ref(owner)

    def hook(*hook_args: Any) -> Any:
        obj = ref()
        return None if obj is None else method(obj, *args, *hook_args)
    return hook


class EngineHook:
    """A hook the engine registers on the user's modules, left out of compilation
    (`eager`). Pickling one (torch.save(model), multiprocessing) raises `TypeError`
    with the way to save ([Note: registered parameters] in params_view.py): a plain
    closure would fail with pickle's "Can't pickle local object", which names
    nothing the user wrote. `copy.deepcopy` gives a hook that does nothing: a copy
    made inside `engine.full_weights()` (an EMA or teacher copy, which holds the
    weights) is a plain model, not one whose hooks call into this engine about modules
    it does not own. Outside that block the model's stand-in parameters refuse a copy
    with their own error."""

    __slots__ = ("_call",)

    def __init__(self, fn: Callable) -> None:
        self._call = eager(fn)

    @not_compiled
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(NOT_PICKLABLE)

    def __deepcopy__(self, memo: dict) -> Callable:
        return _inert  # a plain function: the copy pickles


def _inert(*args: Any, **kwargs: Any) -> None:
    return None


class EngineMark:
    """A value the engine sets in a module's `__dict__` (a cast guard in place of
    `_apply`, the wrapped mark, transformers' FSDP mark): it calls, and is true, as
    `value`. `copy.deepcopy` of the module gives its copy its class's own `method`
    in its place (None where `method` is None): a copy made inside
    `engine.full_weights()` is a plain model, which `.to(dtype)` converts and
    `initialize` takes, not one whose guards act on this model's stand-ins."""

    __slots__ = ("_value", "_module", "_method")

    def __init__(self, value: Any, module: nn.Module, method: str | None = None) -> None:
        self._value, self._module, self._method = value, weakref.ref(module), method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._value(*args, **kwargs)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __deepcopy__(self, memo: dict) -> Any:
        twin = memo.get(id(self._module()))
        return None if self._method is None or twin is None else PlainMethod(twin,
                                                                             self._method)

# [Note: wrapped modules]
# `initialize` takes a model's parameters into the engine's partitions: each module
# it took parameters from (and the model itself) is marked under this key in its
# `__dict__` (as torch's composable APIs mark the modules they were applied to), so
# a second `initialize` on the model, on a part of it, or on the engine itself is
# refused instead of wrapping an empty shell. The mark outlives `close()`: the
# model's weights went into the engine and leave with its closing (its methods
# raise then), so save them first (`state_dict()`, `save_pretrained()`). The mark
# is a weak reference to the engine, so the refusal can say whether that engine
# is still there to train with.
WRAPPED = "_offload_wrapped"


def mark_wrapped(module: nn.Module, engine: Any) -> None:
    """Marks `module` as one whose parameters `engine` took ([Note: wrapped modules])."""
    module.__dict__[WRAPPED] = EngineMark(weakref.ref(engine), module)


class PlainMethod:
    """Method `name` of the class of `owner`, called on it, holding it weakly: a copy's
    attribute that a bound method would make a cycle of (the copy kept alive until
    the collector runs, its weights with it)."""

    __slots__ = ("_owner", "_name")

    def __init__(self, owner: nn.Module, name: str) -> None:
        self._owner, self._name = weakref.ref(owner), name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        return getattr(type(owner), self._name)(owner, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "PlainMethod":
        owner = self._owner()
        return PlainMethod(memo.get(id(owner), owner), self._name)

    def __reduce__(self) -> tuple:
        return PlainMethod, (self._owner(), self._name)
