"""Errors raised by the I/O layer. Each names the file, the byte range and the fix."""

from __future__ import annotations

import errno as _errno
import os
import resource
from typing import Sequence

from ..config import ConfigError
from ..limits import limit_hint


class IoError(OSError):
    """A read or write that failed or transferred fewer bytes than asked.

    Carries ``path``, ``offset`` and ``length`` (bytes) of the request and the
    OS error number and message when there is one.
    """

    def __init__(self, op: str, path: str, offset: int, length: int, errno: int | None = None,
                 detail: str = "") -> None:
        self.op = op
        self.path = str(path)
        self.offset = offset
        self.length = length
        reason = os.strerror(errno) if errno else "short transfer"
        msg = f"{op} of {length} bytes at offset {offset} in {self.path} failed: {reason}"
        if detail:
            msg += f" ({detail})"
        if limit_hint(errno):
            msg += f"; {limit_hint(errno)}"
        super().__init__(errno or _errno.EIO, msg)
        # OSError.__init__(errno, msg) sets strerror to msg; keep the path too.
        self.filename = self.path

    def __str__(self) -> str:  # OSError's default repeats "[Errno N]" before the message
        return self.strerror

    def within(self, what: str) -> "IoError":
        """This error again, of its type (a `SwapFullError` stays one) and with its fields,
        its message led by `what`, the operation it failed: for the caller of that
        operation to raise from this one, where the operation's own error type would
        send the user the wrong way (a budget's, for a disk that failed)."""
        again = type(self).__new__(type(self))
        again.__dict__.update(self.__dict__)
        if "__notes__" in self.__dict__:  # a list of its own: a note on one is not the other's
            again.__notes__ = list(self.__notes__)
        OSError.__init__(again, self.errno, f"{what}: {self}")
        again.filename = self.filename
        return again


def out_of_inodes(directory: str) -> bool:
    """Whether the file system of `directory` has no inode (file) left to give: a
    create there fails with ENOSPC, as on a full disk, while `df` shows space free.
    False where it cannot be asked, or counts no inodes (btrfs makes them as needed)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_files > 0 and (st.f_favail == 0 or st.f_ffree == 0)


def no_space_fix(directory: str) -> str:
    """The fix for ENOSPC where a file or directory was created in `directory`: out of
    inodes, or a full disk ([out_of_inodes])."""
    if out_of_inodes(directory):
        return ("its file system is out of inodes (files), though it may have space free "
                "(df -i shows it): remove files on that file system or give a directory on "
                "another one")
    return "the disk is full; free space or give a directory on another disk"


def past_fsize_limit(end: int) -> bool:
    """Whether a write that stopped at byte `end` of its file met this process's file
    size limit (RLIMIT_FSIZE): the kernel then writes up to the limit and returns a
    short count, not EFBIG (which only a write wholly past it gets)."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft != resource.RLIM_INFINITY and end >= soft


class AioSetupError(OSError):
    """Linux AIO refused a new context (io_setup): the machine's AIO request slots
    (fs.aio-max-nr, shared by every process) are used up, or the kernel has no AIO.
    Carries the errno; the message names the limit and the fixes."""

    def __init__(self, errno: int, queue_depth: int) -> None:
        what = f"Linux AIO refused a queue of {queue_depth} requests (io_setup: " \
               f"[Errno {errno}] {os.strerror(errno)})"
        fix = "lower io.queue_depth, or set io.engine = 'threads' (or 'auto', which then uses it)"
        if errno == _errno.EAGAIN:
            used, most = _read_sysctl("fs/aio-nr"), _read_sysctl("fs/aio-max-nr")
            msg = (f"{what}: the machine's AIO request slots are used up ({used} of "
                   f"fs.aio-max-nr = {most} taken, by every process on it together, a queue "
                   f"taking its depth of them); raise the limit as root (sysctl -w "
                   f"fs.aio-max-nr=1048576), {fix}")
        else:
            msg = f"{what}; {fix}"
        super().__init__(errno, msg)

    def __str__(self) -> str:
        return self.strerror


def _read_sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/{name}") as f:
            return f.read().strip()
    except OSError:
        return "?"


class CorruptionError(IoError):
    """Bytes read back do not match the checksum recorded when they were written."""

    def __init__(self, path: str, offset: int, length: int, expected: int, actual: int,
                 spans: Sequence[tuple[str, int, int]] = ()) -> None:
        """`spans`: (file, offset, bytes) of each piece of a striped extent; where they
        are in several files, the message names each (any of them may hold the change)."""
        files = dict.fromkeys(p for p, _, _ in spans)
        where = "" if len(files) < 2 else "; the extent is striped over " + ", ".join(
            f"{p} ({sum(n for q, _, n in spans if q == p)} bytes from offset "
            f"{min(o for q, o, _ in spans if q == p)})" for p in files)
        super().__init__("read", path, offset, length, _errno.EIO,
                         f"checksum mismatch: expected {expected:#018x}, got {actual:#018x}; "
                         f"the swap file was modified or the disk returned bad data{where}")
        self.expected = expected
        self.actual = actual


class SwapFullError(IoError):
    """The swap space cannot hold a new extent (disk full, quota or file-size limit)."""


class SwapPathError(OSError, ConfigError):
    """A swap directory (io.paths) cannot hold swap files: it is not a directory,
    cannot be created, is not writable, or refuses what io.direct asks. An OSError
    with the real ``errno`` and ``filename``, and a ConfigError (bad input, found
    before any swap file is created); the message names the key and the fix."""

    def __init__(self, errno: int, message: str, path: str) -> None:
        super().__init__(errno, message)
        self.filename = str(path)

    def __str__(self) -> str:
        return self.strerror


class SwapLockedError(RuntimeError):
    """Another live process holds the lock on a swap file."""


class PoolExhaustedError(RuntimeError):
    """The buffer pool's byte budget cannot satisfy an allocation."""
