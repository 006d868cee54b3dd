"""Reading initial weights lazily from safetensors files (one tensor at a time).

A checkpoint is a `.safetensors` file, or a directory holding one or several
(transformers' sharded `model.safetensors.index.json` included). Tensors are
read by name when their group is materialised, so no process holds the whole
checkpoint; names may carry a prefix the model lacks (or lack one it has),
as with `transformer.` in GPT-2 files.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

log = logging.getLogger(__name__)

__all__ = ["SafetensorsCheckpoint"]

_T = TypeVar("_T")
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _header(h: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of an open safetensors file."""
    out = {}
    for k in h.keys():
        sl = h.get_slice(k)
        out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


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
        index = p / "model.safetensors.index.json"
        if p.is_dir() and index.is_file():
            files = {name: p / f for name, f in _weight_map(index).items()}
            shards = sorted(set(files.values()))
        elif p.is_dir():
            shards = sorted(p.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"checkpoint directory {p} holds no .safetensors "
                                        "file")
        elif p.is_file():
            shards = [p]
        else:
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        # every header up front (a few KiB each): a missing shard, a name the index puts
        # in a shard that lacks it, a shape or dtype the model cannot take, are refused
        # before any group is read ([Note: weights a checkpoint lacks] in __init__.py)
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        held: dict[str, Path] = {}
        for f in shards:
            if not f.is_file():
                name = next(k for k, v in files.items() if v == f)
                raise FileNotFoundError(
                    f"checkpoint index {index} puts {name!r} (and maybe more) in {f}, which "
                    "does not exist: the download or copy is incomplete; fetch the missing "
                    "shard, or remove the index to load the shards that are there")
            for k, spec in self._read(f, _header).items():
                self.specs[k] = spec
                held[k] = f
        if p.is_dir() and index.is_file():
            for name, f in files.items():
                if held.get(name) != f:
                    raise ValueError(
                        f"checkpoint index {index} puts {name!r} in {f}, which does not hold "
                        "it: the index does not match its shards; fix or remove the index "
                        "(without it every shard's tensors are loaded by their names)")
        self.files = files if p.is_dir() and index.is_file() else held
        self._resolved: dict[str, str | None] = {}

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
        if fqn not in self._resolved:  # a scan of every name: once per model name
            self._resolved[fqn] = next((name for name in self.files if name.endswith(
                "." + fqn) or fqn.endswith("." + name)), None)
        return self._resolved[fqn]

    def check(self, fqn: str, names: list[str], shape: tuple[int, ...]) -> None:
        """Refuses, from the headers alone, a tensor stored for parameter `fqn` (under
        any of `names`) whose shape is not `shape` or whose dtype is not a float."""
        for name in filter(None, map(self.resolve, names)):
            got, dtype = self.specs[name]
            if tuple(got) != tuple(shape):
                raise ValueError(f"checkpoint tensor {name!r} ({self.files[name]}) for "
                                 f"{fqn} has shape {tuple(got)}, the model expects "
                                 f"{tuple(shape)}: give the checkpoint of this model "
                                 "(or of this configuration of it)")
            if dtype not in _FLOATS:
                raise ValueError(f"checkpoint tensor {name!r} ({self.files[name]}) for "
                                 f"{fqn} is {dtype}, not a floating-point dtype: give the "
                                 "checkpoint of this model")

    def find(self, fqns: list[str]) -> torch.Tensor | None:
        """The tensor stored under `fqns` (the names of tied uses; prefixes tolerated),
        or None where the checkpoint holds none of them. Stored under several of them
        with different values (an untied checkpoint for a tied model), the last name's
        is taken, as torch's `load_state_dict` takes it, with a warning."""
        names = list(dict.fromkeys(filter(None, map(self.resolve, fqns))))
        found = [self._read(self.files[n], lambda h, n=n: h.get_tensor(n)) for n in names]
        if len(found) > 1 and not all(torch.equal(t, found[-1]) for t in found):
            log.warning("checkpoint: %s hold different values for one tied parameter of the "
                        "model (untied in the checkpoint): %r's are loaded, as torch's "
                        "load_state_dict would; untie the model (Hugging Face: "
                        "tie_word_embeddings=False) to keep both", " and ".join(map(repr, names)),
                        names[-1])
        return found[-1] if found else None
