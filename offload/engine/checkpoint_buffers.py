"""A checkpoint's module buffers: BatchNorm's running statistics and its batch count,
and every other buffer `state_dict` holds (persistent ones), as torch saves them.

Buffers are the same on every rank and small next to the partitions, so they are
captured when `save_checkpoint` is called (a forward may change them while a save
in the background runs) and rank 0 writes them as `buffers.json` beside the commit
record (each tensor's dtype, shape and bytes in base64; the file carries its
sha256 as the rank files do). On resume they are checked against the model
(names, shapes, dtypes) before any state is read, and copied into it after the
partitions are placed.

[Note: extra states in a checkpoint]
A module whose class defines `get_extra_state` (torch's `_extra_state` entry)
has what it returns saved with the buffers, under the key `EXTRA_STATES` (no
state-dict name starts with a '.'): torch.save's bytes in base64, by the
module's first name. They are captured, and read back with
`torch.load(weights_only=True)`, when `save_checkpoint` is called, so a value
that could not be resumed (an object of a class of its own) is refused then,
naming the module, before anything is written. On resume every module whose
class defines `set_extra_state` gets its saved value after the buffers; a
module it lacks, or one more, is refused before any state is read (a save
of a model without extra states writes an empty entry). A checkpoint saved
before extra states were kept has no entry and sets none.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch
from torch import nn

from .params_view import state_entries

__all__ = ["BUFFERS", "EXTRA_STATES", "capture_buffers", "capture_extra_states",
           "check_buffers", "check_extra_states", "decode_buffers", "decode_extra_states",
           "encode_buffers", "restore_buffers", "restore_extra_states", "with_extra_state"]

BUFFERS = "buffers.json"
EXTRA_STATES = ".extra_states"  # [Note: extra states in a checkpoint]


def with_extra_state(module: nn.Module, method: str, every_name: bool = False
                     ) -> dict[str, nn.Module]:
    """{name: module} of the modules whose class defines `method` (`get_extra_state` or
    `set_extra_state`), as torch's state_dict tests it: by each one's first name, or
    with `every_name` under each name it is registered under (as state_dict walks)."""
    return {name: m for name, m in module.named_modules(remove_duplicate=not every_name)
            if getattr(type(m), method) is not getattr(nn.Module, method)}


def capture_extra_states(module: nn.Module) -> dict[str, str]:
    """[Note: extra states in a checkpoint] Each module's `get_extra_state()`, as
    torch.save's bytes in base64; ValueError naming the module where the value
    cannot be read back with weights_only=True."""
    out = {}
    for name, m in with_extra_state(module, "get_extra_state").items():
        buf = io.BytesIO()
        try:
            torch.save(m.get_extra_state(), buf)
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure of the user's value
            raise ValueError(
                f"the extra state of module {name or '(the model)'!r} (get_extra_state) "
                f"cannot be saved so that it resumes ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}): return tensors, numbers, strings and "
                "lists or dicts of them") from e
        out[name] = base64.b64encode(buf.getvalue()).decode()
    return out


def decode_extra_states(obj: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The values `capture_extra_states` saved in `obj` (buffers.json), by module;
    None where the save kept none; ValueError naming the module where one cannot be
    read."""
    saved = obj.get(EXTRA_STATES)
    if saved is None:
        return None
    out = {}
    for name, raw in saved.items():
        try:
            out[name] = torch.load(io.BytesIO(base64.b64decode(raw, validate=True)),
                                   weights_only=True)
        except Exception as e:  # noqa: BLE001 - damaged bytes
            raise ValueError(f"{where}: the extra state of module {name!r} cannot be read "
                             f"({type(e).__name__})") from e
    return out


def check_extra_states(module: nn.Module, saved: dict[str, Any]) -> str | None:
    """What keeps the saved extra states from being set on `module`, or None."""
    mine = set(with_extra_state(module, "set_extra_state"))
    if mine != set(saved):
        return (f"the modules with extra state (set_extra_state) differ from the "
                f"checkpoint's (the model has {sorted(mine - set(saved))[:4]} that it lacks, "
                f"it has {sorted(set(saved) - mine)[:4]} that the model lacks)")
    return None


def restore_extra_states(module: nn.Module, saved: dict[str, Any]) -> None:
    """Gives each module its saved extra state (checked)."""
    for name, m in with_extra_state(module, "set_extra_state").items():
        m.set_extra_state(saved[name])


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
        if name in ("sha256", EXTRA_STATES):
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
