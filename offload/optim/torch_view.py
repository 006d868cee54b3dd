"""What torch sees of `CpuAdam`, and a param group's values.

[Note: what torch sees]
torch's LR schedulers (and transformers' schedules, built on LambdaLR) accept
only a `torch.optim.Optimizer`, and use of it `param_groups` (a group's "lr",
"initial_lr", "betas" for cyclic momentum), `defaults` and `step` (wrapped to
check that the scheduler steps after it). So CpuAdam subclasses it without
its `__init__`, which wants parameter tensors (a partition joins with
`add_partition`; a group's "params" are partition ids): it keeps its own
`param_groups`, `state_dict`/`load_state_dict` (snapshot.py) and `step`;
`zero_grad` drops its owner's gradients (the engine's: `zero_grad_hook`),
having none itself; torch's hooks and `add_param_group` are refused, as
nothing would call them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Mapping

import torch

__all__ = ["TorchOptimizerView", "check_same", "group_values", "unsupported_option",
           "value_change"]


_VALUE_NAMES = ("lr", "beta1", "beta2", "eps", "weight_decay", "lr_lambda")


def group_values(group: Mapping[str, Any]) -> tuple:
    """A group's values, comparable with ==: numbers as floats (an lr may be a tensor)."""
    def num(v: Any) -> Any:
        try:
            return float(v)
        except (TypeError, ValueError):
            return v  # refused by the update, naming it
    betas = group["betas"]
    b = tuple(betas) if isinstance(betas, (tuple, list)) and len(betas) == 2 else (betas, None)
    return (num(group["lr"]), num(b[0]), num(b[1]), num(group["eps"]),
            num(group["weight_decay"]), group["lr_lambda"])


# torch.optim.AdamW's options that change its numbers and that CpuAdam does not run:
# `initialize` and the config refuse them as unknown keys; a value written into
# `param_groups` later (torch's AdamW reads them at every step), or a loaded state
# dict's, is refused here, naming the key, where it would otherwise be ignored.
# (foreach, fused, capturable and differentiable change how torch computes, not what.)
_UNSUPPORTED = ("amsgrad", "maximize")


def unsupported_option(group: Mapping[str, Any], decoupled: bool) -> str | None:
    """What torch option `group` turns on that CpuAdam does not run, or None;
    `decoupled`: whether it runs AdamW's decay (optim.name "adamw") or Adam's. torch's
    Adam and AdamW read `decoupled_weight_decay` from each group at every step."""
    on = [k for k in _UNSUPPORTED if group.get(k)]
    if on:
        return (f"{', '.join(f'{k}={group[k]!r}' for k in on)}: CpuAdam runs plain "
                f"Adam/AdamW (no {' or '.join(on)}); remove the key or set it False")
    key = "decoupled_weight_decay"
    if key in group and bool(group[key]) != decoupled:
        name, other = ("adamw", "adam") if decoupled else ("adam", "adamw")
        return (f"{key}={group[key]!r}: this optimizer is optim.name = {name!r} (weight "
                f"decay {'decoupled from' if decoupled else 'added to'} the gradient) for "
                f"every group; set optim.name = {other!r} in the configuration, or remove "
                "the key")
    return None


def value_change(used: tuple, now: tuple) -> str:
    """What differs between two `group_values`, e.g. "lr 0.01 -> 0.003"."""
    return ", ".join(f"{n} {a!r} -> {b!r}" if n != "lr_lambda" else "lr_lambda replaced"
                     for n, a, b in zip(_VALUE_NAMES, used, now) if not _same(a, b))


def _same(a: Any, b: Any) -> bool:
    """Equal values, NaN where the other is NaN: a tensor's NaN read twice is two floats
    that compare unequal, and was taken for a change between backward and step()."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    return a is b or a == b or (isinstance(a, float) and isinstance(b, float)
                                and math.isnan(a) and math.isnan(b))


def check_same(group: int, used: tuple, now: tuple) -> None:
    """[Note: one set of values per round] in optimizer.py"""
    change = value_change(used, now)
    if change:
        raise ValueError(f"param_groups[{group}] changed within one step "
                         f"({change}): updates of this step already used "
                         "the first values; set a group's values before the step's updates "
                         "begin")


class TorchOptimizerView(torch.optim.Optimizer):
    """[Note: what torch sees]: the `torch.optim.Optimizer` methods a subclass that
    keeps its own `param_groups` and state answers itself. Its `__init__` is never
    called; `_zero_grad_hook` starts as None."""

    _zero_grad_hook: weakref.WeakMethod | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients of the step in progress where an owner keeps them (the
        engine's `zero_grad`); this optimizer keeps none (`update` takes them)."""
        hook = self._zero_grad_hook() if self._zero_grad_hook is not None else None
        if hook is not None:
            hook()

    def set_zero_grad_hook(self, method: Callable[[], Any]) -> None:
        """`zero_grad()` calls the bound `method` while its object lives (held weakly)."""
        self._zero_grad_hook = weakref.WeakMethod(method)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("CpuAdam's groups are fixed when it is made: pass every group as "
                        "param_groups (offload.initialize(..., param_groups=[...])), and add "
                        "partitions with add_partition")

    def _no_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("CpuAdam does not run torch.optim.Optimizer's hooks; wrap "
                        "engine.step() instead")

    register_step_pre_hook = register_step_post_hook = _no_hooks
    register_state_dict_pre_hook = register_state_dict_post_hook = _no_hooks
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _no_hooks

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("CpuAdam holds open files and threads and cannot be pickled; save "
                        "state_dict() (or the engine's save_checkpoint)")
