"""Reading initial weights lazily from safetensors files (one tensor at a time).

A checkpoint is a `.safetensors` file, or a directory holding one or several
(transformers' sharded `model.safetensors.index.json` included). Tensors are
read by name when their group is materialised, so no process holds the whole
checkpoint; names may carry a prefix the model lacks (or lack one it has),
as with `transformer.` in GPT-2 files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

__all__ = ["SafetensorsCheckpoint"]

_T = TypeVar("_T")


def _weight_map(index: Path) -> dict[str, str]:
    """The {tensor: shard file} map of transformers' `model.safetensors.index.json`."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint index {index} is not a transformers safetensors index "
                         f"(JSON with a \"weight_map\": {type(e).__name__}: {e}); fix or "
                         "remove it") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {index}: \"weight_map\" is not a mapping of "
                         "tensor names to shard files; fix or remove it")
    return weight_map


class SafetensorsCheckpoint:
    """Name -> file index over one or more safetensors files; `get(name)` reads one tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as e:
            raise ImportError("reading a checkpoint needs safetensors: pip install "
                              "'offload[hf]'") from e
        self._open, self._error = safe_open, SafetensorError
        p = Path(path)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.is_file():
                files = {name: p / f for name, f in _weight_map(index).items()}
            else:
                shards = sorted(p.glob("*.safetensors"))
                if not shards:
                    raise FileNotFoundError(f"checkpoint directory {p} holds no .safetensors "
                                            "file")
                files = {}
                for f in shards:
                    files.update({k: f for k in self._read(f, lambda h: h.keys())})
        elif p.is_file():
            files = {k: p for k in self._read(p, lambda h: h.keys())}
        else:
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        self.files = files

    def _read(self, f: Path, what: Callable[[Any], _T]) -> _T:
        """`what(handle)` of safetensors file `f`; a file that is not one is named."""
        try:
            with self._open(str(f), framework="pt") as h:
                return what(h)
        except self._error as e:
            raise ValueError(f"checkpoint {f} is not a valid safetensors file ({e}); pass "
                             "a .safetensors file, or a directory of them as transformers' "
                             "save_pretrained writes") from e

    def resolve(self, fqn: str) -> str | None:
        """The checkpoint's name for model parameter `fqn` (prefixes tolerated)."""
        if fqn in self.files:
            return fqn
        for name in self.files:
            if name.endswith("." + fqn) or fqn.endswith("." + name):
                return name
        return None

    def find(self, fqns: list[str]) -> torch.Tensor | None:
        """The tensor stored under any of `fqns` (the names of tied uses; prefixes
        tolerated), or None where the checkpoint holds none of them."""
        for fqn in fqns:
            name = self.resolve(fqn)
            if name is not None:
                return self._read(self.files[name], lambda h: h.get_tensor(name))
        return None
