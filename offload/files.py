"""Checks of the files and directories a user names, shared by every layer (no
imports from the rest of offload but offload.limits, itself standard library only)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .limits import limit_hint

__all__ = ["check_directory", "existing_ancestor", "fsync_directory", "lock_named",
           "json_loads", "names_open_file", "NotRegularFileError", "open_unblocked",
           "read_regular", "read_regular_text",
           "regular_file_head", "replace_atomically", "unlink_own"]


def check_directory(path: Path, what: str) -> None:
    """Refuses a directory `path` (existing or to be created) that is, or would be
    created under, a file or a symbolic link to a missing target: `FileExistsError`
    naming `what` (the call or option), the file (the link and its target) and the
    fix, where `mkdir` would name neither the file nor the fix."""
    for p in (path, *path.parents):
        if p.is_dir():
            return
        if p.is_symlink() and not p.exists():  # mkdir would call it "File exists"
            raise FileExistsError(f"{what}: {p} is a symbolic link to {_link_end(p)}; "
                                  "create that directory, or remove the link, or give a "
                                  "path under a directory")
        if p.exists() or p.is_symlink():
            raise FileExistsError(f"{what}: {p} is a file, not a directory; give a path "
                                  "under a directory")


def _link_end(link: Path) -> str:
    """What the symbolic link `link` leads to that is missing, for a message."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{os.readlink(link)}, a loop of links that ends nowhere"
    return f"{os.path.realpath(link)}, which does not exist"


def names_open_file(path: str | os.PathLike[str], fd: int) -> bool:
    """Whether `path` still names the file open as `fd`: a lock taken on a file its
    holder removed (or a name another job created anew after the directory was
    removed) locks, or would remove, nothing the name shows; nor does a path through
    what is a file now."""
    try:
        named, open_ = os.stat(path), os.fstat(fd)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (named.st_dev, named.st_ino) == (open_.st_dev, open_.st_ino)


def lock_named(path: str | os.PathLike[str], open_fd: Callable[[], int],
               wait: bool = False) -> int:
    """An exclusive flock on the file `path` names, as a descriptor `open_fd()` opened
    (it creates the file where missing); without `wait`, `BlockingIOError` where
    another holds it. A file its holder removed as it closed, between our open and
    our lock, is not the one the name shows ([names_open_file]): opened anew."""
    while True:
        fd = open_fd()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            if names_open_file(path, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def unlink_own(path: str | os.PathLike[str], fd: int) -> None:
    """Removes `path` if it still names the file open as `fd` ([names_open_file]): a
    file another job made under the same name after this one's was removed stays."""
    if names_open_file(path, fd):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def fsync_directory(directory: Path) -> None:
    """Makes the renames in `directory` durable; a file system that refuses to open or
    sync a directory is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_atomically(target: Path, write: Callable[[BinaryIO], None],
                       mode: int | None = None) -> None:
    """Writes `target` as a whole or not at all: `write(f)` fills a temporary file
    beside it, which is fsynced, given `mode` and renamed over `target`, and the
    directory is fsynced; readers see the old file or the whole new one, a crash
    never leaves an empty one. On any failure (a full disk, Ctrl-C) the temporary
    file is removed and `target` is as it was; one for a limit of the process (open
    files, file size) is an `OSError` naming `target` and the limit."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                   dir=target.parent)
    except OSError as e:
        _raise_limit_named(e, target)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            _raise_limit_named(e, target)
        raise
    fsync_directory(target.parent)


def _raise_limit_named(e: OSError, target: Path) -> None:
    """Where `e` is for a limit of the process, raises one naming `target` and the limit
    (the temporary file's name told the user nothing); else returns, for the caller
    to raise `e` as it is."""
    hint = limit_hint(e.errno)
    if hint:
        raise OSError(e.errno, f"cannot write {target} ({e.strerror}); {hint}") from None


def open_unblocked(path: str | os.PathLike[str]) -> tuple[BinaryIO, int]:
    """`path` opened for reading, and its `st_mode` read from the open file: opened
    without blocking (an ordinary open of a FIFO waits for a writer), and checked on
    what was opened, so a path swapped for a FIFO after a check cannot block. A
    directory raises `IsADirectoryError` naming `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # (fdopen's own error names the descriptor, not the path)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        return os.fdopen(fd, "rb"), mode
    except BaseException:
        os.close(fd)
        raise


class NotRegularFileError(OSError):
    """A FIFO, device or socket where a file's contents were to be read."""


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file `path`; `NotRegularFileError` (EINVAL, "is not a
    regular file") for a FIFO, device or socket, where a plain read would block or
    never end; `IsADirectoryError` for a directory."""
    f, mode = open_unblocked(path)
    with f:
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, "is not a regular file", str(path))
        return f.read()


def read_regular_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    """`read_regular`, decoded."""
    return read_regular(path).decode(encoding)


def json_loads(text: str | bytes, **kw) -> object:
    """`json.loads`, with JSON nested deeper than Python's recursion limit a
    `ValueError` (a damaged or hostile file) rather than a `RecursionError`."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("nested deeper than this reader follows") from None


def regular_file_head(path: str | os.PathLike[str], n: int,
                      gunzip: bool = False) -> bytes | None:
    """The first `n` bytes of `path` (decompressed where `gunzip` and the file is
    gzip), or None where it is not a regular file or cannot be read: what a writer
    looks at before it replaces a file it may only replace if it wrote it."""
    try:
        f, mode = open_unblocked(path)
        with f:
            if not stat.S_ISREG(mode):
                return None
            head = f.read(n)
            if gunzip and head.startswith(b"\x1f\x8b"):
                f.seek(0)
                with gzip.GzipFile(fileobj=f) as gz:
                    head = gz.read(n)
    except (OSError, EOFError):
        return None
    return head


def existing_ancestor(path: str | os.PathLike[str]) -> str:
    """`path`, or its nearest ancestor that exists (a directory made later): where its
    file system, free space or device can be read now."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
