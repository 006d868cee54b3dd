"""Writing Hugging Face safetensors shards one tensor at a time.

[Note: streamed shards]
`safetensors.torch.save_file` wants every tensor of a file in memory at
once; a shard of several GiB would then be held whole beside the model's
budgets. The format is a little-endian u64 header length, a JSON header
({name: {"dtype", "shape", "data_offsets"}} and "__metadata__") padded with
spaces to 8 bytes, then the tensors' bytes back to back. Every shape and
dtype is known before a byte is written, so the header is written first and
each tensor is appended as it arrives: one tensor in memory at a time.

[Note: all or nothing]
A failed write must leave the directory as it found it: shards renamed to
their final names beside a missing or empty index look complete to a loader,
and a re-run is refused ("already holds safetensors files"). So every file
(the shards, the index, the copies such as config.json) is written under a
`.partial` name and fsynced, and only when all are whole are they renamed to
their final names and the directory fsynced. Any failure on the way (a
full disk, an error of the tensors' source, Ctrl-C, a rename) removes every
`.partial` file, every final name already made, and the directories the call
created. An `OSError` of one of our own writes is raised again with its
errno, naming the file, the bytes needed and free, and the fix.

A process killed while writing (SIGKILL, a lost node) leaves its `.partial`
files. A call holds an exclusive `flock` on `.safetensors.partial.lock` in the
directory while it writes (the lock goes with the process however it ends,
as [Note: partial directories] in checkpoint_publish.py), so a second export
into the same directory is refused rather than writing over the first's
files, and the call that holds it removes the `.partial` files of shards,
index and copies that a killed call left.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from ..config import format_bytes
from ..files import check_directory
from .checkpoint_publish import PartialLock

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


def cast_finite(name: str, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """`t` in dtype `to`; `OverflowError` naming the tensor where a finite value beyond
    `to`'s range would become inf (fp32 or bf16 weights above 65504 written as fp16),
    so no weight is lost silently."""
    out = t.to(to)
    if (out.dtype != t.dtype and out.is_floating_point()
            and int(torch.isinf(out).sum()) > int(torch.isinf(t).sum())):
        big = t[torch.isfinite(t)].abs().max().item()
        raise OverflowError(f"tensor {name!r} holds values beyond the range of "
                            f"{str(to).removeprefix('torch.')} (up to {big:g}), which would "
                            "be written as inf")
    return out


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


def _append(write: Callable[[bytes | memoryview], None], spec: TensorSpec, name: str,
            t: torch.Tensor) -> None:
    if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"safetensors: expected tensor {spec.name!r} {spec.shape} "
                         f"{spec.dtype}, got {name!r} {tuple(t.shape)} {t.dtype}")
    if spec.nbytes:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        write(memoryview(data.numpy()))


_PARTIAL = ".partial"
_COPY_CHUNK = 1 << 20  # bytes read at a time from a file copied beside the shards


class _Staging:
    """The files and directories one `write_shards` call makes in `out`: written
    under `.partial` names, made final together by `commit`, or all removed by
    `discard`. [Note: all or nothing]"""

    def __init__(self, out: Path, need: int, elsewhere: str):
        self.out, self.need, self.elsewhere = out, need, elsewhere
        self.created: list[Path] = []  # deepest first
        self.partial: list[Path] = []
        self.final: list[Path] = []
        self.failure: tuple[OSError, Path] | None = None  # our own write that failed
        self.lock: PartialLock | None = None

    def _do(self, path: Path, fn: Callable, *args):
        try:
            return fn(*args)
        except OSError as e:
            self.failure = (e, path)
            raise

    def mkdir(self, copies: Iterable[str]) -> None:
        """Makes `out`, takes its lock and removes the `.partial` files a killed call
        left there (of shards, the index and `copies`)."""
        p = self.out.absolute()
        while not p.exists():
            self.created.append(p)
            p = p.parent
        self._do(self.out, self.out.mkdir, 0o777, True, True)
        try:
            self.lock = self._do(self.out, PartialLock, self.out / ".safetensors.partial", False)
        except BlockingIOError:
            self.failure = None
            raise FileExistsError(
                f"safetensors: another export is writing into {self.out} now; wait for it "
                f"to finish, or {self.elsewhere}") from None
        stale = [*self.out.glob(f"model*.safetensors{_PARTIAL}"),
                 *(self.out / (name + _PARTIAL) for name in (INDEX, *copies))]
        for path in stale:
            if path.is_file():
                path.unlink()

    @contextlib.contextmanager
    def file(self, name: str) -> Iterator[Callable[[bytes | memoryview], None]]:
        """`name.partial`, opened for `write(bytes)`; fsynced when the block ends
        without an error (a full disk may show only then)."""
        path = self.out / (name + _PARTIAL)
        f = self._do(path, open, path, "wb", 0)  # unbuffered: close has nothing to flush
        self.partial.append(path)
        try:
            yield lambda data: self._write(f, path, data)
            self._do(path, os.fsync, f.fileno())
        finally:
            with contextlib.suppress(OSError):
                f.close()

    def _write(self, f: io.FileIO, path: Path, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:  # a raw write may take part of it (then the rest fails with ENOSPC)
            view = view[self._do(path, f.write, view):]

    def commit(self) -> list[Path]:
        for path in self.partial:
            final = path.with_name(path.name[:-len(_PARTIAL)])
            self._do(final, os.replace, path, final)
            self.final.append(final)
        fd = self._do(self.out, os.open, self.out, os.O_RDONLY)
        try:
            self._do(self.out, os.fsync, fd)  # the renames survive a crash
        finally:
            os.close(fd)
        self._unlock()
        return self.final

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def discard(self) -> None:
        for path in self.partial + self.final:
            with contextlib.suppress(OSError):  # the first error is the one to report
                path.unlink(missing_ok=True)
        self._unlock()
        for d in self.created:  # while empty: one that holds anything is not only ours
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                break

    def error(self, e: OSError, path: Path) -> OSError:
        """`e` (one of our writes failed, the files are discarded) as the error a user
        can act on, its errno kept."""
        if path.name.endswith(_PARTIAL):
            path = path.with_name(path.name[:-len(_PARTIAL)])
        text = f"safetensors: cannot write {path}: {e.strerror or e}; "
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                st = os.statvfs(next(p for p in (self.out, *self.out.parents) if p.exists()))
                free = f", {format_bytes(st.f_bavail * st.f_frsize)} is free there"
            except (OSError, StopIteration):
                free = ""
            text += (f"the files need {format_bytes(self.need)}{free}: free space on that "
                     f"file system or {self.elsewhere}")
        else:
            text += self.elsewhere
        text += " (the files written so far were removed)"
        return OSError(text) if e.errno is None else OSError(e.errno, text)  # a subclass by errno


def _index(names: list[str], shards: list[list[TensorSpec]], specs: list[TensorSpec]) -> bytes:
    weight_map = {s.name: fname for fname, shard in zip(names, shards) for s in shard}
    return json.dumps({"metadata": {"total_size": sum(s.nbytes for s in specs)},
                       "weight_map": weight_map}, indent=1).encode()


def write_shards(out: str | os.PathLike, specs: list[TensorSpec],
                 tensors: Iterable[tuple[str, torch.Tensor]], max_shard_size: int,
                 metadata: dict[str, str] | None = None, *,
                 copies: Mapping[str, str | os.PathLike] | None = None,
                 elsewhere: str = "write to another directory") -> list[Path]:
    """Writes `tensors` ((name, tensor) in the order of `specs`, produced one at a time)
    as `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with a
    `model.safetensors.index.json`, into the directory `out` (created; one that
    already holds safetensors files is refused), with each file of `copies`
    ({name in out: source file}, e.g. config.json) copied beside them. Returns the
    files written. All or nothing: on any failure no final-named file is left and
    the directories made are removed; a failed write of ours raises `OSError` with
    its errno, naming the file and the fix (`elsewhere`: how to choose another
    directory). [Note: streamed shards] [Note: all or nothing]"""
    out = Path(out)
    if not max_shard_size > 0:  # else one shard per tensor
        raise ValueError(f"safetensors: max_shard_size must be a positive number of bytes, "
                         f"got {max_shard_size!r}")
    seen: set[str] = set()
    twice = [s.name for s in specs if s.name in seen or seen.add(s.name)]
    if twice:  # a header cannot hold both: the second's bytes would follow unnamed
        raise ValueError(f"safetensors: tensor name {twice[0]!r} given twice (nothing "
                         "was written)")
    check_directory(out, "safetensors")
    shards = plan_shards(specs, max_shard_size)
    n = len(shards)
    names = ["model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
             for i in range(n)]
    meta = {"format": "pt", **(metadata or {})}
    heads = [_header(shard, meta) for shard in shards]  # a dtype without a code: before any file
    index = _index(names, shards, specs) if n > 1 else None
    copies = {name: Path(src) for name, src in (copies or {}).items()}
    need = (sum(8 + len(h) + sum(s.nbytes for s in shard) for h, shard in zip(heads, shards))
            + len(index or b"") + sum(src.stat().st_size for src in copies.values()))
    staging = _Staging(out, need, elsewhere)
    try:
        staging.mkdir(copies)
        if any(out.glob("*.safetensors")) or (out / INDEX).exists():
            raise FileExistsError(f"{out} already holds safetensors files; give an empty "
                                  "directory (or remove them)")
        _write_all(staging, zip(names, heads, shards), iter(tensors), index, copies)
        return staging.commit()
    except BaseException as e:
        staging.discard()
        if staging.failure is not None and staging.failure[0] is e:
            raise staging.error(e, staging.failure[1]) from e
        raise


def _write_all(staging: _Staging, shards: Iterable[tuple[str, bytes, list[TensorSpec]]],
               stream: Iterator[tuple[str, torch.Tensor]], index: bytes | None,
               copies: dict[str, Path]) -> None:
    """Every file under its `.partial` name: each shard's header, then its tensors as
    they arrive; the index; the copies."""
    for fname, head, shard in shards:
        with staging.file(fname) as write:
            write(struct.pack("<Q", len(head)))
            write(head)
            for spec in shard:
                item = next(stream, None)
                if item is None:
                    raise ValueError(f"safetensors: the tensors ended before {spec.name!r}")
                _append(write, spec, *item)
                del item
    if index is not None:
        with staging.file(INDEX) as write:
            write(index)
    for name, src in copies.items():
        with open(src, "rb") as s, staging.file(name) as write:
            while chunk := s.read(_COPY_CHUNK):  # an error reading `src` is its own
                write(chunk)
