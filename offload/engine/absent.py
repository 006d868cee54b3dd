"""`AbsentWeight`: what a module's attribute holds while its parameter's group is not
gathered.

[Note: absent weights]
Outside its unit's forward (and backward) a parameter's bytes are not in
memory: the module attribute would otherwise hold a view of freed storage
("setStorage ... out of bounds") or an empty tensor ("'weight' must be
2-D"). It holds an `AbsentWeight` instead: a tensor without storage that has
the parameter's shape, dtype and device (so metadata reads work, as on a
meta tensor) and raises, on any computation, an error that names the
parameter, the unit that gathers it and what to do. It is a tensor subclass
of our own; nothing of torch is patched and nothing is added to
`nn.Parameter`.

The same stand-in is what the module registers as its parameter
(`module._parameters[name]`, [Note: registered parameters] in
params_view.py): `nn.Parameter(AbsentWeight(...))` is torch's own way of
making a tensor subclass a parameter, and `detach()` (which torch calls
there and in `state_dict`) gives another stand-in with the same message.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["AbsentRead", "AbsentWeight", "WeightHome", "absent_grad_message", "absent_message",
           "closed_message", "torch_optimizer_message"]


def absent_message(name: str, unit: str, parent: tuple[str, str] | None = None) -> str:
    """`parent`: (name, class name) of the unit's parent module, where it has one."""
    which = (f" (likely {parent[0]!r}, or its class {parent[1]!r} for every module like "
             "it)" if parent is not None and parent[0] else "")
    return (f"parameter {name!r} is used outside the forward of unit {unit!r}, the module "
            "whose hooks gather it: its weights exist only while that unit's forward or "
            "backward runs. To read or change them, use `with engine.full_weights(): ...` "
            "(or engine.state_dict(); to load a state dict, engine.load_state_dict(sd); "
            "to save the model, engine.save_pretrained(dir)). "
            "Call that unit (or the whole engine), not a module inside it; a "
            "parent that reads a child unit's weight in its own forward (e.g. a tied head as "
            "F.linear(h, self.wte.weight)) needs both in one unit: list the parent's name in "
            f"engine.whole_modules{which} (for the model itself, raise engine.group_size "
            "above its parameter count), "
            "or share the parameter by assignment (self.head.weight = self.wte.weight) and "
            "call the child module")


# where autograd runs a node that reads an absent weight: its unit's backward hook did not run
IN_BACKWARD = (
    "a backward read a weight of a unit whose weights were not gathered for it: it reached "
    "the unit by a path other than the unit's outputs (a tensor kept on the module, as an "
    "auxiliary loss), through an activation checkpoint's recomputation inside the unit or a "
    "function's backward that reads the module's weight itself; return from the unit what "
    "the loss uses (its output's hook gathers the weights), or put the checkpoint around the "
    "unit instead. ")


def closed_message(name: str) -> str:
    return (f"parameter {name!r} belonged to an OffloadEngine that is closed (close() ran, "
            "or its `with` block ended): its weights went with the engine's partitions and "
            "swap files, and this model holds none. Build a fresh model and load what was "
            "saved before closing (engine.save_pretrained(dir) or engine.state_dict()), or "
            "resume a new engine from a checkpoint (offload.initialize(fresh_model, config, "
            "resume=path))")


def absent_grad_message(name: str) -> str:
    return (f"the gradient of parameter {name!r} is not in its .grad: the engine reduces "
            "gradients into its partitions (summed over ranks and micro-batches), where "
            "engine.step() reads them. To clip them as torch.nn.utils.clip_grad_norm_ does, "
            "set optim.max_grad_norm in the config (the global 2-norm over every rank; "
            "engine.grad_norm is its value before clipping after each step); clipping "
            "each value (torch.nn.utils.clip_grad_value_) has no equivalent, use the norm; "
            "engine.zero_grad() drops them ([Note: absent gradients] in "
            "offload/engine/params_view.py)")


def torch_optimizer_message(name: str) -> str:
    """Why a torch optimizer over the model's parameters raises at parameter `name`, at
    its step() (Adagrad's at its construction): [Note: a torch optimizer over the
    stand-ins]."""
    return ("a torch optimizer over the model's parameters cannot update them: "
            f"{absent_grad_message(name)}. To update the weights call engine.step(), not a "
            "torch optimizer over model.parameters(): the engine's optimizer is "
            "engine.optimizer (its param_groups hold lr, betas, eps and weight_decay, which "
            "the config's optim section sets); no weight was changed")


def _from_torch_optimizer() -> bool:
    """[Note: a torch optimizer over the stand-ins]
    Adam's and AdamW's step touch the parameter before its gradient (the moments'
    zeros_like(p), the decoupled weight decay p.mul_(1 - lr * wd)), so the weight's
    message, which points to full_weights, came first and named neither engine.step()
    nor optim.max_grad_norm; Adagrad's constructor fills its state with full_like(p).
    A computation on a stand-in made by a method of a `torch.optim.Optimizer` (a
    frame whose `self` is one: torch's, transformers' Adafactor, bitsandbytes'; the
    functional kernels run under their step) therefore gets the message that names
    them; torch.optim's other code (swa_utils' update_parameters(model) reads weights,
    where full_weights is the way) keeps the weight's. Walked on the error path only,
    from the frame that made the call up; the engine's own code ends the walk first
    (its optimizer is a torch Optimizer too): a stand-in reached there is not the
    user's optimizer's doing."""
    frame = sys._getframe(2)  # the caller of the operation that reached the stand-in
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module == __name__:  # AbsentWeight.__torch_function__, under the call
            frame = frame.f_back
            continue
        if module == "offload" or module.startswith("offload."):
            return False
        code = frame.f_code
        if (code.co_argcount and code.co_varnames[0] == "self"
                and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer)):
            return True
        frame = frame.f_back
    return False


def post_accumulate_message(name: str) -> str:
    """Why a post-accumulate-grad hook on parameter `name` is refused."""
    return (f"a post-accumulate-grad hook on parameter {name!r} would never run: the "
            "engine accumulates the gradients in its partitions, not in .grad, and updates "
            "them in engine.step(); change a gradient with p.register_hook(fn), which runs "
            "on each use's gradient, or act after engine.backward(...)")


class AbsentRead(RuntimeError):
    """A computation read a parameter's stand-in (its message says what to do)."""


class WeightHome:
    """The module attribute a registered stand-in stands for (its first, where tied)."""

    __slots__ = ("_module", "_name", "_order")

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self._module, self._name = weakref.ref(module), name
        self._order = tuple(module._parameters)  # its parameters' names, in their order

    def gathered(self) -> torch.Tensor | None:
        """What the attribute holds while the group is bound (the gathered weights its
        forward reads), else None ([Note: weights read through the registered
        parameters])."""
        m = self._module()
        return None if m is None else m.__dict__.get(self._name)

    def put_back(self, p: torch.Tensor) -> bool:
        """[Note: a parameter removed before a computation that fails]
        torch.nn.utils.prune and the old torch.nn.utils.weight_norm, applied after
        `initialize`, take the parameter out of `module._parameters` (prune moving it
        to `weight_orig`) and then compute on it, which fails on the stand-in: the
        module was left without its parameter, and every later call failed on that.
        Where the module lacks it, `p` is put back under its name and taken from any
        other, in its place among the module's parameters; returns whether it was."""
        m = self._module()
        if m is None or self._name in m._parameters:
            return False
        now = {k: v for k, v in m._parameters.items() if v is not p}
        now[self._name] = p
        m._parameters.clear()
        m._parameters.update({k: now.pop(k) for k in self._order if k in now})
        m._parameters.update(now)  # any registered since, after them
        return True


def _gathered_instead(tree: Any) -> Any:
    """`tree` with each stand-in replaced by its gathered weights, or None where one
    has none now ([Note: weights read through the registered parameters])."""
    missing = []

    def weights(a: Any) -> Any:
        if not isinstance(a, AbsentWeight):
            return a
        got = a.home.gathered() if a.home is not None else None
        if got is None:
            missing.append(a)
        return got
    out = tree_map(weights, tree)
    return None if missing else out


def _dynamo_loaded() -> bool:
    """Whether torch.compile's tracer is loaded (offload never loads it itself)."""
    return "torch._dynamo" in sys.modules


def _eagerly(fn: Callable) -> Callable:
    """`fn`, run eagerly where torch.compile is loaded: it traced the fall-back's frames
    after a graph break and met an internal error in them."""
    return torch.compiler.disable(fn) if _dynamo_loaded() else fn


def _function_input(tree: Any) -> bool:
    """Whether a stand-in of `tree` is an input of a custom autograd Function's `apply`
    that runs now: its forward computing with the gathered weights would give autograd
    the stand-in as the input, and the weight's gradient would go to the stand-in and
    be lost (torch.autograd.Function.apply does not ask `__torch_function__`). Walked
    on the error path only."""
    mine = {id(a) for a in tree_leaves(tree) if isinstance(a, AbsentWeight)}
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY:
            given = frame.f_locals.get("args", ())
            return any(id(a) in mine for a in (*given, *frame.f_locals.get("kwargs", {})
                                                .values()))
        frame = frame.f_back
    return False


_APPLY = torch.autograd.Function.apply.__func__.__code__

FUNCTION_INPUT = (
    "a custom autograd Function was given a registered parameter (from parameters() or "
    "_parameters): its gradient would go to that stand-in, not to the engine, so its "
    "forward does not compute with the gathered weights; give the Function the module's "
    "attribute (self.weight), which holds them while the unit runs. ")

# where torch moves a parameter out of its module before computing on it
_REPARAMETRIZING = ("torch.nn.utils.prune", "torch.nn.utils.weight_norm")


def _put_back(tree: Any, error: AbsentRead) -> None:
    """[Note: a parameter removed before a computation that fails]: each stand-in of
    `tree` its module lost is put back, and `error` says so; only under torch's prune
    or weight_norm (a parameter the program deleted itself stays deleted)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") not in _REPARAMETRIZING:
        frame = frame.f_back
    if frame is None:
        return
    back = [a.param_name for a in tree_leaves(tree)
            if isinstance(a, AbsentWeight) and a.home is not None and a.home.put_back(a)]
    if back:
        error.args = (f"parameter {back[0]!r} was taken out of its module before a "
                      "computation on it (as torch.nn.utils.prune and "
                      "torch.nn.utils.weight_norm do, which after initialize fail here); "
                      "it is put back, the module is as it was: apply them before "
                      f"initialize. The computation: {error.args[0]}",) + error.args[1:]


class AbsentWeight(torch.Tensor):
    """A parameter's stand-in while its group is not gathered; see [Note: absent weights]."""

    message: str
    is_grad: bool  # a gradient's stand-in: its message names the fix for the whole call
    param_name: str  # the parameter's

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                message: str, is_grad: bool = False, name: str = "") -> "AbsentWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.message = message
        t.is_grad = is_grad
        t.param_name = name
        return t

    # [Note: weights read through the registered parameters]
    # A forward that reads its weights through its module's registered parameters
    # (`self.parameters()` for an L2 term computed in the forward,
    # `parameters_to_vector`, `self._parameters["weight"]`) meets the stand-ins there,
    # not the attribute (`self.weight`) that holds the gathered weights while the unit
    # runs, and failed with the message of a read outside the unit's forward even
    # where the whole model was one unit. As FSDP's and DeepSpeed's gathered parameters
    # do, a computation on a stand-in whose weights are gathered now computes with
    # them: with the tensor the attribute holds (`WeightHome`), so its gradient reaches
    # the partition as the attribute's does. Where they are not gathered it raises as
    # before; metadata, hooks and `requires_grad` are the stand-in's either way.
    home: WeightHome | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        try:  # as torch's disabled impl, which takes no kwargs where there are none
            return (torch._C._disabled_torch_function_impl(func, types, args) if not kwargs
                    else torch._C._disabled_torch_function_impl(func, types, args, kwargs))
        except AbsentRead as e:
            tree = (args, kwargs or {})
            to_function = _eagerly(_function_input)(tree)
            compiling = _dynamo_loaded() and torch.compiler.is_compiling()
            weights = (None if compiling or to_function
                       else _eagerly(_gathered_instead)(tree))
            if weights is None:
                _eagerly(_put_back)(tree, e)
                if to_function:
                    e.args = (FUNCTION_INPUT + e.args[0],) + e.args[1:]
                raise
        return func(*weights[0], **weights[1])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.detach.default:  # nn.Parameter(stand-in), state_dict
            src = args[0]
            return AbsentWeight(src.shape, src.dtype, src.device, src.message, src.is_grad,
                                src.param_name)
        absent = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, AbsentWeight)]
        if func is torch.ops.aten.zero_.default and absent and absent[0].is_grad:
            raise RuntimeError(  # model.zero_grad(set_to_none=False), as older loops call
                f"zeroing the .grad of parameter {absent[0].param_name!r} in place "
                "(zero_grad(set_to_none=False), p.grad.zero_()) cannot reach the engine's "
                "gradients, which are in its partitions: call model.zero_grad() or "
                "engine.zero_grad() instead (they set .grad to None, as torch's default "
                "set_to_none=True, and drop the step's gradients); nothing was changed")
        if absent:  # an optimizer's update of a parameter by its gradient: the gradient's
            first = max(absent, key=lambda a: a.is_grad)
            if first.message != closed_message(first.param_name) and _from_torch_optimizer():
                raise RuntimeError(torch_optimizer_message(first.param_name))
            if first.is_grad:
                raise RuntimeError(first.message)
            if torch._C._current_autograd_node() is not None:
                raise AbsentRead(IN_BACKWARD + first.message)
            raise AbsentRead(first.message)
        raise RuntimeError(f"{func} got an absent weight")

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        """[Note: gradient hooks on parameters] in gathering.py: refused, naming the
        parameter, where it was taken and never run."""
        raise RuntimeError(post_accumulate_message(self.param_name))

    # `p.data = t` swaps a tensor's data in C, past __torch_dispatch__: taken, it changed
    # nothing the engine holds (and one of another shape changed the stand-in's shape)
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        if value is self:
            return  # a cast that changes nothing (`.to` of the same dtype) puts it back
        name = self.param_name
        if self.is_grad or self.message == closed_message(name):
            raise RuntimeError(f"setting .data of {'the .grad of ' * self.is_grad}parameter "
                               f"{name!r} would change nothing the engine trains: "
                               f"{self.message}")
        raise RuntimeError(f"setting .data of parameter {name!r} would change nothing "
                           "the engine trains: its weights are in the engine's partitions, "
                           "not in this tensor. Change them inside `with "
                           "engine.full_weights(writable=True) as w:` (w[name].copy_(...)) "
                           "or load them with engine.load_state_dict(...)")

    # conversions and storage reads that torch does not dispatch (safetensors and
    # transformers' save_pretrained read data pointers)
    def tolist(self) -> Any:
        raise RuntimeError(self.message)

    def untyped_storage(self) -> Any:
        raise RuntimeError(self.message)

    def storage(self) -> Any:
        raise RuntimeError(self.message)

    def data_ptr(self) -> int:
        raise RuntimeError(self.message)

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.message)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.message)

    def __repr__(self) -> str:  # printing must not compute
        return (f"AbsentWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device})")
