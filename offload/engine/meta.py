"""`meta_device()`: build a model on the meta device without torch's compiler stack.

[Note: normal_ on meta tensors]
A model built under `torch.device("meta")` still runs its initialisers on
storage-less tensors. `normal_` (nn.init.normal_, `weight.data.normal_`, what
nn.Embedding and most transformers models call) has no native meta kernel:
torch runs its Python reference, whose wrapper imports `torch._dynamo` on
first use, and torch._inductor with it. Measured on torch 2.13 (CPU), that
import adds about 30 MiB of resident memory for the life of the process,
beyond torch.distributed.tensor and sympy (41 MiB, which torch's C++ loads
anyway the first time the engine's absent weights, a tensor subclass, are
detached): memory taken from the half-GiB the runtime has beside the budgets
of a model bigger than RAM (docs/benchmarks.md, `offload bench oversized`).
Filling a meta tensor does nothing, so under `meta_device()` `normal_` on a
meta tensor returns it untouched; every other call runs as torch runs it. The
weights are made later, group by group, by the modules' own initialisers on
real storage.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SkipMetaNormal", "meta_device"]

_FILLS = frozenset({torch.nn.init.normal_, torch.Tensor.normal_})


class SkipMetaNormal(TorchFunctionMode):
    """Returns a meta tensor given to `normal_` unchanged; see [Note: normal_ on meta
    tensors]."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`torch.device("meta")` for building a model, without the import `normal_`
    would make there ([Note: normal_ on meta tensors])."""
    with torch.device("meta"), SkipMetaNormal():
        yield
