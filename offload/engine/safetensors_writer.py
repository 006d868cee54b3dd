"""Writing Hugging Face safetensors shards one tensor at a time.

[Note: streamed shards]
`safetensors.torch.save_file` wants every tensor of a file in memory at
once; a shard of several GiB would then be held whole beside the model's
budgets. The format is a little-endian u64 header length, a JSON header
({name: {"dtype", "shape", "data_offsets"}} and "__metadata__") padded with
spaces to 8 bytes, then the tensors' bytes back to back. Every shape and
dtype is known before a byte is written, so the header is written first and
each tensor is appended as it arrives: one tensor in memory at a time. Files
are written under a `.partial` name and renamed once all of them are whole;
on a failure the partial files are removed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..files import check_directory

__all__ = ["TensorSpec", "plan_shards", "write_shards", "INDEX"]

INDEX = "model.safetensors.index.json"
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Consecutive tensors into shards of at most `max_shard_size` bytes (a larger
    tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    head: dict = {"__metadata__": metadata}
    at = 0
    for s in specs:
        if s.dtype not in _CODES:
            raise ValueError(f"safetensors: tensor {s.name!r} has dtype {s.dtype}, which has "
                             f"no safetensors code; convert it to one of {list(_CODES)}")
        head[s.name] = {"dtype": _CODES[s.dtype], "shape": list(s.shape),
                        "data_offsets": [at, at + s.nbytes]}
        at += s.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _append(f, spec: TensorSpec, name: str, t: torch.Tensor) -> None:
    if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"safetensors: expected tensor {spec.name!r} {spec.shape} "
                         f"{spec.dtype}, got {name!r} {tuple(t.shape)} {t.dtype}")
    if spec.nbytes:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        f.write(memoryview(data.numpy()))


def write_shards(out: str | os.PathLike, specs: list[TensorSpec],
                 tensors: Iterable[tuple[str, torch.Tensor]], max_shard_size: int,
                 metadata: dict[str, str] | None = None) -> list[Path]:
    """Writes `tensors` ((name, tensor) in the order of `specs`, produced one at a time)
    as `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with a
    `model.safetensors.index.json`, into the directory `out` (created; one that
    already holds safetensors files is refused). Returns the files written.
    [Note: streamed shards]"""
    out = Path(out)
    if not max_shard_size > 0:  # else one shard per tensor
        raise ValueError(f"safetensors: max_shard_size must be a positive number of bytes, "
                         f"got {max_shard_size!r}")
    check_directory(out, "safetensors")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")) or (out / INDEX).exists():
        raise FileExistsError(f"{out} already holds safetensors files; give an empty "
                              "directory (or remove them)")
    shards = plan_shards(specs, max_shard_size)
    n = len(shards)
    names = ["model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
             for i in range(n)]
    meta = {"format": "pt", **(metadata or {})}
    stream = iter(tensors)
    partial: list[Path] = []
    try:
        for fname, shard in zip(names, shards):
            path = out / (fname + ".partial")
            partial.append(path)
            with open(path, "wb") as f:
                head = _header(shard, meta)
                f.write(struct.pack("<Q", len(head)))
                f.write(head)
                for spec in shard:
                    item = next(stream, None)
                    if item is None:
                        raise ValueError(f"safetensors: the tensors ended before {spec.name!r}")
                    _append(f, spec, *item)
                    del item
        files = []
        for path in partial:
            final = path.with_name(path.name[:-len(".partial")])
            os.replace(path, final)
            files.append(final)
    except BaseException:
        for path in partial:
            path.unlink(missing_ok=True)
        raise
    if n > 1:
        weight_map = {s.name: fname for fname, shard in zip(names, shards) for s in shard}
        index = out / INDEX
        index.write_text(json.dumps({"metadata": {"total_size": sum(s.nbytes for s in specs)},
                                     "weight_map": weight_map}, indent=1))
        files.append(index)
    return files
