"""Engines on real files with O_DIRECT: round trips, concurrency, errors."""

import os
import threading

import numpy as np
import pytest

from offload.config import IoConfig
from offload.io import IoError, Segment, choose_engine, gather, make_engine
from offload.io.engine import DIRECT_ALIGN

from .conftest import ENGINES, build_engine

SIZES = [4096, 8192, 64 << 10, (64 << 10) + 4096, 3 * (64 << 10) - 4096, 1 << 20,
         (5 << 20) + 12288]


def _file(tmp_path, name, size):
    path = str(tmp_path / name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, size)
    return path, fd


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_sizes(engine, pool, tmp_path, size):
    path, fd = _file(tmp_path, "data", size + 8192)
    rng = np.random.default_rng(size)
    src = pool.alloc(size, tag="src")
    dst = pool.alloc(size, tag="dst")
    src.numpy()[:size] = rng.integers(0, 256, size, dtype=np.uint8)
    h = engine.write(fd, path, 4096, src.address, size, keepalive=src)
    assert h.wait() == size and h.done() and h.released()
    dst.numpy()[:] = 0
    engine.read(fd, path, 4096, dst.address, size, keepalive=dst).wait()
    np.testing.assert_array_equal(dst.numpy()[:size], src.numpy()[:size])
    os.close(fd)
    src.release()
    dst.release()


def test_concurrent_requests_from_threads(engine, pool, tmp_path):
    n, size = 12, 256 << 10
    path, fd = _file(tmp_path, "data", n * size)
    bufs = [pool.alloc(size, tag=f"b{i}") for i in range(n)]
    for i, b in enumerate(bufs):
        b.numpy()[:] = i + 1
    # Writes issued from several threads at once; each handle waits for its own blocks.
    handles = [None] * n

    def issue(i):
        handles[i] = engine.write(fd, path, i * size, bufs[i].address, size, keepalive=bufs[i])

    threads = [threading.Thread(target=issue, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gather(handles) == n * size
    for b in bufs:
        b.numpy()[:] = 0
    reads = [engine.read(fd, path, i * size, b.address, size, keepalive=b)
             for i, b in enumerate(bufs)]
    for i, h in enumerate(reads):
        h.wait()
        assert (bufs[i].numpy() == i + 1).all(), f"request {i} got another request's bytes"
    os.close(fd)
    for b in bufs:
        b.release()


def test_gather_waits_for_every_handle_and_raises_the_first_error(engine, pool, tmp_path):
    """A request that fails at once, a long one behind it, another that fails: gather
    returns only once every handle is done, then raises the first handle's error."""
    size = 64 << 20
    short_a, fd_a = _file(tmp_path, "a", 8192)
    big, fd_big = _file(tmp_path, "big", size)
    short_c, fd_c = _file(tmp_path, "c", 8192)
    bufs = [pool.alloc(65536), pool.alloc(size), pool.alloc(65536)]
    handles = [engine.read(fd, path, 0, b.address, b.capacity, keepalive=b)
               for (path, fd), b in zip([(short_a, fd_a), (big, fd_big), (short_c, fd_c)], bufs)]
    with pytest.raises(IoError) as e:
        gather(handles)
    assert all(h.done() for h in handles)
    assert e.value.path == short_a
    for fd in (fd_a, fd_big, fd_c):
        os.close(fd)
    for b in bufs:
        b.release()


def test_multi_segment_request(engine, pool, tmp_path):
    p1, fd1 = _file(tmp_path, "a", 1 << 20)
    p2, fd2 = _file(tmp_path, "b", 1 << 20)
    buf = pool.alloc(3 * 65536)
    buf.numpy()[:] = np.arange(buf.capacity, dtype=np.uint64).astype(np.uint8)
    segs = [Segment(fd1, p1, 0, buf.address, 65536),
            Segment(fd2, p2, 65536, buf.address + 65536, 2 * 65536)]
    engine.submit("write", segs, keepalive=buf).wait()
    out = pool.alloc(3 * 65536)
    engine.submit("read", [s._replace(address=s.address - buf.address + out.address)
                           for s in segs], keepalive=out).wait()
    np.testing.assert_array_equal(out.numpy(), buf.numpy())
    os.close(fd1)
    os.close(fd2)


def test_read_past_end_is_short_transfer_error(engine, pool, tmp_path):
    path, fd = _file(tmp_path, "short", 8192)
    buf = pool.alloc(65536)
    h = engine.read(fd, path, 0, buf.address, 65536, keepalive=buf)
    with pytest.raises(IoError) as e:
        h.wait()
    msg = str(e.value)
    assert path in msg and "offset" in msg and "file ends" in msg
    assert e.value.path == path and e.value.length > 0
    with pytest.raises(IoError):  # every wait re-raises
        h.wait()
    os.close(fd)


@pytest.mark.parametrize("size", [4, 4100, (1 << 20) + 4, (2 << 20) + 8196])
def test_read_to_a_known_end_of_file(engine, pool, tmp_path, size):
    """A file whose length is not a block multiple is read whole in one request of the
    rounded-up length when the engine is told where it ends (`eof`); a request that
    still falls short of `eof` is an error."""
    path = str(tmp_path / "odd")
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    padded = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    buf = pool.alloc(padded)
    buf.numpy()[:] = 0
    assert engine.read(fd, path, 0, buf.address, padded, keepalive=buf, eof=size).wait()
    np.testing.assert_array_equal(buf.numpy()[:size], data)
    with pytest.raises(IoError, match="file ends"):
        engine.read(fd, path, 0, buf.address, padded, keepalive=buf, eof=size + 1).wait()
    os.close(fd)
    buf.release()


def test_write_to_read_only_fd_raises_with_os_message(engine, pool, tmp_path):
    path, fd = _file(tmp_path, "ro", 65536)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = pool.alloc(65536)
    h = engine.write(fd, path, 0, buf.address, 65536, keepalive=buf)
    with pytest.raises(IoError) as e:
        h.wait()
    assert "Bad file descriptor" in str(e.value) and e.value.offset == 0
    os.close(fd)


def test_unaligned_request_is_refused_before_submission(engine, pool, tmp_path):
    path, fd = _file(tmp_path, "u", 65536)
    buf = pool.alloc(65536)
    with pytest.raises(ValueError, match="aligned"):
        engine.write(fd, path, 100, buf.address, 4096, keepalive=buf)
    with pytest.raises(ValueError, match="aligned"):
        engine.write(fd, path, 0, buf.address + 8, 4096, keepalive=buf)
    os.close(fd)


@pytest.mark.parametrize("name", ENGINES)
def test_write_released_before_durable(name, pool, tmp_path):
    """A synced write releases its buffer when the data left it, then completes
    after fdatasync; an unsynced one completes when the device took the data."""
    eng = build_engine(name, sync_writes=True)
    path, fd = _file(tmp_path, "s", 1 << 20)
    buf = pool.alloc(1 << 20)
    h = eng.write(fd, path, 0, buf.address, 1 << 20, keepalive=buf)
    h.wait_released()
    h.wait()
    assert h.released() and h.done() and h.seconds > 0
    h2 = eng.write(fd, path, 0, buf.address, 1 << 20, keepalive=buf, sync=False)
    h2.wait()
    eng.close()
    os.close(fd)


@pytest.mark.parametrize("name", ENGINES)
def test_a_write_whose_fdatasync_fails_fails_its_handle(name, pool):
    """A synced write is durable only once fdatasync succeeded: where it fails (here
    for real, EINVAL: /dev/null takes the bytes but cannot sync), the handle raises,
    not "written"."""
    eng = build_engine(name, sync_writes=True)
    fd = os.open("/dev/null", os.O_RDWR)
    buf = pool.alloc(65536)
    try:
        h = eng.write(fd, "/dev/null", 0, buf.address, 65536, keepalive=buf)
        with pytest.raises(IoError, match="fdatasync"):
            h.wait()
    finally:
        eng.close()
        os.close(fd)


def test_auto_engine_where_o_direct_is_refused(caplog):
    """tmpfs refuses O_DIRECT before Linux 6.6; there auto must pick threads, buffered."""
    from offload.io import probe_direct
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    d = f"/dev/shm/offload-test-{os.getpid()}"
    try:
        if probe_direct(d)[0]:
            pytest.skip("this kernel's tmpfs accepts O_DIRECT")
        name, direct, why = choose_engine(IoConfig(paths=[d]))
        assert name == "threads" and direct is False and "O_DIRECT" in why
        with caplog.at_level("WARNING", logger="offload.io"):
            eng = make_engine(IoConfig(paths=[d]))
        assert eng.name == "threads" and not eng.direct
        assert any("O_DIRECT" in r.message for r in caplog.records)
        eng.close()
        from offload.config import ConfigError
        with pytest.raises(ConfigError, match="io.direct"):
            choose_engine(IoConfig(paths=[d], engine="threads"))
    finally:
        os.rmdir(d)


def test_auto_engine_without_direct_uses_threads(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="offload.io"):
        eng = make_engine(IoConfig(paths=[str(tmp_path)], direct=False))
    assert eng.name == "threads" and not eng.direct
    assert any("O_DIRECT" in r.message for r in caplog.records)
    eng.close()


def test_explicit_aio_without_libaio_names_the_fix():
    from .conftest import AIO_OK
    if AIO_OK:
        pytest.skip("libaio is installed here")
    from offload.config import ConfigError
    with pytest.raises(ConfigError, match="libaio"):
        choose_engine(IoConfig(engine="aio"))


def test_auto_engine_on_disk_prefers_aio(tmp_path):
    from .conftest import AIO_OK
    name, direct, why = choose_engine(IoConfig(paths=[str(tmp_path)]))
    assert direct is True
    assert name == ("aio" if AIO_OK else "threads"), why


def test_direct_align_is_page():
    assert DIRECT_ALIGN == 4096
