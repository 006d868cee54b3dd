"""Errors raised by the I/O layer. Each names the file, the byte range and the fix."""

from __future__ import annotations

import errno as _errno
import os

from ..config import ConfigError


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
        super().__init__(errno or _errno.EIO, msg)
        # OSError.__init__(errno, msg) sets strerror to msg; keep the path too.
        self.filename = self.path

    def __str__(self) -> str:  # OSError's default repeats "[Errno N]" before the message
        return self.strerror


class CorruptionError(IoError):
    """Bytes read back do not match the checksum recorded when they were written."""

    def __init__(self, path: str, offset: int, length: int, expected: int, actual: int) -> None:
        super().__init__("read", path, offset, length, _errno.EIO,
                         f"checksum mismatch: expected {expected:#018x}, got {actual:#018x}; "
                         "the swap file was modified or the disk returned bad data")
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
