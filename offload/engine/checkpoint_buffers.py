"""A checkpoint's module buffers: BatchNorm's running statistics and its batch count,
and every other buffer `state_dict` holds (persistent ones), as torch saves them.

Buffers are the same on every rank and small next to the partitions, so they are
captured when `save_checkpoint` is called (a forward may change them while a save
in the background runs) and rank 0 writes them as `buffers.json` beside the commit
record (each tensor's dtype, shape and bytes in base64; the file carries its
sha256 as the rank files do). On resume they are checked against the model
(names, shapes, dtypes) before any state is read, and copied into it after the
partitions are placed.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from torch import nn

from .params_view import state_entries

__all__ = ["BUFFERS", "capture_buffers", "check_buffers", "decode_buffers", "encode_buffers",
           "restore_buffers"]

BUFFERS = "buffers.json"


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by their first `state_dict` name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t, is_param in state_entries(module):
        if not is_param and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def capture_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the module's persistent buffers, on the CPU."""
    return {name: t.detach().to("cpu", copy=True) for name, t in _buffers(module).items()}


def encode_buffers(buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                   "data": base64.b64encode(t.contiguous().reshape(-1).view(torch.uint8)
                                            .numpy().tobytes()).decode()}
            for name, t in buffers.items()}


def decode_buffers(obj: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """The tensors `encode_buffers` wrote; ValueError naming the buffer where one cannot
    be decoded (`where`: the file)."""
    out = {}
    for name, e in obj.items():
        if name == "sha256":
            continue
        try:
            dtype = getattr(torch, e["dtype"])
            raw = bytearray(base64.b64decode(e["data"], validate=True))
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(dtype).reshape(e["shape"]).clone()
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
            raise ValueError(f"{where}: buffer {name!r} cannot be decoded ({err})") from err
    return out


def check_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> str | None:
    """What keeps `saved` from being loaded into `module`, or None."""
    mine = _buffers(module)
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing or extra:
        return (f"the model's buffers differ from the checkpoint's (the model has "
                f"{missing[:4]} that it lacks, it has {extra[:4]} that the model lacks)")
    for name, t in mine.items():
        if tuple(t.shape) != tuple(saved[name].shape) or t.dtype != saved[name].dtype:
            return (f"buffer {name!r} is {tuple(t.shape)} {t.dtype} in the model and "
                    f"{tuple(saved[name].shape)} {saved[name].dtype} in the checkpoint")
    return None


def restore_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copies `saved` (checked) into the module's buffers; one still on the meta device
    is replaced by the saved tensor on the CPU."""
    owners = {id(t): (m, n) for m in module.modules() for n, t in m._buffers.items()
              if t is not None}
    with torch.no_grad():
        for name, t in _buffers(module).items():
            if t.is_meta:
                m, n = owners[id(t)]
                m._buffers[n] = saved[name].clone()
            else:
                t.copy_(saved[name])
