"""Swap directories: checked before any swap file is created or overwritten.

`check_swap_dirs` runs where swap files are opened (`choose_engine`, before
the engine is built, and `SwapSpace`) and refuses, with the key, the path, the
real errno and the fix:

  * an entry that exists and is not a directory, or cannot be created (a
    component is a file, the parent is not writable, a read-only file system);
  * the same directory listed twice, also under two spellings or through a
    symlink or a bind mount (compared by device and inode);
  * a directory where files cannot be created (permissions, read-only mount);
  * with O_DIRECT asked for, it reports whether the file system takes it and,
    if not, why (the errno of the refused open or write).

[Note: the O_DIRECT probe]
The probe file is created without O_DIRECT (so a file system that refuses
O_DIRECT cannot leave it behind half-opened), then opened a second time with
O_DIRECT and written one aligned block; it is removed on every way out.
Checks that touch nothing (types, existence, duplicates) run for every path
before the first directory is created, and directories this check created are
removed again when a later path fails.

[Note: directories made before the lock]
The check runs, and creates what is missing, before any swap file is locked: in
`make_engine` first, then in each `SwapSpace`, which locks its files. A directory
made for a run whose lock was then refused (another process uses a later path:
`SwapLockedError`) stayed, empty. So the directories this process's checks made
are remembered until a swap space has opened its files in them (`claim_made`), and
a swap space that fails to open removes those of its paths (`remove_made`: only
empty ones go). `probe_direct` forgets its own: the directory is the caller's.
"""

from __future__ import annotations

import errno as _errno
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Iterable

from ..config import ConfigError
from .engine import DIRECT_ALIGN
from .errors import SwapPathError, limit_hint, no_space_fix

__all__ = ["SwapDir", "check_swap_dirs", "claim_made", "probe_direct", "remove_made"]

_PERMISSION = (_errno.EACCES, _errno.EPERM, _errno.EROFS)

# [Note: directories made before the lock]: absolute paths, under _made_lock
_made: set[str] = set()
_made_lock = threading.Lock()


@dataclass(frozen=True)
class SwapDir:
    """One checked swap directory."""

    path: str     # as configured
    real: str     # with symlinks resolved
    direct: bool  # the file system takes O_DIRECT (False where it was not asked for)
    why: str      # a sentence on O_DIRECT, for a log line


def _oserror(e: OSError, key: str, path: str, what: str, fix: str) -> SwapPathError:
    return SwapPathError(e.errno or _errno.EIO, f"{key}: {path!r}: {what} "
                         f"([Errno {e.errno}] {e.strerror}); {fix}", path)


def _fix_for(err: int, where: str) -> str:
    """The fix for `err`, met creating a file or directory in the directory `where`."""
    if err == _errno.EROFS:
        return "the file system is mounted read-only; give a directory on a writable disk"
    if err in (_errno.EACCES, _errno.EPERM):
        return ("this user may not write there; change its permissions (chmod/chown) or "
                "give another directory")
    if err == _errno.ENOSPC:  # out of inodes reads the same as a full disk
        return no_space_fix(where)
    if limit_hint(err):  # a limit of the process (open files), not of the directory
        return limit_hint(err)
    return "give a directory on a local, writable disk"


def _missing_parts(path: str, key: str) -> tuple[list[str], str]:
    """(directories to create, deepest first; the nearest existing ancestor)."""
    missing = []
    p = os.path.abspath(path)
    while True:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):  # missing, or under a file: go up
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                raise
            p = parent
            continue
        except OSError as e:
            raise _oserror(e, key, path, f"cannot look at {p}",
                           _fix_for(e.errno or 0, p)) from None
        if not stat.S_ISDIR(st.st_mode):
            if not missing:
                raise SwapPathError(_errno.ENOTDIR, f"{key}: {path!r} exists and is not a "
                                    "directory; give a directory (it is created if missing)",
                                    path)
            raise SwapPathError(_errno.ENOTDIR, f"{key}: {path!r} cannot be created: {p} is "
                                "a file, not a directory; give another directory", path)
        return missing, p


def _identity(path: str, missing: list[str], ancestor: str) -> tuple:
    """What makes two entries the same directory: device and inode where it exists,
    else the resolved path it will have."""
    if not missing:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    rest = os.path.relpath(os.path.abspath(path), ancestor)
    return ("path", os.path.normpath(os.path.join(os.path.realpath(ancestor), rest)))


def _probe(directory: str, key: str, direct: bool) -> tuple[bool, str]:
    """Creates and removes a probe file; see [Note: the O_DIRECT probe]."""
    probe = os.path.join(directory, f".offload-probe-{os.getpid()}-{threading.get_ident()}")
    try:  # only this thread makes this name: one there is its own, left by a killed probe
        os.unlink(probe)
    except OSError:  # none there (or a directory that refuses: the open below says so)
        pass
    made = True  # the open inside the `try`: a Ctrl-C right after it leaves no file behind
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            made = False
            raise _oserror(e, key, directory, "cannot create files in it",
                           _fix_for(e.errno or 0, directory)) from None
        os.close(fd)
        if not direct:
            return False, "O_DIRECT not asked for (io.direct = false)"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise _oserror(e, key, directory, "cannot open a file in it",
                               _fix_for(e.errno or 0, directory)) from None
            return False, f"{directory} refuses O_DIRECT ([Errno {e.errno}] {e.strerror})"
        buf = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned, as O_DIRECT needs
        try:
            os.pwrite(fd, buf, 0)
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise _oserror(e, key, directory, "cannot write a file in it",
                               _fix_for(e.errno or 0, directory)) from None
            return False, (f"{directory} refuses O_DIRECT writes ([Errno {e.errno}] "
                           f"{e.strerror})")
        finally:
            buf.close()
            os.close(fd)
        return True, f"{directory} accepts O_DIRECT"
    finally:
        if made:
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass


def check_swap_dirs(paths: list[str], *, direct: bool = True,
                    key: str = "io.paths") -> list[SwapDir]:
    """Checks (and creates where missing) the swap directories `paths`.

    Raises `SwapPathError` (an OSError and a ConfigError, with errno and path)
    for a directory that cannot hold swap files, `ConfigError` for an empty or
    repeated entry. With `direct`, each result says whether O_DIRECT works there.
    """
    if not paths:
        raise ConfigError(f"{key}: empty; give at least one directory for swap files")
    plans = []
    seen: dict[tuple, int] = {}
    for i, p in enumerate(paths):  # nothing is created until every path passed these
        k = f"{key}[{i}]" if len(paths) > 1 or key == "io.paths" else key
        if not isinstance(p, str) or not p.strip():
            raise ConfigError(f"{k}: {p!r} names no directory; give a directory for swap "
                              "files such as './offload-swap'")
        missing, ancestor = _missing_parts(p, k)
        ident = _identity(p, missing, ancestor)
        if ident in seen:
            j = seen[ident]
            raise ConfigError(f"{k}: {p!r} is the same directory as {key}[{j}] "
                              f"({paths[j]!r}), both {os.path.realpath(p)}; list each "
                              "directory once")
        seen[ident] = i
        plans.append((k, p, missing))
    created: list[str] = []
    try:
        out = []
        for k, p, missing in plans:
            for d in reversed(missing):  # parents first
                try:
                    os.mkdir(d, 0o755)
                except FileExistsError:
                    continue  # made meanwhile (another rank): fine if it is a directory
                except OSError as e:
                    raise _oserror(e, k, p, f"cannot create directory {d}",
                                   _fix_for(e.errno or 0, os.path.dirname(d))) from None
                created.append(d)
            if not os.path.isdir(p):
                raise SwapPathError(_errno.ENOTDIR, f"{k}: {p!r} is not a directory; give a "
                                    "directory", p)
            ok, why = _probe(p, k, direct)
            out.append(SwapDir(p, os.path.realpath(p), ok, why))
    except BaseException:
        remove_made(reversed(created))  # what this call made, deepest first
        raise
    with _made_lock:
        _made.update(created)
    return out


def claim_made(paths: list[str]) -> list[str]:
    """The directories this process's checks made for `paths` (and their parents they
    made) that no swap space has opened files in since, deepest first; forgotten
    here ([Note: directories made before the lock])."""
    mine = set()
    with _made_lock:
        for p in paths:
            d = os.path.abspath(p)
            while d in _made:
                mine.add(d)
                d = os.path.dirname(d)
        _made.difference_update(mine)
    return sorted(mine, key=lambda d: d.count(os.sep), reverse=True)


def remove_made(dirs: Iterable[str]) -> None:
    """Removes each of the directories `dirs`, in order, where it is empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def probe_direct(directory: str, key: str = "directory") -> tuple[bool, str]:
    """(ok, why): whether files under `directory` accept O_DIRECT (older tmpfs and
    ramfs do not). Creates the directory if missing; raises `SwapPathError`, naming
    `key`, when it cannot hold files at all (not a directory, not writable)."""
    (d,) = check_swap_dirs([directory], direct=True, key=key)
    claim_made([directory])  # the caller's now, not a swap space's to remove
    return d.direct, d.why
