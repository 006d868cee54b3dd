"""The chunk files of a checkpoint's zarr v3 arrays, written and read with O_DIRECT
through the `offload.io` engines ([Note: chunk files]).

[Note: chunk files]
A checkpoint array's chunk is one file, `c/<k>/0/...` under the array's directory
(zarr v3's default chunk key encoding; chunks are whole rows of dimension 0, so
only the first index varies), holding the chunk's elements in C order, little
endian, padded with zeros (the fill value) to the full chunk shape at the
array's end, followed by their crc32c (4 bytes, little endian): the `bytes` and
`crc32c` codecs, so tensorstore and any zarr v3 reader open what this module
writes, and this module reads what tensorstore wrote.

The chunk's bytes do not pass through the page cache: the chunk is assembled in
an aligned buffer (one copy from the partition, wherever it lives) and sealed
with its checksum; the file is allocated to its length, its last partial block
(a few bytes: the checksum and what precedes it in that block) written through
the page cache, and the whole blocks before it written with O_DIRECT, inside
the file's length, so the kernel queues them without waiting. Reading takes the
whole file with O_DIRECT in one request rounded up to the block size (the
engine is told where the file ends), then checks the checksum. Up to `depth`
chunks are in flight in either direction, so copying and checksums run while
the disk works. A file system that refuses O_DIRECT (tmpfs) gets the
same requests through the page cache. Durability is the caller's: a save
makes the tree durable before it publishes ([Note: publishing a checkpoint]).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..io import AioEngine, BufferPool, HostBuffer, IoEngine, IoHandle, Segment, ThreadEngine
from ..io import libaio_status, probe_direct
from ..io.buffers import populate
from ..io.engine import DIRECT_ALIGN

__all__ = ["ChunkFileError", "ChunkFiles", "CRC_BYTES", "chunk_key", "syncfs"]

CRC_BYTES = 4
DEPTH = 8  # chunks in flight per direction
WORKERS = 2  # threads for copies and checksums
BUFFER_WAIT_S = 600.0  # a buffer not given back by then is a bug, raised, not a hang
BLOCK = 1 << 20  # bytes per I/O request given to the kernel


def _crc32c(view: memoryview, value: int = 0) -> int:
    """crc32c of `view`, continuing from `value` (the crc of what precedes it)."""
    import crc32c  # hardware crc32c; releases the GIL on large buffers
    return crc32c.crc32c(view, value)


class _Populator:
    """Faults in `tensors`' pages, in order, on a thread of its own, ahead of the
    reads that fill them ([Note: populating ahead] in offload/io/buffers.py)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._stopped = threading.Event()
        self._thread = None
        if tensors:
            self._thread = threading.Thread(target=self._run, args=(tensors,),
                                            name="offload-populate", daemon=True)
            self._thread.start()

    def _run(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if self._stopped.is_set() or not populate(t):
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def _round_up(n: int, a: int = DIRECT_ALIGN) -> int:
    return -(-n // a) * a


def chunk_key(ndim: int, k: int) -> str:
    """The file of chunk `k` (along dimension 0) of an array of `ndim` >= 1 dimensions."""
    return "/".join(["c", str(k)] + ["0"] * (ndim - 1))


class ChunkFileError(RuntimeError):
    """A chunk file is missing, has the wrong size or fails its checksum; `path`
    names it, `why` says what is wrong, `index` is its place in the read."""

    def __init__(self, path: str, why: str, index: int = -1) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why, self.index = path, why, index


def syncfs(path: Path) -> bool:
    """Flushes the whole file system holding `path` (data and metadata) in one
    call, where the C library has `syncfs`; False where it has not (the caller
    then fsyncs file by file)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
    return True


def _opens_direct(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:  # the file system refuses O_DIRECT (tmpfs)
            return False
        raise
    os.close(fd)
    return True


def _write_tail(path: str, data: memoryview, offset: int) -> None:
    """The last bytes of a chunk file, less than a block, through the page cache (an
    O_DIRECT write of the padded block would leave the file too long, and cutting it
    back makes the file system read and rewrite that block while the caller waits)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if os.pwrite(fd, data, offset) != len(data):
            raise OSError(errno.EIO, f"short write of the last {len(data)} bytes of {path}")
    finally:
        os.close(fd)


class ChunkFiles:
    """One save's or one load's chunk I/O under `directory` ([Note: chunk files]): an
    engine (Linux AIO where libaio loads and the file system takes O_DIRECT, else
    threads), `depth` aligned buffers of `max_chunk_bytes` (+ checksum) for the
    chunks in flight and `held` more for chunks the caller is still filling, and
    `workers` threads for the CPU work (copies, checksums, creating files), which
    releases the GIL. Whether O_DIRECT works is probed with a file made under
    `directory`, or, for reading (the checkpoint may be read-only), by opening the
    `existing` file.

    Thread safety: `buffer`, `write` and `submit` may be called from any thread,
    `read`, `finish` and `close` from one."""

    def __init__(self, directory: Path, max_chunk_bytes: int, *, depth: int = DEPTH,
                 held: int = 0, existing: Path | None = None, workers: int = WORKERS) -> None:
        self.direct = (_opens_direct(existing) if existing is not None
                       else probe_direct(str(directory), "checkpoint directory")[0])
        aio, _ = libaio_status()
        kw = dict(block_size=BLOCK, queue_depth=4 * depth, sync_writes=False,
                  direct=self.direct)
        self.engine: IoEngine = (AioEngine(**kw) if aio and self.direct
                                 else ThreadEngine(threads=depth, **kw))
        self.capacity = _round_up(max_chunk_bytes + CRC_BYTES)
        self.pool = BufferPool((depth + held) * (self.capacity + DIRECT_ALIGN), pin=False)
        self._tails = BufferPool(depth * 2 * DIRECT_ALIGN, pin=False)  # reads into place
        self.depth = depth
        self._work = ThreadPoolExecutor(workers, thread_name_prefix="offload-chunks")
        self._cv = threading.Condition()
        self._busy = 0  # chunk writes and reads started and not yet finished
        self._error: BaseException | None = None

    def close(self) -> None:
        """Waits for what is in flight (its errors dropped: `finish` raises them) and
        frees the threads, the engine and the buffers."""
        try:
            self._drain()
        finally:
            self._work.shutdown(wait=True)
            self.engine.close()
            self.pool.close(force=True)
            self._tails.close(force=True)

    def __enter__(self) -> "ChunkFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Runs `fn(*args)` on a chunk thread."""
        return self._work.submit(fn, *args)

    def _begin(self) -> None:
        with self._cv:
            self._busy += 1

    def _end(self, error: BaseException | None = None) -> None:
        with self._cv:
            if error is not None and self._error is None:
                self._error = error
            self._busy -= 1
            self._cv.notify_all()

    def _drain(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait()

    def _raise(self) -> None:
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def buffer(self) -> HostBuffer:
        """An aligned buffer for one chunk (+ its checksum); waits while every buffer
        is in flight (writes give theirs back as they finish)."""
        return self.pool.alloc(self.capacity, tag="checkpoint chunk", timeout=BUFFER_WAIT_S)

    # -- writing -----------------------------------------------------------------
    def write(self, path: str, buf: HostBuffer, nbytes: int) -> None:
        """Seals the chunk in the first `nbytes` bytes of `buf` with its crc32c and
        starts writing it as the new file `path`; `buf` is given back to the pool
        when the write is done. An error is raised by `finish`."""
        self._begin()
        fd = -1
        try:
            view = buf.memoryview()
            view[nbytes:nbytes + CRC_BYTES] = _crc32c(view[:nbytes]).to_bytes(CRC_BYTES, "little")
            size = nbytes + CRC_BYTES
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                         | (os.O_DIRECT if self.direct else 0), 0o644)
            head = size // DIRECT_ALIGN * DIRECT_ALIGN if self.direct else size
            if head < size:  # the file's length first: the O_DIRECT write stays inside it
                os.posix_fallocate(fd, 0, size)
                _write_tail(path, view[head:size], head)
            h = self.engine.write(fd, path, 0, buf.address, head, keepalive=buf, sync=False)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            buf.release()
            self._end(e)
            return

        def done(h: IoHandle, fd: int = fd) -> None:
            os.close(fd)
            buf.release()
            self._end(h.error)
        h.add_done_callback(done)

    def finish(self) -> None:
        """Waits for every write started; raises the first error."""
        self._drain()
        self._raise()

    # -- reading -----------------------------------------------------------------
    def read(self, chunks: Sequence[tuple[str, int]],
             consume: Callable[[int, torch.Tensor], None],
             into: Sequence[torch.Tensor | None] | None = None) -> None:
        """Reads each (path, nbytes) of `chunks` and calls `consume(i, data)` with the
        index and the chunk's `nbytes` bytes (a uint8 tensor valid during the call),
        its checksum verified, on a chunk thread, in any order; up to `depth` reads
        in flight. Returns when all are consumed; raises the first error (a
        `ChunkFileError` carries the chunk's index as `index`).

        `into[i]`, where given, is where chunk i's bytes go (a contiguous CPU uint8
        tensor of `nbytes`): its pages are faulted in ahead on a thread of their
        own ([Note: populating ahead]), and where it is aligned for O_DIRECT the
        chunk is read straight into it, checked there, and `consume` is not called
        for it. A chunk that fails its checksum has then already been written
        there: pass `into` only for memory that a failed read may leave garbled."""
        into = list(into) if into is not None else [None] * len(chunks)
        ahead = _Populator([t for t in into if t is not None])
        first: BaseException | None = None
        try:
            for i, (path, nbytes) in enumerate(chunks):
                with self._cv:
                    if self._error is not None:
                        break
                self._start_read(i, path, nbytes, consume, into[i])
        except BaseException as e:
            first = e
        self._drain()  # every buffer back before anything is raised
        ahead.stop()
        with self._cv:
            first, self._error = first or self._error, None
        if first is not None:
            raise first

    def _direct(self, dest: torch.Tensor | None, nbytes: int) -> bool:
        return (dest is not None and self.direct and nbytes >= DIRECT_ALIGN
                and dest.data_ptr() % DIRECT_ALIGN == 0)

    def _start_read(self, i: int, path: str, nbytes: int,
                    consume: Callable[[int, torch.Tensor], None],
                    dest: torch.Tensor | None) -> None:
        size = nbytes + CRC_BYTES
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise ChunkFileError(path, "is missing", i) from None
        direct = self._direct(dest, nbytes)
        # direct: the whole blocks into `dest`, the rest (the checksum and the bytes
        # of the last partial block) into a small buffer
        body = nbytes // DIRECT_ALIGN * DIRECT_ALIGN if direct else 0
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise ChunkFileError(path, f"has {have} bytes, a chunk of this array has "
                                     f"{size} ({nbytes} + a {CRC_BYTES}-byte checksum)", i)
            buf = self._tails.alloc(2 * DIRECT_ALIGN, tag="chunk tail",
                                    timeout=BUFFER_WAIT_S) if direct else self.buffer()
        except BaseException:
            os.close(fd)
            raise
        self._begin()
        try:  # the whole file in one request: the block past its end is not read
            segs = [Segment(fd, path, body, buf.address,
                            _round_up(size - body) if self.direct else size - body)]
            if direct:
                segs.insert(0, Segment(fd, path, 0, dest.data_ptr(), body))
            h = self.engine.submit("read", segs, keepalive=(buf, dest), eof=size)
        except BaseException:
            os.close(fd)
            buf.release()
            self._end()
            raise

        def check_and_consume() -> None:
            error = None if h.error is None else ChunkFileError(path, str(h.error), i)
            try:
                if error is None:
                    tail = buf.memoryview()
                    rest = nbytes - body
                    want = int.from_bytes(tail[rest:rest + CRC_BYTES], "little")
                    got = _crc32c(tail[:rest], _crc32c(memoryview(dest[:body].numpy()))
                                  if body else 0)
                    if got != want:
                        raise ChunkFileError(path, f"fails its checksum (crc32c {got:#010x}, "
                                             f"stored {want:#010x})", i)
                    if direct:
                        dest[body:nbytes].copy_(buf.tensor[:rest])
                    else:
                        consume(i, buf.tensor[:nbytes])
            except BaseException as e:
                error = e
            finally:
                buf.release()
                self._end(error)

        def done(_h: IoHandle) -> None:
            os.close(fd)
            self._work.submit(check_and_consume)
        h.add_done_callback(done)
