"""Swap space: the NVMe tier's files for one rank and one partition kind.

One file per configured directory, named `offload-<name>.swap`, opened with
O_DIRECT, preallocated with fallocate in `grow_step` units and locked against
a second process. Several directories are striped RAID-0 style: logical byte
`o` lives in file `(o // S) % n` at `(o // S // n) * S + o % S` for stripe
size S, so one large extent is read from every disk at once.

[Note: no data lost]
Space is reserved (fallocate) before an extent is handed out, so running out
of disk raises `SwapFullError` from `alloc()`, before any write, and no
existing extent is touched. A write that fails marks only its own extent as
unreadable; the caller keeps its previous valid copy (the store rewrites to a
fresh extent and frees the old one only after the new write is durable).
"""

from __future__ import annotations

import ctypes
import errno as _errno
import logging
import mmap
import os
import shutil
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import xxhash

from ..files import lock_named, unlink_own
from .engine import DIRECT_ALIGN, IoEngine, Segment
from .errors import (CorruptionError, IoError, SwapFullError, SwapLockedError, SwapPathError,
                     limit_hint, no_space_fix)
from .extents import Extent, ExtentAllocator, positive_bytes
from .handle import IoHandle
from .paths import check_swap_dirs, claim_made, probe_direct, remove_made
from .process import in_owner

log = logging.getLogger(__name__)

__all__ = ["SwapExtent", "SwapLedger", "SwapSpace", "ReadHandle", "probe_direct"]


# errnos of a reservation that did not fit (disk, quota, ulimit -f); others are failures
_FULL = (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# errnos of a file system without fallocate (ext2 and ext3 files, which have no
# extents; some network and FUSE file systems): glibc then writes the blocks itself,
# a byte at a time, which an O_DIRECT descriptor refuses with EINVAL
_NO_FALLOCATE = (_errno.EOPNOTSUPP, _errno.EINVAL)
_ZEROS = 1 << 20  # bytes per write where zeros are written instead


def _preallocate(fd: int, offset: int, length: int) -> None:
    """Reserves `length` bytes of the file at `offset` (both multiples of 4 KiB) on
    disk: with fallocate, or, where the file system has none, by writing zeros, so a
    full disk is still met here, before any data ([Note: no data lost])."""
    try:
        os.posix_fallocate(fd, offset, length)
        return
    except OSError as e:
        if e.errno not in _NO_FALLOCATE or length <= 0:
            raise
    zeros = mmap.mmap(-1, min(length, _ZEROS))  # page-aligned, as O_DIRECT needs
    try:
        with memoryview(zeros) as view:
            done = 0
            while done < length:
                want = min(len(view), length - done)
                if os.pwrite(fd, view[:want], offset + done) < want:
                    # a regular file takes a write short only where the disk is full
                    raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
                done += want
        os.fdatasync(fd)  # a file system that writes back later reports a full disk here
    finally:
        zeros.close()


@dataclass(frozen=True)
class SwapExtent:
    """A reserved range of the logical swap address space (bytes)."""

    offset: int
    length: int  # reserved bytes, a multiple of 4 KiB


class SwapLedger(Protocol):
    """Counts a swap space's extents against a budget (`SwapSpace.ledger`)."""

    def charge(self, nbytes: int) -> None:
        """Counts `nbytes` more, or raises (then nothing is reserved)."""

    def refund(self, nbytes: int) -> None:
        """Counts `nbytes` fewer."""


def _open_owned(path: str, flags: int) -> int:
    """Opens (creating if missing) a swap or lock file, only where the name is a file
    of its own: a symbolic link, or a second name of another file, would have been
    truncated and overwritten through (the user's file lost), and a device or fifo
    written to. Nothing is truncated here; the caller does it once this passed."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == _errno.ELOOP:
            raise SwapPathError(e.errno, f"{path} is a symbolic link; offload would "
                                "overwrite the file it points to, so it refuses: remove the "
                                "link, or give another io.paths directory", path) from None
        fix = limit_hint(e.errno) or (
            no_space_fix(os.path.dirname(path)) if e.errno == _errno.ENOSPC
            else "remove what is there, or give another io.paths directory")
        raise SwapPathError(e.errno or _errno.EIO, f"cannot open swap file {path} "
                            f"([Errno {e.errno}] {e.strerror}); {fix}", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SwapPathError(_errno.EINVAL, f"{path} is not a regular file; offload would "
                                "write into it, so it refuses: remove it, or give another "
                                "io.paths directory", path)
        if st.st_nlink > 1:
            raise SwapPathError(_errno.EMLINK, f"{path} is one of {st.st_nlink} names of a "
                                "file (a hard link); offload would overwrite the file under "
                                "its other name, so it refuses: remove this name, or give "
                                "another io.paths directory", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _alive(pid: str) -> bool:
    """Whether process `pid` (a lock file's text, digits) runs."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process
    return True


def _holders(path: str) -> list[int]:
    """The other processes that have `path` open, as far as /proc shows them.

    [Note: a lock kept by a killed job's child]
    A flock belongs to the open file, which a forked child (a DataLoader worker, a
    multiprocessing child) shares: when a job is killed (SIGKILL, the OOM killer) and
    such a child lives on, the lock stays held while the file still names the dead
    job's pid. "In use by pid N", with no process N, sent the user looking for a job
    that was gone; the message names the processes holding the file instead."""
    try:
        st = os.stat(path)
        pids = [d for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()]
    except OSError:
        return []
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                s = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                out.append(int(pid))
                break
    return sorted(out)


class _SwapFile:
    def __init__(self, path: str, direct: bool) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        try:  # the name's file: one its holder removed as we opened it keeps no job out
            self.lock_fd = lock_named(self.lock_path,
                                      lambda: _open_owned(self.lock_path, os.O_RDWR))
        except BlockingIOError:
            self._refuse_locked(path)
        # The flock dies with its holder, so a lock left by a killed run is
        # free again: we hold it now and take the file over.
        try:
            os.ftruncate(self.lock_fd, 0)
            os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = _open_owned(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
        except BaseException:
            self._close_lock(remove=True, errors=[])
            raise
        try:
            os.ftruncate(self.fd, 0)  # a killed run's bytes are no one's now
        except BaseException:
            os.close(self.fd)
            self._close_lock(remove=True, errors=[])
            raise
        self.size = 0

    def _refuse_locked(self, path: str) -> None:
        """Raises `SwapLockedError` for a lock file another holder has locked, naming
        the holder (the pid the file holds while it is locked)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
        except OSError:  # removed by its holder meanwhile
            owner = "unknown"
        if owner == str(os.getpid()):  # the file holds a pid only while it is locked
            raise SwapLockedError(
                f"swap file {path} is already open in this process (pid {owner}): another "
                "engine, store or swap space here uses the same io.paths directory and "
                "is still open; close it first (engine.close(), or a with block), or "
                "give each its own io.paths directory. An engine no longer bound to a "
                "name stays open while its model (or an output of its forward) is, and "
                "while the updates it started in backward run: `del` "
                "those and run gc.collect()") from None
        holders = _holders(self.lock_path)
        if not owner.isdigit() or _alive(owner) and (not holders or int(owner) in holders):
            raise SwapLockedError(
                f"swap file {path} is in use by another live process (pid {owner}); give "
                "this job its own io.paths directory, or stop the other job") from None
        # [Note: a lock kept by a killed job's child]
        who = (f"pid {', '.join(map(str, holders))}" if holders
               else f"find it with `fuser -v {self.lock_path}`")
        raise SwapLockedError(
            f"swap file {path} is locked by a process that pid {owner} (no longer "
            f"running) started: {who}. A job killed while a DataLoader worker or another "
            "child it forked lives on leaves the lock with that child; stop it and run "
            "again, or give this job its own io.paths directory") from None

    def _close_lock(self, remove: bool, errors: list[OSError]) -> None:
        """Removes (or empties) the lock file and always closes its descriptor; what
        fails is added to `errors`."""
        try:
            if remove:
                unlink_own(self.lock_path, self.lock_fd)
            else:
                os.ftruncate(self.lock_fd, 0)  # a kept lock file names no holder
        except OSError as e:
            errors.append(e)
        try:
            os.close(self.lock_fd)
        except OSError as e:
            errors.append(e)

    def close(self, remove: bool) -> None:
        """Closes both descriptors whatever else fails (a failing disk refuses the
        unlinks: a descriptor left open kept the lock, so the next open in this
        process was refused), then raises the first failure, naming the file."""
        errors: list[OSError] = []
        if remove:  # while open, so that a file made anew under its name stays
            try:
                unlink_own(self.path, self.fd)
            except OSError as e:
                errors.append(e)
        try:
            os.close(self.fd)
        except OSError as e:
            errors.append(e)
        self._close_lock(remove, errors)
        if errors:
            e = errors[0]
            raise OSError(e.errno, f"closing swap file {self.path}: {e.filename or 'close'}: "
                          f"{e.strerror}; check the disk (dmesg) and remove what is left of "
                          f"{self.path} and {self.lock_path} by hand", self.path) from e


def _close_files(files: list[_SwapFile], keep: bool) -> None:
    """Closes (and unless `keep`, removes) swap files; the first error is raised
    after every file was tried."""
    error = None
    while files:
        f = files.pop()
        try:
            f.close(remove=not keep)
        except OSError as e:
            error = error or e
    if error is not None:
        raise error


class ReadHandle:
    """A swap read whose bytes are checked against the write's checksum on `wait()`.

    The bytes in the buffer must not be used before `wait()` returns: until
    then they are unverified.
    """

    def __init__(self, inner: IoHandle, verify: Callable[[], None] | None) -> None:
        self._inner = inner
        self._verify = verify
        self._lock = threading.Lock()
        self._verified = verify is None

    def done(self) -> bool:
        return self._inner.done()

    released = done

    def wait(self, timeout: float | None = None) -> int:
        n = self._inner.wait(timeout)
        if not self._verified:
            with self._lock:
                if not self._verified:
                    self._verify()  # raises CorruptionError; stays unverified then
                    self._verified = True
        return n

    wait_released = wait

    def add_done_callback(self, fn: Callable[[IoHandle], None]) -> None:
        self._inner.add_done_callback(fn)

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes


def _host_span(buffer: object, *, into: bool) -> tuple[int, int]:
    """(address, bytes) of the host memory `buffer` owns from its first byte: a
    HostBuffer, a contiguous CPU torch tensor or a C-contiguous numpy array. `into`:
    the bytes will be written (a read from swap), so a read-only array is refused.

    The engine and the checksum address raw memory, so anything else is refused
    here: a tensor of another device (its data_ptr is no host address: hashing it
    crashed the interpreter), or an expanded or strided view (numel x itemsize bytes
    from its data_ptr run past what it owns: a read overran the allocation)."""
    if hasattr(buffer, "address") and hasattr(buffer, "capacity"):  # HostBuffer
        return int(buffer.address), int(buffer.capacity)
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(f"a {buffer.device.type} tensor has no host memory at its "
                             "data_ptr; swap transfers need host memory: copy it to a "
                             "HostBuffer from BufferPool")
        if buffer.layout != torch.strided:
            raise ValueError(f"a {buffer.layout} tensor has no dense bytes to transfer; "
                             "pass a dense tensor (.to_dense()) or a HostBuffer")
        if not buffer.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(buffer.shape)} and strides "
                             f"{buffer.stride()} is not contiguous; swap transfers need "
                             "contiguous host memory: pass .contiguous() or a HostBuffer")
        return int(buffer.data_ptr()), buffer.numel() * buffer.element_size()
    if hasattr(buffer, "ctypes") and hasattr(buffer, "flags"):  # numpy
        if not buffer.flags.c_contiguous:
            raise ValueError(f"array of shape {buffer.shape} and strides {buffer.strides} is "
                             "not contiguous; swap transfers need contiguous host memory: "
                             "pass np.ascontiguousarray(...) or a HostBuffer")
        if into and not buffer.flags.writeable:
            raise ValueError(f"array of shape {buffer.shape} is read-only and cannot take "
                             "a read; pass a writable array or a HostBuffer")
        return int(buffer.ctypes.data), int(buffer.nbytes)
    raise TypeError(f"cannot take the address of {type(buffer).__name__}; pass a HostBuffer")


def _memory_owner(buffer: object) -> object:
    """What keeps `buffer`'s bytes allocated: a HostBuffer's block tensor (over the
    mapping; it stays mapped after a release or a pool's close), a tensor's storage
    (a `t.set_()` or `del t` no longer frees it), or the array itself. Held by a
    transfer until it is done and by a read's checksum check, which reads the bytes
    on the caller's thread after the handle was finished: holding only the tensor,
    `set_()` freed the storage under the transfer, and a HostBuffer released and its
    pool closed before `wait()` unmapped what the check hashed (the interpreter
    crashed)."""
    if hasattr(buffer, "address") and hasattr(buffer, "capacity"):  # HostBuffer
        return buffer.tensor
    if isinstance(buffer, torch.Tensor):
        return buffer.untyped_storage()
    return buffer


def _check_owned(owner: object, address: int, span: int, what: str) -> None:
    """Raises if `owner` (from `_memory_owner`) no longer holds the `span` bytes at
    `address`: a storage resized (`untyped_storage().resize_(0)`) freed or moved them,
    and reading them would crash the interpreter."""
    if isinstance(owner, torch.UntypedStorage):
        lo = owner.data_ptr()
        if not (lo <= address and address + span <= lo + owner.nbytes()):
            raise ValueError(f"{what}: the tensor's storage was resized or freed while the "
                             f"transfer was in flight ({span} B at {address:#x}, the storage "
                             f"now {owner.nbytes()} B at {lo:#x}); keep a buffer's storage "
                             "as it is until wait() returns")


def _view(address: int, nbytes: int) -> memoryview:
    """`nbytes` of host memory at `address` as a memoryview (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class SwapSpace:
    """Striped, locked, preallocated swap files with an extent allocator.

    `alloc`/`free` reserve byte ranges; `write`/`read` move bytes between an
    extent and a 4 KiB-aligned host buffer (HostBuffer from BufferPool) and
    return handles. Files are removed by `close()` unless `keep=True`.

    [Note: nothing left behind]
    A swap space that is never closed still removes its files: when it is
    garbage-collected, and at interpreter exit (a normal exit, or one by an
    uncaught exception) through `weakref.finalize`. Only a process killed
    outright (SIGKILL) leaves them; the lock then dies with it, and the next run
    on the directory takes the files over.

    [Note: forked children]
    A forked child (a DataLoader worker, a multiprocessing child, `os.fork()`)
    inherits the space: its descriptors, its finalizer and its state, but not the
    threads that complete its transfers, and the files stay the parent's. A child
    that left by `sys.exit()` ran the finalizer's exit hook and removed the
    parent's swap and lock files from under it (the parent's training went on
    through its descriptors, but its lock no longer guarded the names, and the
    next job on the directory took them). So the space remembers the process that
    opened it, and in any other one the finalizer and `close()` leave the files
    as they are; the child's copies of the descriptors close when it exits, and
    the lock stays the parent's (a flock belongs to the open file, which the
    parent still holds).
    """

    def __init__(self, paths: list[str], name: str, engine: IoEngine, *,
                 stripe_size: int = 1 << 20, grow_step: int = 256 << 20, max_size: int = 0,
                 checksum: bool = True) -> None:
        if not paths:
            raise ValueError("SwapSpace needs at least one directory (io.paths)")
        if stripe_size % DIRECT_ALIGN or grow_step % stripe_size:
            raise ValueError(f"stripe_size {stripe_size} must be a multiple of {DIRECT_ALIGN} "
                             f"and grow_step {grow_step} a multiple of stripe_size")
        self.name = name
        self.engine = engine
        self._pid = os.getpid()  # [Note: forked children]
        self.stripe = stripe_size
        self.grow_step = grow_step
        self.max_size = max_size
        self.checksum = checksum
        self._lock = threading.Lock()
        # [Note: closing with transfers in flight]
        self._idle = threading.Condition(self._lock)  # notified as transfers start and end
        self._starting = 0  # transfers between the closed check and their tracking
        self._busy: set[IoHandle] = set()  # transfers the engine has not finished
        self._closed = False
        self._alloc = ExtentAllocator(0, DIRECT_ALIGN)
        self._sums: dict[int, tuple[int, int] | None] = {}  # extent offset -> (nbytes, xxh3)
        # extent offset -> (nbytes, xxh3, handle) of its last write until `_sums` has it:
        # [Note: a write is readable once it is done]
        self._writes: dict[int, tuple[int, int, IoHandle]] = {}
        self._files: list[_SwapFile] = []
        # charged for every extent alloc() reserves and refunded when it is freed: the
        # store's NVME budget ([Note: optimizer extents] in offload/store/store.py)
        self.ledger: SwapLedger | None = None
        try:
            self._open_files(paths, name)
        except BaseException:
            try:
                _close_files(self._files, keep=False)
            finally:  # [Note: directories made before the lock] in paths.py
                remove_made(claim_made(paths))
            raise
        claim_made(paths)  # its files are there: the directories stay, as after a run
        # [Note: nothing left behind]; holds the file list, never `self`
        self._finalizer = weakref.finalize(self, in_owner, self._pid, _close_files,
                                           self._files, False)

    def _open_files(self, paths: list[str], name: str) -> None:
        """Checks the directories, then opens and locks a swap file in each."""
        engine = self.engine
        for d in check_swap_dirs(paths, direct=engine.direct):  # before any file is made
            if engine.direct and not d.direct:
                raise SwapPathError(_errno.EINVAL, f"io.paths: {d.why}, and the {engine.name} "
                                    "engine opens swap files with O_DIRECT; point io.paths at "
                                    "a disk-backed file system, or set io.direct = false",
                                    d.path)
        for d in paths:  # absolute: close() removes these names after any os.chdir()
            self._files.append(_SwapFile(os.path.join(os.path.abspath(d),
                                                      f"offload-{name}.swap"), engine.direct))

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self._files]

    @property
    def capacity(self) -> int:
        """Logical bytes reserved on disk (all files together)."""
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    # -- space ---------------------------------------------------------------
    def alloc(self, nbytes: int, *, counted: bool = True) -> SwapExtent:
        """Reserves an extent for `nbytes`; grows the files first if needed. `counted`:
        charged to the space's `ledger` (False: the caller counts it itself).

        Raises `SwapFullError` (and changes nothing) when the disk, the file-size
        limit or `io.max_swap_size` cannot hold it.
        """
        nbytes = positive_bytes(nbytes, "swap extent size")
        ledger, length = self.ledger if counted else None, _round_up(nbytes, DIRECT_ALIGN)
        if ledger is not None:
            ledger.charge(length)  # outside self._lock: the ledger takes its owner's lock
        try:
            with self._lock:
                self._check_open()
                ext = self._alloc.alloc(nbytes)
                if ext is None:
                    self._grow(nbytes)
                    ext = self._alloc.alloc(nbytes)
                    if ext is None:
                        raise RuntimeError(f"swap {self.name}: grew to {self.capacity} B but "
                                           f"{nbytes} B still do not fit ({self._alloc})")
                self._sums[ext.offset] = None
        except BaseException:
            if ledger is not None:
                ledger.refund(length)
            raise
        return SwapExtent(ext.offset, ext.length)

    def free(self, extent: SwapExtent, *, counted: bool = True) -> None:
        """Returns an extent (`counted` as it was allocated); the caller guarantees no
        transfer on it is in flight."""
        with self._lock:
            self._alloc.free(Extent(extent.offset, extent.length))
            self._sums.pop(extent.offset, None)
            self._writes.pop(extent.offset, None)
        if counted and self.ledger is not None:
            self.ledger.refund(extent.length)

    def _grow(self, need: int) -> None:
        """Grows by io.grow_step, or by what `need` takes if more; where that step does
        not fit (io.max_swap_size, the disk) or would take more than half of a disk's
        free space, by only what `need` takes ([Note: growth on a nearly full disk])."""
        unit = self.stripe * len(self._files)
        least = _round_up(self._alloc.required_capacity(need), unit)
        step = _round_up(self.capacity + self.grow_step, unit)
        if step > least and (not self.max_size or step <= self.max_size) \
                and self._leaves_room(step):
            try:
                return self._reserve(step, need)
            except SwapFullError:
                pass  # the least may still fit the disk
        if self.max_size and least > self.max_size:
            usable = self.max_size // unit * unit  # whole stripe rows
            raise SwapFullError("alloc", self._files[0].path, self.capacity, need, _errno.ENOSPC,
                                f"io.max_swap_size={self.max_size} bytes would be exceeded "
                                f"({self.used_bytes} in use of the {usable} it allows: whole "
                                f"rows of io.stripe_size x {len(self._files)} io.paths); "
                                "raise it or keep less on NVMe")
        self._reserve(least, need)

    def _leaves_room(self, new_cap: int) -> bool:
        """[Note: growth on a nearly full disk]
        A file grown a whole io.grow_step ahead of its need holds space the other swap
        files (the store's other kinds, the optimizer's) may need next: on a disk with
        room for the state but not for every file's step (256 MiB each by default), the
        first files to grow took it and a later one failed for want of space. A step
        is taken only where each file's growth is at most half of its disk's free
        space; otherwise the file grows by what it needs."""
        per_file = new_cap // len(self._files)
        for f in self._files:
            grow = per_file - f.size
            if grow <= 0:
                continue
            try:
                free = shutil.disk_usage(os.path.dirname(f.path)).free
            except OSError:
                continue  # the reservation itself reports a disk that fails
            if grow > free // 2:
                return False
        return True

    def _reserve(self, new_cap: int, need: int) -> None:
        """Extends every file to its share of `new_cap` bytes, or none of them."""
        n = len(self._files)
        per_file = new_cap // n
        done: list[_SwapFile] = []
        for f in self._files:
            try:
                _preallocate(f.fd, f.size, per_file - f.size)
            except OSError as e:
                for g in done + [f]:  # give back what this attempt reserved
                    try:
                        os.ftruncate(g.fd, g.size)
                    except OSError as undo:  # the file only stays longer than used
                        log.warning("could not shrink %s back to %d bytes: %s", g.path,
                                    g.size, undo)
                if e.errno not in _FULL:
                    raise IoError("alloc", f.path, f.size, per_file - f.size, e.errno,
                                  "cannot reserve swap space: the disk failed, not full; "
                                  "check the disk (dmesg) and the path") from None
                free = shutil.disk_usage(os.path.dirname(f.path)).free
                why = ("cannot reserve swap space" if limit_hint(e.errno)  # IoError adds it
                       else f"cannot reserve swap space: {free} bytes free in "
                            f"{os.path.dirname(f.path)}; free disk space, or add a directory "
                            "to io.paths")
                raise SwapFullError("alloc", f.path, f.size, per_file - f.size, e.errno,
                                    why) from None
            done.append(f)
        for f in self._files:
            f.size = per_file
        self._alloc.grow(new_cap)

    # -- data ----------------------------------------------------------------
    def _segments(self, offset: int, length: int, address: int) -> list[Segment]:
        n = len(self._files)
        if n == 1:
            f = self._files[0]
            return [Segment(f.fd, f.path, offset, address, length)]
        segs = []
        pos = offset
        end = offset + length
        while pos < end:
            k, within = divmod(pos, self.stripe)
            take = min(self.stripe - within, end - pos)
            f = self._files[k % n]
            segs.append(Segment(f.fd, f.path, (k // n) * self.stripe + within,
                                address + (pos - offset), take))
            pos += take
        return segs

    def _check_extent(self, extent: SwapExtent) -> None:
        """Refuses an extent `alloc` did not hand out as it is, the lock held: one made
        up, freed, or given a longer length than reserved (a write through it ran over
        the next extent and destroyed its bytes)."""
        if extent.offset not in self._sums or \
                Extent(extent.offset, extent.length) not in self._alloc:
            raise ValueError(f"extent {extent} is not allocated in swap {self.name} (pass "
                             "an extent from alloc(), as it was returned, until free())")

    def _check_range(self, extent: SwapExtent, nbytes: int, buffer: object, *,
                     into: bool) -> tuple[int, int]:
        """(span, address): the bytes a transfer of `nbytes` moves, and where."""
        nbytes = positive_bytes(nbytes, "a transfer's size")
        if nbytes > extent.length:
            raise ValueError(f"{nbytes} bytes do not fit extent {extent}")
        span = _round_up(nbytes, DIRECT_ALIGN)
        address, cap = _host_span(buffer, into=into)
        if cap < span:
            raise ValueError(f"buffer of {cap} bytes cannot take {span} bytes ({nbytes} "
                             f"rounded up to a multiple of {DIRECT_ALIGN}); allocate it from "
                             "BufferPool")
        return span, address

    def write(self, extent: SwapExtent, buffer: object, nbytes: int) -> IoHandle:
        """Writes the first `nbytes` of `buffer` to `extent`; returns the handle.

        The buffer must stay unchanged until `handle.wait_released()`. A write refused
        here (it raises) moved nothing: the extent still reads back its last write.
        """
        span, address = self._check_range(extent, nbytes, buffer, into=False)
        with self._lock:
            self._check_extent(extent)
            before = self._sums[extent.offset]
            self._sums[extent.offset] = None  # unreadable until this write succeeds
        try:
            handle, _ = self._submit("write", extent.offset, span, address, buffer)
        except BaseException:
            with self._lock:  # nothing was written: the last write is still there
                if extent.offset in self._sums and self._sums[extent.offset] is None:
                    self._sums[extent.offset] = before
            raise
        digest = xxhash.xxh3_64_intdigest(_view(address, nbytes)) if self.checksum else 0
        with self._lock:
            if extent.offset in self._sums:
                self._writes[extent.offset] = (nbytes, digest, handle)
        handle.add_done_callback(lambda h, offset=extent.offset: self._record(offset, h))
        return handle

    # [Note: closing with transfers in flight]
    # Closing a swap file's descriptor under a transfer still queued on it failed
    # the transfer (EBADF) or, once the number was reused by a file opened
    # meanwhile, wrote into that file. So every transfer is tracked from the check
    # that the space is open (`_starting`) until the engine finishes it (`_busy`),
    # and `close()` marks the space closed, then waits for both to drain before it
    # closes a file. The engine finishes every request it accepted, failed or not.

    def _check_open(self) -> None:
        """The lock held."""
        if self._closed:
            raise RuntimeError(f"swap {self.name} is closed")

    def _submit(self, op: str, offset: int, span: int, address: int,
                buffer: object) -> tuple[IoHandle, list[Segment]]:
        with self._lock:
            self._check_open()
            self._starting += 1
            segments = self._segments(offset, span, address)
        handle = None
        try:
            handle = self.engine.submit(op, segments,
                                        keepalive=(buffer, _memory_owner(buffer)))
        finally:
            with self._lock:
                self._starting -= 1
                if handle is not None and not handle.done():
                    self._busy.add(handle)
                self._idle.notify_all()
        handle.add_done_callback(self._finished)
        return handle, segments

    def _finished(self, handle: IoHandle) -> None:
        with self._lock:
            self._busy.discard(handle)
            self._idle.notify_all()

    # [Note: a write is readable once it is done]
    # A handle is done (its `wait()` returns) before its callbacks run, on the
    # engine's thread, so `_record` may not have run yet when the writer goes on
    # and reads the extent back (the optimizer's commit waits for its writes,
    # installs their extents, and the next step's read-ahead reads them at once).
    # The extent's last write is therefore kept until recorded, and a read of an
    # extent whose write is done records it first; only a write still in flight
    # or failed leaves it unreadable.

    def _record(self, offset: int, h: IoHandle) -> None:
        with self._lock:
            write = self._writes.get(offset)
            if write is not None and write[2] is h:  # else a later write took its place
                self._settle(offset)

    def _settle(self, offset: int) -> tuple[int, int] | None:
        """The extent's checksum record, taking its last write's once that is done (and
        succeeded); the lock held."""
        write = self._writes.get(offset)
        if write is not None and write[2].done():
            del self._writes[offset]
            if write[2].error is None and offset in self._sums:
                self._sums[offset] = write[:2]
        return self._sums.get(offset)

    def read(self, extent: SwapExtent, buffer: object, nbytes: int | None = None) -> ReadHandle:
        """Reads what was last written to `extent` into `buffer`; returns the handle.

        `wait()` raises `CorruptionError` if the bytes differ from what was
        written, and `IoError` if the extent's last write failed.
        """
        with self._lock:
            self._check_open()
            self._check_extent(extent)
            rec = self._settle(extent.offset)
        if rec is None:
            raise IoError("read", self._files[0].path, extent.offset, extent.length, _errno.EIO,
                          "this extent holds no completed write (never written, still being "
                          "written, or its last write failed)")
        written, digest = rec
        nbytes = written if nbytes is None else nbytes
        if nbytes != written:
            raise ValueError(f"extent {extent} holds {written} bytes, asked to read {nbytes}")
        span, address = self._check_range(extent, nbytes, buffer, into=True)
        inner, segments = self._submit("read", extent.offset, span, address, buffer)
        if not self.checksum:
            return ReadHandle(inner, None)
        first = segments[0]
        owner = _memory_owner(buffer)  # [Note: buffer lifetime]: the check reads the bytes

        def verify() -> None:
            _check_owned(owner, address, span, f"read of {nbytes} B from {first.path}")
            actual = xxhash.xxh3_64_intdigest(_view(address, nbytes))
            if actual != digest:
                raise CorruptionError(first.path, first.offset, nbytes, digest, actual,
                                      [(s.path, s.offset, s.length) for s in segments])
        return ReadHandle(inner, verify)

    def close(self, keep: bool = False) -> None:
        """Closes (and unless `keep`, removes) the swap files, once the transfers in
        flight finished ([Note: closing with transfers in flight]). Idempotent. Later
        alloc, write and read raise; free still returns extents, so owners may tear
        down in any order. In a forked child it closes nothing of the parent's
        ([Note: forked children])."""
        if os.getpid() != self._pid:  # the lock may have been held at the fork
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            if (self._starting or self._busy) and self.engine.on_completion_thread():
                # A done callback on the engine's thread: the transfers close() waits
                # for need this thread (AIO's one reaper) to finish, so it hung for good.
                raise RuntimeError(f"swap {self.name}: close() called on the "
                                   f"{self.engine.name} engine's completion thread (from a "
                                   f"done callback) with {len(self._busy) + self._starting} "
                                   "transfer(s) in flight would wait for itself; close it "
                                   "from another thread")
            self._closed = True
            while self._starting or self._busy:
                self._idle.wait()
            if not self._finalizer.detach():
                return  # the finalizer ran (interpreter exit)
            files = list(self._files)
            self._files.clear()
        _close_files(files, keep)

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
