"""Block I/O engines: Linux AIO (`AioEngine`) and a thread pool (`ThreadEngine`).

Both take a request as a list of `Segment`s (a file range and a host address),
split it into blocks of `block_size` bytes, keep up to `queue_depth` blocks in
flight, and complete the request's `IoHandle` when its last block finishes
(after fdatasync for writes when `sync_writes` is on). Results are checked
block by block; a negative result, an errno or a short transfer becomes an
`IoError` naming the file, offset and length.

[Note: buffer lifetime]
The engine addresses memory by raw address. The caller passes the object that
owns the memory as `keepalive`; the handle holds it until the request is done,
and the caller must not reuse the buffer before `wait_released()` returns.
"""

from __future__ import annotations

import abc
import collections
import ctypes
import errno
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

from ..trace import NULL_RECORDER, TraceRecorder
from .errors import AioSetupError, IoError, past_fsize_limit
from .handle import IoHandle
from .process import in_owner

log = logging.getLogger(__name__)

__all__ = ["Segment", "IoEngine", "AioEngine", "ThreadEngine", "libaio_status", "DIRECT_ALIGN"]

DIRECT_ALIGN = 4096  # O_DIRECT needs offset, address and length aligned to the logical block


class Segment(NamedTuple):
    """One contiguous transfer between a file range and host memory."""

    fd: int
    path: str
    offset: int   # bytes into the file
    address: int  # host address of the first byte
    length: int   # bytes


class _Block(NamedTuple):
    handle: IoHandle
    seg: Segment
    sync_fds: tuple[int, ...]  # files to fdatasync once the handle's last block is written
    expect: int  # bytes the block must transfer: its length, less what lies past `eof`


class _Sync(NamedTuple):
    handle: IoHandle
    fd: int


_ADDRESS_END = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))

# The engine whose completions the current thread runs (done callbacks included), so
# that a call that would wait for this engine's transfers from here refuses instead
# of waiting for itself (`IoEngine.on_completion_thread`).
_completing = threading.local()


def _check_segment(seg: Segment, describe: str) -> None:
    """Refuses a segment no file or memory can hold, before anything is submitted: an
    address past the address space made the thread engine's worker raise where no
    one saw it (the handle never finished), a negative length completed as a
    transfer of negative bytes."""
    if seg.offset < 0 or seg.length < 0:
        raise ValueError(f"{describe}: offset ({seg.offset}) and length ({seg.length}) "
                         "must be non-negative byte counts")
    if seg.length and not 0 < seg.address <= _ADDRESS_END - seg.length:
        raise ValueError(f"{describe}: address {seg.address:#x} with length {seg.length} "
                         "is not host memory; pass the address of a live buffer "
                         "(HostBuffer.address)")


def libaio_status() -> tuple[bool, str]:
    """(usable, why): whether the libaio package and the system's libaio.so.1 load."""
    try:
        import libaio  # noqa: F401  (loads libaio.so.1 through ctypes)
    except ImportError as e:
        return False, f"the libaio Python package is not installed ({e})"
    except OSError as e:
        return False, (f"libaio.so.1 could not be loaded ({e}); install it with "
                       "'apt-get install libaio1' (Debian/Ubuntu)")
    return True, "libaio loaded"


class IoEngine(abc.ABC):
    """Common request splitting, checking and completion; subclasses move blocks."""

    name = "base"

    def __init__(self, *, block_size: int = 1 << 20, queue_depth: int = 16,
                 sync_writes: bool = True, direct: bool = True,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        if block_size <= 0 or block_size % DIRECT_ALIGN:
            raise ValueError(f"block_size {block_size} must be a positive multiple of {DIRECT_ALIGN}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth {queue_depth} must be >= 1")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.sync_writes = sync_writes
        self.direct = direct
        self.recorder = recorder
        self._closed = False
        self._pid = os.getpid()  # [Note: forked children] in swap.py

    # -- public ----------------------------------------------------------------
    def submit(self, op: str, segments: Sequence[Segment], *, keepalive: object = None,
               sync: bool | None = None, eof: int | None = None) -> IoHandle:
        """Starts a read or write of all `segments`; returns its handle at once. `eof`
        (reads only): the file's length, where a segment rounded up to the O_DIRECT
        alignment reaches past the file's end; the bytes past it are not read and the
        read is whole without them."""
        if op not in ("read", "write"):
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        if self._closed:
            raise RuntimeError(f"{self.name} engine is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this {self.name} I/O engine belongs to process {self._pid}, and this is a "
                f"forked child of it (pid {os.getpid()}): the threads or AIO context that "
                "complete its transfers are the parent's; open an engine in the child "
                "itself, or do the I/O in the parent")
        total = sum(s.length for s in segments)
        first = segments[0] if segments else None
        describe = f"{op} {total} B" + (f" at {first.path}:{first.offset}" if first else "")
        handle = IoHandle(op, total, describe, keepalive)
        sync = self.sync_writes if sync is None else sync
        fds = tuple(sorted({s.fd for s in segments})) if op == "write" and sync else ()
        blocks = []
        for seg in segments:
            _check_segment(seg, describe)
            if self.direct and (seg.offset | seg.address | seg.length) % DIRECT_ALIGN:
                raise ValueError(f"{describe}: O_DIRECT needs offset ({seg.offset}), address "
                                 f"({seg.address:#x}) and length ({seg.length}) aligned to "
                                 f"{DIRECT_ALIGN}; use buffers from BufferPool")
            for off in range(0, seg.length, self.block_size):
                n = min(self.block_size, seg.length - off)
                at = seg.offset + off
                want = n if eof is None or op != "read" else max(0, min(n, eof - at))
                blocks.append(_Block(handle, Segment(seg.fd, seg.path, at, seg.address + off, n),
                                     fds, want))
        handle._add_blocks(len(blocks))
        token = self.recorder.async_begin(op, "io", f"io:{self.name}", {
            "bytes": total, "path": first.path if first else ""})
        handle.add_done_callback(lambda h: self.recorder.async_end(
            token, {"error": str(h.error)} if h.error else None))
        if not blocks:
            handle._finish()
            return handle
        self._start(blocks)
        return handle

    def read(self, fd: int, path: str, offset: int, address: int, length: int, *,
             keepalive: object = None, eof: int | None = None) -> IoHandle:
        return self.submit("read", [Segment(fd, path, offset, address, length)], keepalive=keepalive,
                           eof=eof)

    def write(self, fd: int, path: str, offset: int, address: int, length: int, *,
              keepalive: object = None, sync: bool | None = None) -> IoHandle:
        return self.submit("write", [Segment(fd, path, offset, address, length)],
                           keepalive=keepalive, sync=sync)

    def on_completion_thread(self) -> bool:
        """True on a thread that completes this engine's requests (where done callbacks
        run): waiting there for another of its transfers would wait for itself."""
        ref = getattr(_completing, "engine", None)
        return ref is not None and ref() is self

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "IoEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- completion --------------------------------------------------------------
    def _check(self, block: _Block, res: int) -> IoError | None:
        seg = block.seg
        op = block.handle.op
        if res < 0:
            return IoError(op, seg.path, seg.offset, seg.length, -res)
        if res != block.expect:
            limit = op == "write" and past_fsize_limit(seg.offset + res)
            return IoError(op, seg.path, seg.offset, seg.length, errno.EFBIG if limit else None,
                           f"{res} of {block.expect} bytes transferred"
                           + ("; the file ends before this range" if op == "read" else ""))
        return None

    def _block_finished(self, block: _Block, error: BaseException | None) -> None:
        handle = block.handle
        if not handle._block_done(error):
            return
        if handle.error is None and block.sync_fds:
            handle._mark_released()  # data left the buffer; durability follows
            self._sync(handle, block.sync_fds)  # finishes the handle after fdatasync
        else:
            handle._finish()

    @abc.abstractmethod
    def _sync(self, handle: IoHandle, fds: tuple[int, ...]) -> None:
        """Makes `fds` durable, then finishes `handle`."""

    @abc.abstractmethod
    def _start(self, blocks: list[_Block]) -> None:
        """Moves `blocks`; calls `_block_finished` for each as it completes."""


class ThreadEngine(IoEngine):
    """`os.preadv`/`os.pwritev` in a thread pool (the syscalls release the GIL)."""

    name = "threads"

    def __init__(self, *, threads: int = 4, **kw: object) -> None:
        super().__init__(**kw)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-io")

    def _start(self, blocks: list[_Block]) -> None:
        for b in blocks:
            self._pool.submit(self._run_block, b)

    def _run_block(self, block: _Block) -> None:
        _completing.engine = weakref.ref(self)
        seg = block.seg
        done = 0
        error: BaseException | None = None
        try:
            mv = memoryview((ctypes.c_char * seg.length).from_address(seg.address)).cast("B")
            while done < seg.length:  # regular files only return short at EOF or on error
                fn = os.preadv if block.handle.op == "read" else os.pwritev
                n = fn(seg.fd, [mv[done:]], seg.offset + done)
                if n <= 0:
                    break
                done += n
        except OSError as e:
            error = IoError(block.handle.op, seg.path, seg.offset, seg.length, e.errno)
        except Exception as e:  # the executor would swallow it and the handle never finish
            error = e
        self._block_finished(block, error or self._check(block, done))

    def _sync(self, handle: IoHandle, fds: tuple[int, ...]) -> None:
        # Runs in the worker that finished the last block: never queued behind a
        # shutdown, so close() with writes in flight still completes their handles.
        err = None
        for fd in fds:
            try:
                os.fdatasync(fd)
            except OSError as e:
                err = err or IoError("fdatasync", handle.describe, 0, handle.nbytes, e.errno)
        handle._finish(err)

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)


class AioEngine(IoEngine):
    """Linux AIO through the `libaio` package: io_submit / io_getevents.

    One reaper thread blocks in io_getevents (a ctypes call, so the GIL is
    released while it waits), reaps completions, and refills the queue from
    the pending list so `queue_depth` blocks stay in flight.

    [Note: an engine dropped without close()] The reaper holds the engine only
    while requests are in flight: idle, it holds a weak reference and looks again
    each second. So an engine its owner dropped unclosed (a checkpoint reader
    that raised, a store collected) is collected, its thread ends and a finalizer
    destroys its AIO context, which would otherwise hold the machine's AIO slots
    (fs.aio-max-nr) until the process exits.
    """

    name = "aio"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        ok, why = libaio_status()
        if not ok:
            raise RuntimeError(f"AioEngine unavailable: {why}; or set io.engine = 'threads'")
        import libaio
        self._aio = libaio
        try:
            self._ctx = libaio.AIOContext(self.queue_depth)
        except OSError as e:  # libaio's own says only "io_queue_init"
            raise AioSetupError(e.errno or errno.EAGAIN, self.queue_depth) from None
        _CONTEXTS.add(self._ctx)  # [Note: the context is released once]
        self._cv = threading.Condition()
        self._pending: collections.deque[tuple[object, _Block | _Sync]] = collections.deque()
        self._tags: dict[int, tuple[object, _Block | _Sync]] = {}  # id(AIOBlock) -> in flight
        self._inflight = 0
        self._reaper = threading.Thread(target=_reap_while_referenced,
                                        args=(weakref.ref(self), self._cv),
                                        name="offload-aio-reaper", daemon=True)
        # the context is the making process's: the kernel refuses it in a forked child
        self._finalizer = weakref.finalize(self, in_owner, self._pid, destroy_context,
                                           self._ctx)
        self._reaper.start()

    def _make(self, block: _Block) -> object:
        seg = block.seg
        mode = self._aio.AIOBLOCK_MODE_READ if block.handle.op == "read" else \
            self._aio.AIOBLOCK_MODE_WRITE
        buf = (ctypes.c_char * seg.length).from_address(seg.address)
        return self._aio.AIOBlock(mode, target_file=seg.fd, buffer_list=[buf], offset=seg.offset)

    def _start(self, blocks: list[_Block]) -> None:
        made = [(self._make(b), b) for b in blocks]  # outside the lock: the reaper refills
        with self._cv:
            if self._closed:  # close() ran since submit() looked: the reaper may be gone
                raise RuntimeError(f"{self.name} engine is closed")
            self._pending.extend(made)
            failed = self._pump()
        self._complete(failed)

    def _sync(self, handle: IoHandle, fds: tuple[int, ...]) -> None:
        handle._add_blocks(len(fds))
        with self._cv:
            for fd in fds:
                aio = self._aio.AIOBlock(self._aio.AIOBLOCK_MODE_FDSYNC, target_file=fd)
                self._pending.append((aio, _Sync(handle, fd)))
            failed = self._pump()
        self._complete(failed)

    def _pump(self) -> list[tuple[_Block | _Sync, int]]:
        """Submits pending blocks while there is room; returns the refused ones
        as (tag, -errno) for the caller to complete once it dropped the lock."""
        refused = []
        while self._pending and self._inflight < self.queue_depth:
            room = self.queue_depth - self._inflight
            batch = [self._pending.popleft() for _ in range(min(len(self._pending), room))]
            for aio, tag in batch:
                self._tags[id(aio)] = (aio, tag)
            try:
                n = self._ctx.submit([aio for aio, _ in batch])
            except OSError as e:  # io_submit refused the first block: fail it, go on
                self._tags.pop(id(batch[0][0]))
                refused.append((batch[0][1], -(e.errno or 5)))
                batch, n = batch[1:], 0
                self._pending.extendleft(reversed(batch))
                continue
            for aio, _ in batch[n:]:
                self._tags.pop(id(aio))
            self._inflight += n
            self._pending.extendleft(reversed(batch[n:]))
            if n < len(batch):
                break  # kernel queue full (EAGAIN): the reaper refills after completions
        if self._inflight:
            self._cv.notify()
        return refused

    def _reap(self) -> bool:
        """One round of the reaper, called with requests in flight or once closed: reaps
        what completes; False once closed with nothing in flight."""
        with self._cv:
            if self._inflight == 0:
                return not self._closed
        # Blocks in io_getevents with the GIL released; the timeout only
        # bounds how late a close() is noticed, it is not a poll interval.
        try:
            events = self._ctx.getEvents(min_nr=1, nr=self.queue_depth, timeout=1.0)
        except InterruptedError:
            return True
        with self._cv:
            self._inflight -= len(events)
            done = [(self._tags.pop(id(aio))[1], res) for aio, res, _ in events]
            done += self._pump()
        self._complete(done)
        return True

    def _complete(self, done: list[tuple[_Block | _Sync, int]]) -> None:
        for tag, res in done:
            if isinstance(tag, _Sync):
                err = IoError("fdatasync", tag.handle.describe, 0, tag.handle.nbytes, -res) \
                    if res < 0 else None
                if tag.handle._block_done(err):
                    tag.handle._finish()
            else:
                self._block_finished(tag, self._check(tag, res))

    def _lost(self, error: BaseException) -> None:
        """[Note: a reaper that fails] Reaping raised (libaio lost track of requests
        the kernel took: an exception raised inside its submit() after io_submit
        returned, by a signal handler of the program's). Without its reaper no request
        ever completes and every wait would last forever: the engine closes, its
        context is destroyed (io_destroy returns once the kernel finished every request
        it took, so no transfer lands in a buffer after this), and every request not
        completed fails, naming the cause."""
        log.error("the AIO engine's completion thread failed (%s: %s); its requests fail "
                  "and the engine is closed", type(error).__name__, error)
        with self._cv:
            self._closed = True
            tags = [tag for _, tag in self._tags.values()] + [tag for _, tag in self._pending]
            self._tags.clear()
            self._pending.clear()
            self._inflight = 0
            self._cv.notify_all()
        try:
            self._finalizer()
        except Exception as e:  # the context is gone either way; the waits must end
            log.debug("destroying the AIO context after its reaper failed: %s", e)
        why = (f"the transfer's completion was lost ({type(error).__name__}: {error}); "
               "the engine is closed: close the store or engine and resume")
        for tag in tags:
            if isinstance(tag, _Sync):
                if tag.handle._block_done(IoError("fdatasync", tag.handle.describe, 0,
                                                  tag.handle.nbytes, errno.EIO, why)):
                    tag.handle._finish()
            else:
                seg = tag.seg
                self._block_finished(tag, IoError(tag.handle.op, seg.path, seg.offset,
                                                  seg.length, errno.EIO, why))

    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: the context and the reaper
            self._closed = True       # are the parent's ([Note: forked children] in swap.py)
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._reaper.join()
        self._finalizer()  # destroys the context, once


def destroy_context(ctx: Any) -> None:
    """Releases a libaio `AIOContext` once, whatever interrupts it.

    [Note: the context is released once]
    libaio's `close` releases the kernel's context, then forgets it (`del
    self._ctx`): a Ctrl-C between the two left it looking open, and its
    `__del__` released it again at exit ("Exception ignored ... io_queue_release"
    with EINVAL, or, the id reused by then, another context gone). Here it is
    forgotten first (its `close` and `__del__` then do nothing), then released:
    an interrupt in between leaves it to the kernel, which frees it with the
    process. A forked child forgets every context it inherited, as it forks: they
    are the parent's, and libaio's `__del__` releasing one in the child printed
    "Exception ignored ... io_queue_release" as the child exited."""
    handle = ctx._ctx
    if handle is None:
        return
    ctx._ctx = None
    ctx._io_queue_release(handle)


_CONTEXTS: weakref.WeakSet = weakref.WeakSet()  # this process's libaio contexts


def _forget_contexts() -> None:
    for ctx in list(_CONTEXTS):
        ctx._ctx = None
    _CONTEXTS.clear()


os.register_at_fork(after_in_child=_forget_contexts)


def _reap_while_referenced(ref: weakref.ref, cv: threading.Condition) -> None:
    """The reaper thread of an `AioEngine` ([Note: an engine dropped without close()]):
    rounds of `_reap` while requests are in flight, until it is closed; idle, it
    waits on the engine's condition holding only `ref`, and ends once the engine is
    collected."""
    _completing.engine = ref
    engine = None
    while True:
        with cv:
            if engine is None:
                engine = ref()
                if engine is None:
                    return
            if not engine._inflight and not engine._closed:
                engine = None  # idle: the engine may be collected now
                cv.wait(1.0)
                continue
        try:
            alive = engine._reap()
        except Exception as e:  # [Note: a reaper that fails]
            engine._lost(e)
            return
        if not alive:
            return

