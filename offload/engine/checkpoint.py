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

import torch

__all__ = ["SafetensorsCheckpoint"]


class SafetensorsCheckpoint:
    """Name -> file index over one or more safetensors files; `get(name)` reads one tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("reading a checkpoint needs safetensors: pip install "
                              "'offload[hf]'") from e
        self._open = safe_open
        p = Path(path)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {name: p / f for name, f in weight_map.items()}
            else:
                shards = sorted(p.glob("*.safetensors"))
                if not shards:
                    raise FileNotFoundError(f"checkpoint directory {p} holds no .safetensors "
                                            "file")
                files = {}
                for f in shards:
                    with safe_open(str(f), framework="pt") as h:
                        files.update({k: f for k in h.keys()})
        elif p.is_file():
            with safe_open(str(p), framework="pt") as h:
                files = {k: p for k in h.keys()}
        else:
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        self.files = files

    def resolve(self, fqn: str) -> str | None:
        """The checkpoint's name for model parameter `fqn` (prefixes tolerated)."""
        if fqn in self.files:
            return fqn
        for name in self.files:
            if name.endswith("." + fqn) or fqn.endswith("." + name):
                return name
        return None

    def get(self, fqns: list[str]) -> torch.Tensor:
        """Reads the tensor stored under any of `fqns` (the names of tied uses)."""
        for fqn in fqns:
            name = self.resolve(fqn)
            if name is not None:
                with self._open(str(self.files[name]), framework="pt") as h:
                    return h.get_tensor(name)
        raise KeyError(f"checkpoint has no tensor for parameter {fqns[0]} (nor {fqns[1:]}); "
                       f"it holds e.g. {sorted(self.files)[:5]}")
