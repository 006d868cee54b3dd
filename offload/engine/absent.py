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
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["AbsentWeight", "absent_message"]


def absent_message(name: str, unit: str) -> str:
    return (f"parameter {name!r} is used outside the forward of unit {unit!r}, the module "
            "whose hooks gather it: its weights exist only while that unit's forward or "
            "backward runs. Call that unit (or the whole engine), not a module inside it; a "
            "parent that reads a child unit's weight in its own forward (e.g. a tied head as "
            "F.linear(h, self.wte.weight)) needs both in one unit: raise engine.group_size "
            "so the parent's subtree is one unit, or share the parameter by assignment "
            "(self.head.weight = self.wte.weight) and call the child module")


class AbsentWeight(torch.Tensor):
    """A parameter's stand-in while its group is not gathered; see [Note: absent weights]."""

    message: str

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                message: str) -> "AbsentWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.message = message
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        for a in tree_leaves((args, kwargs or {})):
            if isinstance(a, AbsentWeight):
                raise RuntimeError(a.message)
        raise RuntimeError(f"{func} got an absent weight")

    def __repr__(self) -> str:  # printing must not compute
        return (f"AbsentWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device})")
