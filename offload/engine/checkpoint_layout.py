"""The on-disk layout of a checkpoint's arrays: how each is cut into chunks and
shard files, which elements a rank's partition covers, and the zarr v3 spec
tensorstore opens ([Note: checkpoint layout] in training_checkpoint.py). Shared
by the writer (training_checkpoint.py) and the reader (checkpoint_reader.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..io.process import usable_cpus
from .checkpoint_files import IO_THREADS, CheckpointError
from .units import Group, Slot

__all__ = ["CHECKED", "CHUNK_ELEMS", "FORMAT", "Grid", "KINDS", "SHARD_CHUNKS", "TORCH_DTYPES",
           "check_utf8", "flat_boxes"]

FORMAT = "offload-checkpoint/2"  # /1: a file per chunk, no shards
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")

CHUNK_ELEMS = 1 << 20  # elements per chunk (at most one row more): 4 MiB of fp32
SHARD_CHUNKS = 64  # chunks per shard file at most, when one rank saves: 256 MiB of fp32
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TORCH_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def _ts():
    import tensorstore  # imported on use: engines that never checkpoint do not load it
    return tensorstore


def check_utf8(path: Path, who: str, fix: str) -> None:
    """CheckpointError from `who` where the path `path` is not valid UTF-8 (a name holding
    a byte of another encoding, e.g. Latin-1, which Linux allows): tensorstore, which
    writes and opens a checkpoint's arrays, takes only UTF-8 paths, and fails on such a
    one with a cast error naming neither the path nor the cause. The message shows the
    path with its undecodable bytes escaped (\\xe9) and ends in `fix`."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode made each undecodable byte a lone surrogate
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise CheckpointError(f"{who}: the checkpoint path {shown} is not valid UTF-8 "
                              "(tensorstore, which writes and opens the checkpoint's arrays, "
                              f"requires UTF-8 paths): {fix}") from None


def _context():
    """tensorstore's resources for one save or reader: files are not fsynced one by
    one as they are written (a save fsyncs them all at once before it publishes:
    [Note: publishing a checkpoint]), and several are written or read at once."""
    return _ts().Context({"file_io_sync": False,
                          "file_io_concurrency": {"limit": IO_THREADS},
                          "data_copy_concurrency": {"limit": usable_cpus()}})


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int
               ) -> list[tuple[tuple[slice, ...], int, int]]:
    """The elements [lo, hi) of a C-order array of `shape` as boxes: a list of
    (index, flat_lo, flat_hi), each index a tuple of slices (one per dimension)
    selecting exactly the elements [flat_lo, flat_hi), in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((slice(lo, hi),), lo, hi)]
    row = math.prod(shape[1:])
    full = tuple(slice(0, d) for d in shape[1:])
    first, last = -(-lo // row), hi // row  # whole rows [first, last)
    out: list[tuple[tuple[slice, ...], int, int]] = []

    def part_of_row(r: int, a: int, b: int) -> None:  # elements [a, b) of row r
        for idx, x, y in flat_boxes(shape[1:], a, b):
            out.append(((slice(r, r + 1),) + idx, r * row + x, r * row + y))
    if first > last:  # inside one row
        r = lo // row
        part_of_row(r, lo - r * row, hi - r * row)
        return out
    if lo < first * row:
        part_of_row(first - 1, lo - (first - 1) * row, row)
    if first < last:
        out.append(((slice(first, last),) + full, first * row, last * row))
    if last * row < hi:
        part_of_row(last, 0, hi - last * row)
    return out


def _stored_shape(shape: tuple[int, ...]) -> list[int]:
    return list(shape) if len(shape) else [1]  # a 0-d parameter is stored as [1]


class Grid(NamedTuple):
    """How an array is cut: `chunk` flat elements per chunk (whole rows of dimension
    0), `per_shard` chunks per shard file, `chunks` chunks in the array."""
    chunk: int
    per_shard: int
    chunks: int

    @property
    def shard(self) -> int:
        """Flat elements per shard."""
        return self.chunk * self.per_shard


def _grid(shape: tuple[int, ...], world: int) -> Grid:
    """The chunks of an array of `shape` saved by `world` ranks: about `CHUNK_ELEMS`
    elements each (all the rows where the array has fewer); one rank puts up to
    `SHARD_CHUNKS` in a shard, as evenly as the count allows (no shard mostly
    empty), several ranks one (a shard two ranks share is held in memory and
    written in turns: it stays one chunk)."""
    s = _stored_shape(shape)
    row = max(1, math.prod(s[1:]))
    rows = max(1, min(CHUNK_ELEMS // row, s[0]))
    n = -(-s[0] // rows)
    per = 1 if world > 1 else -(-n // -(-n // SHARD_CHUNKS))
    return Grid(rows * row, per, n)


def _chunk_elems(shape: tuple[int, ...]) -> int:
    """Flat elements per chunk (the same for any number of ranks)."""
    return _grid(shape, 1).chunk


def _box_shape(idx: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in idx)


def _rank_range(g: Group, slot: Slot, rank: int) -> tuple[int, int]:
    """Slot-local elements [a, b) that `rank`'s partition of `g` holds (a >= b: none)."""
    lo, hi = rank * g.shard, (rank + 1) * g.shard
    return max(lo, slot.offset) - slot.offset, min(hi, slot.offset + slot.numel) - slot.offset


def _segments(g: Group, slot: Slot, rank: int) -> list[tuple[int, int, bool]]:
    """The slot-local range of `rank` cut at shard boundaries into (a, b, shared):
    shared segments lie in shards another rank writes too."""
    a, b = _rank_range(g, slot, rank)
    if a >= b:
        return []
    ce = _grid(tuple(slot.shape), g.world).shard
    others: set[int] = set()
    for q in range(g.world):
        qa, qb = _rank_range(g, slot, q)
        if q != rank and qa < qb:
            others.update((qa // ce, (qb - 1) // ce))  # ranges are contiguous: ends suffice
    out = []
    x = a
    while x < b:
        c = x // ce
        if c in others:
            y = min(b, (c + 1) * ce)
        else:
            nxt = [k * ce for k in others if k > c]
            y = min([b] + nxt)
        out.append((x, y, c in others))
        x = y
    return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: tensorstore's own type
        return t.view(torch.int16).numpy().view(_ts().bfloat16.numpy_dtype)
    return t.numpy()


# each chunk and each shard's index: little-endian bytes, then their crc32c
CHECKED = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _spec(root: Path, kind: str, name: str, shape: tuple[int, ...] | None = None,
          dtype: str | None = None, world: int = 1) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3",
                            "kvstore": {"driver": "file", "path": str(root / kind / name)},
                            # a chunk of zeros is a file like any other: a missing one is damage
                            "store_data_equal_to_fill_value": True}
    if shape is not None:
        s = _stored_shape(shape)
        grid = _grid(shape, world)
        rows = grid.chunk // max(1, math.prod(s[1:]))
        spec["metadata"] = {
            "shape": s, "data_type": dtype,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": [rows * grid.per_shard] + s[1:]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [rows] + s[1:], "codecs": CHECKED, "index_codecs": CHECKED,
                "index_location": "end"}}]}
    return spec


def _max_chunk_bytes(table: dict) -> int:
    """The bytes of the largest chunk of any array a commit record's tensor `table` lists."""
    return max([_chunk_elems(tuple(t["shape"])) * TORCH_DTYPES[d].itemsize
                for t in table.values() for d in t["kinds"].values()] or [1])
