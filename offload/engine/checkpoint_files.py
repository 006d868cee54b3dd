"""A checkpoint's errors, and the small files of a save: JSON written with its
sha256 and fsynced, the fsync of a directory tree before it is published
([Note: publishing a checkpoint] in training_checkpoint.py), and the RNG states
a resume puts back."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import json_loads, read_regular_text
from ..limits import limit_hint
from .checkpoint_chunks import syncfs

__all__ = ["CheckpointError", "CheckpointCorruptError", "CheckpointLimitError", "IO_THREADS",
           "decode_rng_state", "limit_reached", "rng_state", "set_rng_state"]

IO_THREADS = 16  # files written, read or fsynced at once


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, opened or used with this model."""


class CheckpointPathError(CheckpointError, FileExistsError):
    """A checkpoint path under a file: a `CheckpointError` as every refused save is, and
    the `FileExistsError` every other writer (save_pretrained, traces) raises there."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes do not match their checksums (or cannot be decoded)."""


# -- durability ------------------------------------------------------------------------
def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Makes every file and directory under `root` durable: one `syncfs` of its file
    system where the C library has it, else an fsync of every file (several at
    once: the disk writes them back in parallel), then of every directory, deepest
    first, `root` last."""
    if syncfs(root):
        return
    files, dirs = [], []
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        files += [Path(dirpath, f) for f in names]
        dirs.append(Path(dirpath))
    with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="offload-fsync") as pool:
        list(pool.map(_fsync_path, files))
    for d in dirs:
        _fsync_path(d)


def _digest(obj: Any) -> str:
    body = {k: v for k, v in obj.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_json(p: Path, obj: Any) -> None:
    """Writes `obj` with its sha256 (`_read_json` checks it) and fsyncs the file."""
    obj = {**obj, "sha256": _digest(obj)}
    with open(p, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


class CheckpointPermissionError(CheckpointError):
    """A checkpoint file this process may not read: no damage (not a
    CheckpointCorruptError); the fix is the file's permissions."""


def not_permitted(path: Any, e: OSError) -> CheckpointPermissionError:
    """The error for a checkpoint file this process may not read."""
    return CheckpointPermissionError(
        f"checkpoint file {path} cannot be read ({e.strerror}): this process (uid "
        f"{os.getuid()}) lacks permission; the checkpoint may be intact: give it read "
        "access to the checkpoint's files (chmod, chown) and retry")


class CheckpointLimitError(CheckpointError, OSError):
    """A checkpoint file this process cannot open or read because a limit of the process
    or the machine was met (open files: RLIMIT_NOFILE or the machine's file table;
    memory): no damage (not a CheckpointCorruptError); the message names the file, the
    limit and how to raise it. An OSError with the real `errno`, and the file, where
    one, as `filename`."""

    def __init__(self, code: int, message: str, path: Any = None) -> None:
        OSError.__init__(self, code, message)  # RuntimeError's (first in the MRO) sets neither
        self.filename = None if path is None else str(path)

    def __str__(self) -> str:  # OSError's default puts "[Errno N]" before the message
        return self.strerror


# limits whose errno tensorstore's errors may give only as its strerror
_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def _limit_errno(e: BaseException | None) -> int | None:
    """The errno of `e` where it is a limit of this process or machine
    (`offload.limits.limit_hint`): an OSError's own, or one tensorstore's error
    names in its text (`os_error_code='24'`, or "Too many open files"); else None."""
    if e is None:
        return None
    code = e.errno if isinstance(e, OSError) else None
    if code is None and not isinstance(e, OSError):
        text = str(e)
        found = re.search(r"os_error_code='(\d+)'", text)
        code = (int(found.group(1)) if found
                else next((c for c in _LIMITS if os.strerror(c) in text), None))
    return code if limit_hint(code) else None


def limit_reached(what: str, e: BaseException | None, path: Any = None
                  ) -> CheckpointLimitError | None:
    """The error for `what` (e.g. "checkpoint file <path> cannot be read") that `e`
    caused, where `e` is a limit of this process or machine met (open files, memory:
    `_limit_errno`); None for any other error. `path`: the file, if one."""
    code = _limit_errno(e)
    if code is None:
        return None
    return CheckpointLimitError(
        code, f"{what} ([Errno {code}] {os.strerror(code)}): {limit_hint(code)}; this is a "
        "limit of the process, machine or file system, not damage: the checkpoint may be "
        "intact; retry once that is done", path)


def _read_json(p: Path) -> dict[str, Any]:
    """A file `_write_json` wrote; CheckpointCorruptError when it was damaged."""
    try:
        obj = json_loads(read_regular_text(p))
    except PermissionError as e:
        raise not_permitted(p, e) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint file {p} is not valid JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("sha256") != _digest(obj):
        raise CheckpointCorruptError(f"checkpoint file {p} does not match its sha256: it was "
                                     "changed after the save")
    return obj


# -- RNG -------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA where initialised), Python, NumPy."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, pystate, pygauss = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()),
           "python": [version, list(pystate), pygauss],
           "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def decode_rng_state(state: Any) -> tuple:
    """`rng_state()`'s entries as their setters take them, each tried on a scratch
    generator first, so a damaged one is found before any of the process's states
    changes: ValueError naming the entry. A CUDA entry with another count of
    devices than this process sees is left out, as `set_rng_state` would skip it."""
    def tensor(s: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)),
                                dtype=torch.uint8)

    def entry(name: str, decode: Any) -> Any:
        try:
            return decode(state[name])
        except Exception as e:  # bad base64, a short state, wrong types or lengths
            raise ValueError(f"has a damaged 'rng' entry {name!r} ({type(e).__name__}: "
                             f"{e})") from None

    def py(v: Any) -> tuple:
        version, pystate, pygauss = v
        out = (version, tuple(pystate), pygauss)
        random.Random().setstate(out)
        return out

    def numpy(v: Any) -> tuple:
        kind, keys, pos, has_gauss, gauss = v
        out = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss)
        np.random.RandomState().set_state(out)
        return out

    def cpu(v: Any) -> torch.Tensor:
        t = tensor(v)
        torch.Generator().set_state(t)
        return t

    def cuda(v: Any) -> list | None:
        states = [tensor(s) for s in v]
        if not torch.cuda.is_available() or len(states) != torch.cuda.device_count():
            return None
        for i, t in enumerate(states):  # its size, its offset
            torch.Generator(device=f"cuda:{i}").set_state(t)
        return states

    if not isinstance(state, dict):
        raise ValueError("has an 'rng' entry that is not an object")
    return (entry("torch", cpu), entry("python", py), entry("numpy", numpy),
            entry("cuda", cuda) if "cuda" in state else None)


def set_rng_state(decoded: tuple) -> None:
    """Puts back the states `decode_rng_state` checked."""
    cpu, py, numpy, cuda = decoded
    torch.set_rng_state(cpu)
    random.setstate(py)
    np.random.set_state(numpy)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
