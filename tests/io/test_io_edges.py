"""The I/O layer where the disk, the kernel or the caller does less than asked: a quota
met at alloc, zeros the disk takes only in part, short transfers, io_submit taking part
of a batch, a read shorter than the write, a tensor shorter than the transfer, an
unaligned O_DIRECT length, a stale swap file, growth on a nearly full disk, striped
writes made durable on every file, a pool aligned past a page, a failed write's
error from wait_released. Only the operating system's and libaio's calls are
replaced, never offload's own."""

import contextlib
import errno
import os
import subprocess

import numpy as np
import pytest
import torch

from offload.io import (BufferPool, IoError, SwapFullError, SwapSpace, ThreadEngine,
                        libaio_status)
from offload.io.errors import PoolExhaustedError


def _pattern(buf, n, seed):
    buf.numpy()[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def later():
    """What a test opens is closed here when it ends, last opened first."""
    with contextlib.ExitStack() as stack:
        yield stack


def _engine(later, **kw) -> ThreadEngine:
    eng = ThreadEngine(**kw)
    later.callback(eng.close)
    return eng


def _pool(later, nbytes: int, **kw) -> BufferPool:
    pool = BufferPool(nbytes, pin=False, **kw)
    later.callback(pool.close, force=True)  # its buffers with it
    return pool


def _zeros(later, path, n: int, flags: int = os.O_RDWR) -> int:
    """A file of `n` zero bytes at `path`, open with `flags`."""
    path.write_bytes(b"\0" * n)
    fd = os.open(path, flags)
    later.callback(os.close, fd)
    return fd


class _Ledger:
    def __init__(self):
        self.held = 0

    def charge(self, n):
        self.held += n

    def refund(self, n):
        self.held -= n


def test_a_quota_met_at_alloc_is_a_swap_full_error_not_a_failing_disk(tmp_path, later, monkeypatch):
    """EDQUOT (a user's disk quota) is a full disk for the user: SwapFullError, nothing
    reserved."""
    eng = _engine(later, direct=False)
    with SwapSpace([str(tmp_path)], "q", eng, grow_step=1 << 20) as sw:
        def quota(fd, offset, length):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        monkeypatch.setattr(os, "posix_fallocate", quota)
        with pytest.raises(SwapFullError):
            sw.alloc(1 << 20)
        assert sw.capacity == 0 and os.path.getsize(sw.paths[0]) == 0


def test_a_refused_alloc_refunds_its_ledger(tmp_path, later):
    """An alloc that raises (io.max_swap_size) leaves the NVMe budget as it was."""
    eng = _engine(later, direct=False)
    with SwapSpace([str(tmp_path)], "l", eng, grow_step=1 << 20, max_size=1 << 20) as sw:
        sw.ledger = ledger = _Ledger()
        ext = sw.alloc(1 << 20)
        assert ledger.held == 1 << 20
        with pytest.raises(SwapFullError):
            sw.alloc(1 << 20)
        assert ledger.held == 1 << 20
        sw.free(ext)
        assert ledger.held == 0


def test_a_tensor_shorter_than_the_rounded_transfer_is_refused(tmp_path, later):
    """A transfer moves nbytes rounded up to 4 KiB: a tensor of exactly nbytes would be
    overrun, so it is refused before anything moves."""
    eng = _engine(later, direct=False)
    with SwapSpace([str(tmp_path)], "s", eng, grow_step=1 << 20) as sw:
        ext = sw.alloc(5000)
        t = torch.ones(5000, dtype=torch.uint8)
        with pytest.raises(ValueError, match="cannot take"):
            sw.write(ext, t, 5000)


def test_a_read_of_fewer_bytes_than_written_is_refused(tmp_path, later):
    eng = _engine(later, direct=False)
    pool = _pool(later, 16 << 20)
    with SwapSpace([str(tmp_path)], "r", eng, grow_step=1 << 20) as sw:
        src, dst = pool.alloc(8192), pool.alloc(8192)
        _pattern(src, 8192, 1)
        ext = sw.alloc(8192)
        sw.write(ext, src, 8192).wait()
        with pytest.raises(ValueError, match="holds 8192 bytes"):
            sw.read(ext, dst, 4096)


def test_a_stale_swap_file_is_emptied_when_taken_over(tmp_path, later):
    """A killed run's swap file (no lock held) is truncated: its disk space is freed."""
    with open(tmp_path / "offload-st.swap", "wb") as f:
        f.write(b"x" * (1 << 20))
    eng = _engine(later, direct=False)
    sw = SwapSpace([str(tmp_path)], "st", eng, grow_step=1 << 20)
    later.callback(sw.close)
    assert os.path.getsize(sw.paths[0]) == 0


def test_zeros_that_fit_only_in_part_are_a_full_disk(tmp_path, later, monkeypatch):
    """Where swap space is reserved by writing zeros (a file system without fallocate:
    ext2, some FUSE), a write the disk takes only in part (here: full past 1.5 MiB) is
    SwapFullError from alloc, the file cut back to what it held."""
    full_at = 3 << 19
    real = os.pwrite

    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    def pwrite(fd, data, offset):  # a disk that takes what fits
        return real(fd, data[:max(0, min(len(data), full_at - offset))], offset)
    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    monkeypatch.setattr(os, "pwrite", pwrite)
    eng = _engine(later, direct=False)
    with SwapSpace([str(tmp_path)], "z", eng, grow_step=1 << 20) as sw:
        sw.alloc(1 << 20)
        with pytest.raises(SwapFullError):
            sw.alloc(1 << 20)
        assert sw.capacity == 1 << 20 and os.path.getsize(sw.paths[0]) == 1 << 20



def test_zeros_a_file_system_refuses_at_write_back_are_a_full_disk(tmp_path, later,
                                                                  monkeypatch):
    """A file system that takes the zeros into its cache and finds the disk full only
    when it writes them back (NFS, some FUSE) reports it at the fdatasync after them:
    SwapFullError from alloc too, not a failed data write later."""
    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    def full_at_write_back(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    eng = _engine(later, direct=False)
    with SwapSpace([str(tmp_path)], "wb", eng, grow_step=1 << 20) as sw:
        monkeypatch.setattr(os, "fdatasync", full_at_write_back)
        with pytest.raises(SwapFullError):
            sw.alloc(1 << 20)
        monkeypatch.undo()
        assert sw.capacity == 0 and os.path.getsize(sw.paths[0]) == 0

def test_wait_released_raises_a_failed_writes_error(tmp_path, later):
    """A failed handle raises its IoError from wait_released() as from wait()."""
    path = tmp_path / "ro"
    fd = _zeros(later, path, 8192, os.O_RDONLY)
    buf = _pool(later, 1 << 20).alloc(4096)
    h = _engine(later, direct=False).write(fd, str(path), 0, buf.address, 4096, keepalive=buf)
    with pytest.raises(IoError):
        h.wait_released(timeout=10)
    with pytest.raises(IoError):
        h.wait(timeout=10)


def test_a_striped_write_is_made_durable_on_every_file(tmp_path, later, monkeypatch):
    """With io.sync_writes, a write striped over two directories fdatasyncs both files."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    eng = _engine(later, direct=False, sync_writes=True)
    pool = _pool(later, 4 << 20)
    with SwapSpace([str(tmp_path / "a"), str(tmp_path / "b")], "d", eng,
                   stripe_size=64 << 10, grow_step=1 << 20) as sw:
        ext = sw.alloc(256 << 10)
        src = pool.alloc(256 << 10)
        _pattern(src, 256 << 10, 2)
        synced = []
        real = os.fdatasync

        def record(fd):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            return real(fd)
        monkeypatch.setattr(os, "fdatasync", record)
        sw.write(ext, src, 256 << 10).wait()
        monkeypatch.setattr(os, "fdatasync", real)
        assert sorted(set(synced)) == sorted(os.path.realpath(p) for p in sw.paths)


def test_an_unaligned_length_is_refused_before_submission_with_direct(tmp_path, later):
    path = tmp_path / "f"
    fd = _zeros(later, path, 8192)
    buf = _pool(later, 1 << 20).alloc(4096)
    with pytest.raises(ValueError, match="O_DIRECT needs"):
        _engine(later, direct=True).write(fd, str(path), 0, buf.address, 100, keepalive=buf)
    assert path.read_bytes() == b"\0" * 8192


def test_short_transfers_are_continued_with_the_remaining_bytes(tmp_path, later, monkeypatch):
    """A file system that moves fewer bytes per call than asked (FUSE, NFS, a signal)
    still gets every byte in place, each at its offset."""
    n = 64 << 10
    path = tmp_path / "f"
    fd = _zeros(later, path, n)
    real_w, real_r = os.pwritev, os.preadv
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real_w(fd, [bufs[0][:4096]], off))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_r(fd, [bufs[0][:4096]], off))
    eng = _engine(later, direct=False, sync_writes=False)
    pool = _pool(later, 1 << 20)
    src, dst = pool.alloc(n), pool.alloc(n)
    _pattern(src, n, 3)
    eng.write(fd, str(path), 0, src.address, n, keepalive=src).wait(timeout=10)
    assert path.read_bytes() == src.numpy()[:n].tobytes()
    eng.read(fd, str(path), 0, dst.address, n, keepalive=dst).wait(timeout=10)
    assert (dst.numpy()[:n] == src.numpy()[:n]).all()


@pytest.mark.skipif(not libaio_status()[0], reason=libaio_status()[1])
def test_aio_blocks_the_kernel_takes_only_in_part_are_submitted_later(tmp_path, later, monkeypatch):
    """io_submit may take fewer blocks than given (its queue full): the rest are
    submitted as completions free room, and the request completes whole."""
    import libaio
    from offload.io import AioEngine

    class Partial(libaio.AIOContext):
        def submit(self, block_list):
            return super().submit(block_list[:1])
    monkeypatch.setattr(libaio, "AIOContext", Partial)
    eng = AioEngine(block_size=64 << 10, queue_depth=8, direct=False, sync_writes=False)
    later.callback(eng.close)
    n = 1 << 20
    src = _pool(later, 4 << 20).alloc(n)
    _pattern(src, n, 4)
    path = tmp_path / "f"
    fd = _zeros(later, path, n)
    eng.write(fd, str(path), 0, src.address, n, keepalive=src).wait(timeout=10)
    assert path.read_bytes() == src.numpy()[:n].tobytes()


def test_a_pool_aligned_past_a_page_keeps_its_budget(later):
    """With alignment above a page a block maps its alignment's slack too: that counts,
    so the bytes held never pass the budget."""
    pool = _pool(later, 80 << 10, alignment=16 << 10)
    held = [pool.alloc(16 << 10), pool.alloc(16 << 10)]
    with pytest.raises(PoolExhaustedError):
        held.append(pool.alloc(16 << 10))
    assert pool.stats().held_bytes <= pool.budget


def test_a_grow_step_over_half_the_free_space_grows_by_what_is_needed(tmp_path, later):
    """[Note: growth on a nearly full disk]: on a 64 MiB file system a 40 MiB step is
    more than half of what is free, so the file grows by the 1 MiB needed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        eng = _engine(later, direct=False)
        with SwapSpace([str(mnt)], "h", eng, grow_step=40 << 20) as sw:
            sw.alloc(1 << 20)
            assert sw.capacity == 1 << 20
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
