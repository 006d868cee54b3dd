"""The shard files of a checkpoint's zarr v3 arrays, written and read with O_DIRECT
through the `offload.io` engines ([Note: shard files]).

[Note: shard files]
A checkpoint array is stored with zarr v3's `sharding_indexed` codec. Its chunks
are whole rows of dimension 0, about 4 MiB each: the chunk's elements in C order,
little endian, zero-padded (the fill value) to the chunk shape at the array's
end, then their crc32c (the inner `bytes` and `crc32c` codecs). Up to a shard's
worth of consecutive chunks share one file, `c/<s>/0/...` under the array's
directory (zarr v3's default chunk key encoding; only the first index varies),
which ends in the shard's index: an (offset, length) pair of little-endian
uint64 per chunk slot (2^64-1 twice for a slot past the array's end), then the
index's crc32c (`index_codecs`: bytes, crc32c; `index_location`: end).
tensorstore and any zarr v3 reader open what this module writes, and this
module reads what tensorstore wrote (the shards two ranks share are written
through it).

This module puts chunk j of a shard at offset j * stride, the stride being a
chunk with its checksum rounded up to the 4 KiB block, so every chunk begins on
a block and is written with O_DIRECT: its whole blocks straight from the memory
that holds it where that memory is aligned (`write_in_place`: no copy), else
from an aligned buffer it was assembled in (`write`); its last partial block,
with the checksum, from a small buffer. The rest of that block is zeros that
no reader looks at (the index gives each chunk's length). A shard's file is
created once, allocated to its full length and given its index (through the
page cache: the index ends the file and is not block aligned) before its first
chunk is written, so every O_DIRECT write lands inside the file's length and the
kernel queues it without waiting; its chunks are then written in any order, by
any thread, and the file is closed after the last. One file per shard, not per
chunk: creating a file costs an inode and a directory entry, and with one file
per 4 MiB chunk that was a third of a save's CPU time on an ext4 volume shortly
after other files had been deleted there (its inode allocator skips recently
freed inodes one by one).

Reading takes one chunk at the offset its shard's index gives, with O_DIRECT,
rounded out to whole blocks (the engine is told where the file ends), then
checks the checksum. Up to `depth` chunks are in flight in either direction, so
copying and checksums run while the disk works. A file system that refuses
O_DIRECT (tmpfs) gets the same requests through the page cache. Durability is
the caller's: a save makes the tree durable before it publishes ([Note:
publishing a checkpoint]).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from ..io import AioEngine, AioSetupError, BufferPool, HostBuffer, IoEngine, IoHandle, Segment
from ..io import ThreadEngine, libaio_status, probe_direct
from ..io.buffers import populate
from ..io.engine import DIRECT_ALIGN

log = logging.getLogger(__name__)

__all__ = ["ChunkFileError", "ChunkFiles", "CRC_BYTES", "Shard", "chunk_key", "read_index",
           "syncfs"]

CRC_BYTES = 4
DEPTH = 8  # chunks in flight per direction
WORKERS = 2  # threads for copies and checksums
BUFFER_WAIT_S = 600.0  # a buffer not given back by then is a bug, raised, not a hang
BLOCK = 1 << 20  # bytes per I/O request given to the kernel
ENTRY = 16  # bytes per chunk slot in a shard's index: offset and length, uint64 each
MISSING = (1 << 64) - 1  # an index entry's offset and length for a slot with no chunk


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
    """The file of shard `k` (along dimension 0) of an array of `ndim` >= 1 dimensions."""
    return "/".join(["c", str(k)] + ["0"] * (ndim - 1))


class Shard(NamedTuple):
    """One shard file as this module writes it ([Note: shard files]): `slots` chunk
    slots, the first `present` of them holding a chunk of `chunk_bytes` (its
    checksum not counted), the rest past the array's end."""
    path: str
    slots: int
    present: int
    chunk_bytes: int

    @property
    def stride(self) -> int:
        """Bytes from one chunk's start to the next's: the chunk and its checksum,
        rounded up to the block."""
        return _round_up(self.chunk_bytes + CRC_BYTES)

    def index(self) -> bytes:
        """The shard's index with its crc32c: each present chunk at its stride."""
        n = self.chunk_bytes + CRC_BYTES
        body = b"".join(struct.pack("<QQ", j * self.stride, n) if j < self.present
                        else struct.pack("<QQ", MISSING, MISSING) for j in range(self.slots))
        return body + _crc32c(memoryview(body)).to_bytes(CRC_BYTES, "little")

    @property
    def size(self) -> int:
        return self.present * self.stride + self.slots * ENTRY + CRC_BYTES


def read_index(path: str, slots: int) -> list[tuple[int, int]]:
    """The (offset, length) of each of the `slots` chunk slots of the shard file at
    `path`, its index's checksum verified; (MISSING, MISSING) for a slot with no
    chunk. Raises `ChunkFileError` for a missing, unreadable or not regular file
    or a damaged index."""
    if slots < 1:
        raise ChunkFileError(path, f"cannot have {slots} chunk slots (its array's metadata "
                             "is damaged)")
    n = slots * ENTRY + CRC_BYTES
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: no wait for a writer
    except FileNotFoundError:
        raise ChunkFileError(path, "is missing") from None
    except OSError as e:
        raise ChunkFileError(path, f"cannot be opened ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ChunkFileError(path, "is a directory, not a shard file"
                                 if stat.S_ISDIR(st.st_mode) else "is not a regular file")
        size = st.st_size
        if size < n:
            raise ChunkFileError(path, f"has {size} bytes, less than its index of {slots} "
                                 f"chunk slots ({n} bytes)")
        raw = os.pread(fd, n, size - n)
    except OSError as e:
        raise ChunkFileError(path, f"cannot be read ({e.strerror})") from e
    finally:
        os.close(fd)
    if len(raw) != n:  # the file shrank under us
        raise ChunkFileError(path, f"gave {len(raw)} bytes of its {n}-byte index")
    want = int.from_bytes(raw[-CRC_BYTES:], "little")
    got = _crc32c(memoryview(raw)[:-CRC_BYTES])
    if got != want:
        raise ChunkFileError(path, f"has a shard index that fails its checksum (crc32c "
                             f"{got:#010x}, stored {want:#010x})")
    out = [struct.unpack_from("<QQ", raw, j * ENTRY) for j in range(slots)]
    for off, length in out:
        if (off, length) != (MISSING, MISSING) and off + length > size - n:
            raise ChunkFileError(path, f"has an index entry ({off}, {length}) past its data "
                                 f"({size - n} bytes)")
    return out


class InPlace:
    """A chunk being written from its own memory (`ChunkFiles.write_in_place`): `wait`
    returns once that memory may change (the body written, the checksum and the last
    bytes taken); the write's error, if any, is raised by `ChunkFiles.finish`."""

    def __init__(self) -> None:
        self._left = 2
        self._lock = threading.Lock()
        self._done = threading.Event()

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        if not self._done.wait(BUFFER_WAIT_S):
            raise RuntimeError(f"a checkpoint chunk written in place was not done after "
                               f"{BUFFER_WAIT_S} s")


class _OpenShard:
    """A shard file being written: its descriptor, the chunks not yet started and the
    writes in flight; closed when both are zero."""

    __slots__ = ("fd", "unstarted", "inflight")

    def __init__(self, fd: int, present: int) -> None:
        self.fd, self.unstarted, self.inflight = fd, present, 0


class ChunkFileError(RuntimeError):
    """A shard file is missing, too short or cannot be opened or read, its index is
    damaged, or a chunk in it fails its checksum; `path` names the file, `why` says
    what is wrong, `index` is the chunk's place in the read. Where the OS refused a
    call, its OSError is the `__cause__` (a limit of the process, a permission: no
    damage)."""

    def __init__(self, path: str, why: str, index: int = -1) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why, self.index = path, why, index

    @property
    def denied(self) -> PermissionError | None:
        """The error raised from, where this process may not read the file (which may
        be intact)."""
        return self.__cause__ if isinstance(self.__cause__, PermissionError) else None


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


def _allocate(fd: int, size: int) -> None:
    """Gives a new shard file its `size` bytes: allocated on disk, or where the file
    system has no fallocate (ext2, some network and FUSE file systems; glibc's
    emulation writes through the O_DIRECT descriptor, which refuses it with EINVAL)
    as a sparse file of that length, whose blocks its writes allocate; a full disk
    then fails a chunk's write, and the save with it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL) or size <= 0:
            raise
        os.ftruncate(fd, size)


def _write_tail(path: str, data: memoryview, offset: int) -> None:
    """The last bytes of a shard file (its index), through the page cache (an O_DIRECT
    write of the padded block would leave the file too long, and cutting it back
    makes the file system read and rewrite that block while the caller waits)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if os.pwrite(fd, data, offset) != len(data):
            raise OSError(errno.EIO, f"short write of the last {len(data)} bytes of {path}")
    finally:
        os.close(fd)


class ChunkFiles:
    """One save's or one load's chunk I/O under `directory` ([Note: shard files]): an
    engine (Linux AIO where libaio loads and the file system takes O_DIRECT, else
    threads), `depth` aligned buffers of `max_chunk_bytes` (+ checksum) for the
    chunks in flight and `held` more for chunks the caller is still filling, small
    buffers for the last blocks of chunks read or written in place, and `workers`
    threads for the CPU work (copies, checksums), which releases the GIL. Whether
    O_DIRECT works is probed with a file made under `directory`, or, for reading
    (the checkpoint may be read-only), by opening the `existing` file.

    Thread safety: `buffer`, `write`, `write_in_place` and `submit` may be called
    from any thread, `read`, `finish` and `close` from one."""

    def __init__(self, directory: Path, max_chunk_bytes: int, *, depth: int = DEPTH,
                 held: int = 0, existing: Path | None = None, workers: int = WORKERS) -> None:
        self.direct = (_opens_direct(existing) if existing is not None
                       else probe_direct(str(directory), "checkpoint directory")[0])
        aio, _ = libaio_status()
        kw = dict(block_size=BLOCK, queue_depth=4 * depth, sync_writes=False,
                  direct=self.direct)
        self.engine: IoEngine | None = None
        if aio and self.direct:
            try:
                self.engine = AioEngine(**kw)
            except AioSetupError as e:  # slots other processes took since initialize
                log.warning("checkpoint I/O on threads: %s", e)
        if self.engine is None:
            self.engine = ThreadEngine(threads=depth, **kw)
        # a chunk, its checksum, and a block more: a chunk another writer (tensorstore)
        # placed off the block boundary is read from the block it begins in
        self.capacity = _round_up(max_chunk_bytes + CRC_BYTES) + DIRECT_ALIGN
        self.pool = BufferPool((depth + held) * self.capacity, pin=False)
        self._tails = BufferPool(depth * 2 * 2 * DIRECT_ALIGN, pin=False)  # last blocks
        self.depth = depth
        self._work = ThreadPoolExecutor(workers, thread_name_prefix="offload-chunks")
        self._cv = threading.Condition()
        self._busy = 0  # chunk writes and reads started and not yet finished
        self._error: BaseException | None = None
        self._shards: dict[str, _OpenShard] = {}  # shard files being written, by path

    def close(self) -> None:
        """Waits for what is in flight (its errors dropped: `finish` raises them) and
        frees the threads, the engine and the buffers."""
        try:
            self._drain()
        finally:
            self._work.shutdown(wait=True)
            self.engine.close()
            for f in self._shards.values():  # a save that failed before its last chunks
                os.close(f.fd)
            self._shards.clear()
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
    def _start_chunk(self, shard: Shard, writes: int) -> int:
        """The descriptor of `shard`'s file, created, allocated and given its index at
        its first chunk; counts `writes` more in flight for one more chunk."""
        with self._cv:
            f = self._shards.get(shard.path)
            if f is None:
                os.makedirs(os.path.dirname(shard.path), exist_ok=True)
                fd = os.open(shard.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                             | (os.O_DIRECT if self.direct else 0), 0o644)
                try:
                    _allocate(fd, shard.size)  # O_DIRECT writes stay inside it
                    index = shard.index()
                    _write_tail(shard.path, memoryview(index), shard.size - len(index))
                except BaseException:
                    os.close(fd)
                    raise
                f = self._shards[shard.path] = _OpenShard(fd, shard.present)
            if f.unstarted <= 0:
                raise RuntimeError(f"{shard.path}: more than its {shard.present} chunks written")
            f.unstarted -= 1
            f.inflight += writes
            return f.fd

    def _write_done(self, shard: Shard, error: BaseException | None) -> None:
        with self._cv:
            f = self._shards[shard.path]
            f.inflight -= 1
            if f.inflight == 0 and f.unstarted == 0:
                del self._shards[shard.path]
                os.close(f.fd)
        self._end(error)

    def write(self, shard: Shard, j: int, buf: HostBuffer, nbytes: int) -> None:
        """Seals the chunk in the first `nbytes` (`shard.chunk_bytes`) bytes of `buf`
        with its crc32c and starts writing it as chunk `j` of `shard`; `buf` is given
        back to the pool when the write is done. An error is raised by `finish`."""
        self._begin()
        try:
            view = buf.memoryview()
            view[nbytes:nbytes + CRC_BYTES] = _crc32c(view[:nbytes]).to_bytes(CRC_BYTES, "little")
            n = shard.stride if self.direct else nbytes + CRC_BYTES
            view[nbytes + CRC_BYTES:n] = bytes(n - nbytes - CRC_BYTES)
            fd = self._start_chunk(shard, 1)
        except BaseException as e:
            buf.release()
            self._end(e)
            return
        self._write_buffer(shard, fd, j * shard.stride, buf, n)

    def in_place(self, data: torch.Tensor) -> bool:
        """Whether `write_in_place` takes `data`: its whole blocks go straight from
        its memory by O_DIRECT."""
        return (self.direct and data.device.type == "cpu" and data.is_contiguous()
                and data.data_ptr() % DIRECT_ALIGN == 0
                and data.numel() * data.element_size() >= DIRECT_ALIGN)

    def write_in_place(self, shard: Shard, j: int, data: torch.Tensor) -> InPlace:
        """Starts writing `data` (a chunk of `shard.chunk_bytes`, `in_place(data)`) as
        chunk `j` of `shard`: its whole blocks from its own memory, its last bytes and
        checksum (computed on a chunk thread) from a small buffer. `data` must not
        change until the returned `InPlace` is waited for. An error is raised by
        `finish`."""
        raw = data.reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        body = nbytes // DIRECT_ALIGN * DIRECT_ALIGN
        token = InPlace()
        self._begin()
        self._begin()
        try:
            fd = self._start_chunk(shard, 2)
        except BaseException as e:
            self._end(e)
            self._end()
            token._one_done()
            token._one_done()
            return token
        try:
            h = self.engine.write(fd, shard.path, j * shard.stride, raw.data_ptr(), body,
                                  keepalive=raw, sync=False)
        except BaseException as e:
            h = None
            self._write_done(shard, e)
            token._one_done()
        if h is not None:
            def body_done(h: IoHandle) -> None:
                token._one_done()
                self._write_done(shard, h.error)
            h.add_done_callback(body_done)
        self._work.submit(self._write_tail_block, shard, j, raw, body, fd, token)
        return token

    def _write_tail_block(self, shard: Shard, j: int, raw: torch.Tensor, body: int, fd: int,
                          token: InPlace) -> None:
        """On a chunk thread: the checksum of chunk `j` and its last block, written."""
        buf = None
        try:
            crc = _crc32c(memoryview(raw.numpy()))
            rest = raw.numel() - body
            n = _round_up(rest + CRC_BYTES)
            buf = self._tails.alloc(n, tag="chunk tail", timeout=BUFFER_WAIT_S)
            view = buf.memoryview()
            view[:rest] = memoryview(raw[body:].numpy())
            view[rest:rest + CRC_BYTES] = crc.to_bytes(CRC_BYTES, "little")
            view[rest + CRC_BYTES:n] = bytes(n - rest - CRC_BYTES)
        except BaseException as e:
            if buf is not None:
                buf.release()
            token._one_done()
            self._write_done(shard, e)
            return
        token._one_done()  # the chunk's memory is no longer needed
        self._write_buffer(shard, fd, j * shard.stride + body, buf, n)

    def _write_buffer(self, shard: Shard, fd: int, offset: int, buf: HostBuffer,
                      n: int) -> None:
        """Writes `n` bytes of `buf` at `offset` of `shard`'s file; the buffer goes back
        to its pool and the shard counts the write once it is done (or failed)."""
        try:
            h = self.engine.write(fd, shard.path, offset, buf.address, n, keepalive=buf,
                                  sync=False)
        except BaseException as e:
            buf.release()
            self._write_done(shard, e)
            return

        def done(h: IoHandle) -> None:
            buf.release()
            self._write_done(shard, h.error)
        h.add_done_callback(done)

    def finish(self) -> None:
        """Waits for every write started; raises the first error."""
        self._drain()
        self._raise()

    # -- reading -----------------------------------------------------------------
    def read(self, chunks: Sequence[tuple[str, int, int]],
             consume: Callable[[int, torch.Tensor], None],
             into: Sequence[torch.Tensor | None] | None = None) -> None:
        """Reads each (path, offset, nbytes) of `chunks` (a chunk of `nbytes` and its
        checksum at `offset` of the file `path`) and calls `consume(i, data)` with the
        index and the chunk's `nbytes` bytes (a uint8 tensor valid during the call),
        its checksum verified, on a chunk thread, in any order; up to `depth` reads
        in flight. Returns when all are consumed; raises the first error (a
        `ChunkFileError` carries the chunk's index as `index`).

        `into[i]`, where given, is where chunk i's bytes go (a contiguous CPU uint8
        tensor of `nbytes`): its pages are faulted in ahead on a thread of their
        own ([Note: populating ahead]), and where it and the chunk's offset are
        aligned for O_DIRECT the chunk is read straight into it, checked there, and
        `consume` is not called for it. A chunk that fails its checksum has then
        already been written there: pass `into` only for memory that a failed read
        may leave garbled."""
        into = list(into) if into is not None else [None] * len(chunks)
        ahead = _Populator([t for t in into if t is not None])
        first: BaseException | None = None
        try:
            for i, (path, offset, nbytes) in enumerate(chunks):
                with self._cv:
                    if self._error is not None:
                        break
                self._start_read(i, path, offset, nbytes, consume, into[i])
        except BaseException as e:
            first = e
        self._drain()  # every buffer back before anything is raised
        ahead.stop()
        with self._cv:
            first, self._error = first or self._error, None
        if first is not None:
            raise first

    def _direct(self, dest: torch.Tensor | None, offset: int, nbytes: int) -> bool:
        return (dest is not None and self.direct and nbytes >= DIRECT_ALIGN
                and offset % DIRECT_ALIGN == 0 and dest.data_ptr() % DIRECT_ALIGN == 0)

    def _start_read(self, i: int, path: str, offset: int, nbytes: int,
                    consume: Callable[[int, torch.Tensor], None],
                    dest: torch.Tensor | None) -> None:
        size = nbytes + CRC_BYTES
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise ChunkFileError(path, "is missing", i) from None
        except OSError as e:
            raise ChunkFileError(path, f"cannot be opened ({e.strerror})", i) from e
        direct = self._direct(dest, offset, nbytes)
        # direct: the whole blocks into `dest`, the rest (the checksum and the bytes
        # of the last partial block) into a small buffer; else the chunk from the
        # block it begins in (`lead` bytes into it) into a chunk buffer
        body = nbytes // DIRECT_ALIGN * DIRECT_ALIGN if direct else 0
        lead = offset % DIRECT_ALIGN if self.direct else 0
        try:
            have = os.fstat(fd).st_size
            if have < offset + size:
                raise ChunkFileError(path, f"has {have} bytes, too few for a chunk of "
                                     f"{size} bytes ({nbytes} + a {CRC_BYTES}-byte checksum) "
                                     f"at {offset}", i)
            buf = self._tails.alloc(2 * DIRECT_ALIGN, tag="chunk tail",
                                    timeout=BUFFER_WAIT_S) if direct else self.buffer()
        except BaseException:
            os.close(fd)
            raise
        self._begin()
        try:  # one request: the block past the file's end is not read
            n = lead + size - body
            segs = [Segment(fd, path, offset - lead + body, buf.address,
                            _round_up(n) if self.direct else n)]
            if direct:
                segs.insert(0, Segment(fd, path, offset, dest.data_ptr(), body))
            h = self.engine.submit("read", segs, keepalive=(buf, dest), eof=have)
        except BaseException:
            os.close(fd)
            buf.release()
            self._end()
            raise

        def check_and_consume() -> None:
            error = None
            if h.error is not None:  # the cause says whether it is a limit, not damage
                error = ChunkFileError(path, str(h.error), i)
                error.__cause__ = h.error
            try:
                if error is None:
                    tail = buf.memoryview()[lead:]
                    rest = nbytes - body
                    want = int.from_bytes(tail[rest:rest + CRC_BYTES], "little")
                    got = _crc32c(tail[:rest], _crc32c(memoryview(dest[:body].numpy()))
                                  if body else 0)
                    if got != want:
                        raise ChunkFileError(path, f"fails its checksum at offset {offset} "
                                             f"(crc32c {got:#010x}, stored {want:#010x})", i)
                    if direct:
                        dest[body:nbytes].copy_(buf.tensor[:rest])
                    else:
                        consume(i, buf.tensor[lead:lead + nbytes])
            except BaseException as e:
                error = e
            finally:
                buf.release()
                self._end(error)

        def done(_h: IoHandle) -> None:
            os.close(fd)
            self._work.submit(check_and_consume)
        h.add_done_callback(done)
