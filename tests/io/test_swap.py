"""SwapSpace on real files: striping, locking, checksums, running out of space."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from offload.io import (CorruptionError, IoError, SwapFullError, SwapLockedError, SwapSpace)

from ..conftest import ENGINES_AIO_SLOW
from .conftest import build_engine


def _fill(buf, n, seed):
    buf.numpy()[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 65536, 200_000, 3 << 20])
def test_round_trip_any_size(engine, pool, tmp_path, nbytes):
    with SwapSpace([str(tmp_path)], "t", engine, grow_step=1 << 20) as sw:
        src, dst = pool.alloc(nbytes), pool.alloc(nbytes)
        _fill(src, nbytes, nbytes)
        ext = sw.alloc(nbytes)
        assert ext.length % 4096 == 0 and ext.offset % 4096 == 0
        sw.write(ext, src, nbytes).wait()
        sw.read(ext, dst).wait()
        np.testing.assert_array_equal(dst.numpy()[:nbytes], src.numpy()[:nbytes])


def test_striping_over_two_directories(engine, pool, tmp_path):
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    sw = SwapSpace(dirs, "rank0-param", engine, stripe_size=64 << 10, grow_step=1 << 20)
    n = (1 << 20) + 12345
    src, dst = pool.alloc(n), pool.alloc(n)
    _fill(src, n, 1)
    exts = [sw.alloc(n) for _ in range(3)]
    for e in exts:
        sw.write(e, src, n).wait()
    # Both files hold stripes, each is preallocated to the same size.
    sizes = [os.path.getsize(p) for p in sw.paths]
    assert sizes[0] == sizes[1] > 0
    assert [os.path.basename(p) for p in sw.paths] == ["offload-rank0-param.swap"] * 2
    raw = [open(p, "rb").read(64 << 10) for p in sw.paths]
    assert raw[0] == bytes(src.numpy()[: 64 << 10])          # stripe 0 -> file 0
    assert raw[1] == bytes(src.numpy()[64 << 10: 128 << 10])  # stripe 1 -> file 1
    for e in exts:
        dst.numpy()[:] = 0
        sw.read(e, dst).wait()
        np.testing.assert_array_equal(dst.numpy()[:n], src.numpy()[:n])
    sw.close()
    assert not any(os.path.exists(p) for p in sw.paths + [p + ".lock" for p in dirs])


def test_corrupted_byte_is_reported_not_returned(engine, pool, tmp_path):
    sw = SwapSpace([str(tmp_path)], "c", engine, grow_step=1 << 20)
    n = 100_000
    src, dst = pool.alloc(n), pool.alloc(n)
    _fill(src, n, 2)
    ext = sw.alloc(n)
    sw.write(ext, src, n).wait()
    with open(sw.paths[0], "r+b") as f:  # flip one byte behind the engine's back
        f.seek(ext.offset + 777)
        b = f.read(1)
        f.seek(ext.offset + 777)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    h = sw.read(ext, dst)
    with pytest.raises(CorruptionError) as e:
        h.wait()
    assert sw.paths[0] in str(e.value) and "checksum mismatch" in str(e.value)
    with pytest.raises(CorruptionError):
        h.wait()  # still refused on a second wait
    sw.close()


def test_a_corrupted_striped_extent_names_every_file_it_spans(engine, pool, tmp_path):
    """A byte changed in the second of three striped files: the error names each file
    and the bytes the extent holds there. It named the first file alone, so one checked
    the wrong disk."""
    sw = SwapSpace([str(tmp_path / f"d{i}") for i in range(3)], "c", engine,
                   stripe_size=8192, grow_step=3 * 8192 * 4)
    n = 40_000
    src, dst = pool.alloc(n), pool.alloc(n)
    _fill(src, n, 3)
    ext = sw.alloc(n)
    sw.write(ext, src, n).wait()
    with open(sw.paths[1], "r+b") as f:
        f.seek(100)
        f.write(b"\xde\xad")
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(CorruptionError) as e:
        sw.read(ext, dst).wait()
    assert all(f"{p} (" in str(e.value) for p in sw.paths), str(e.value)
    assert f"{sw.paths[1]} (16384 bytes from offset 0)" in str(e.value)
    sw.close()


def test_checksum_can_be_switched_off(engine, pool, tmp_path):
    sw = SwapSpace([str(tmp_path)], "nc", engine, grow_step=1 << 20, checksum=False)
    buf = pool.alloc(8192)
    ext = sw.alloc(8192)
    sw.write(ext, buf, 8192).wait()
    sw.read(ext, buf).wait()
    sw.close()


def test_failed_write_leaves_extent_unreadable_and_others_intact(pool, tmp_path):
    eng = build_engine("threads")
    sw = SwapSpace([str(tmp_path)], "f", eng, grow_step=1 << 20)
    good, bad = sw.alloc(8192), sw.alloc(8192)
    src = pool.alloc(8192)
    _fill(src, 8192, 3)
    sw.write(good, src, 8192).wait()
    sw.write(bad, src, 8192).wait()  # a completed write, whose bytes the failed one spoils
    # Make the next write fail for real: swap the fd for a read-only one.
    f = sw._files[0]
    rw_fd = f.fd
    f.fd = os.open(f.path, os.O_RDONLY | os.O_DIRECT)
    with pytest.raises(IoError, match="Bad file descriptor"):
        sw.write(bad, src, 8192).wait()
    os.close(f.fd)
    f.fd = rw_fd
    with pytest.raises(IoError, match="no completed write"):
        sw.read(bad, src)
    dst = pool.alloc(8192)
    sw.read(good, dst).wait()
    np.testing.assert_array_equal(dst.numpy(), src.numpy())
    sw.close()
    eng.close()


def test_alloc_free_reuse_and_bad_extents(engine, pool, tmp_path):
    sw = SwapSpace([str(tmp_path)], "a", engine, grow_step=1 << 20)
    a = sw.alloc(1 << 20)
    cap = sw.capacity
    sw.free(a)
    b = sw.alloc(1 << 20)
    assert b.offset == a.offset and sw.capacity == cap  # reused, not grown
    with pytest.raises(ValueError):
        sw.free(a.__class__(b.offset + 4096, 4096))
    with pytest.raises(ValueError, match="not allocated"):
        sw.read(a.__class__(cap * 4, 4096), pool.alloc(4096))
    with pytest.raises(ValueError, match="buffer of"):
        sw.write(b, pool.alloc(4096), 8192)
    sw.close()


def test_max_swap_size_refuses_before_touching_extents(engine, pool, tmp_path):
    sw = SwapSpace([str(tmp_path)], "m", engine, grow_step=1 << 20, max_size=2 << 20)
    src = pool.alloc(1 << 20)
    _fill(src, 1 << 20, 4)
    e = sw.alloc(1 << 20)
    sw.write(e, src, 1 << 20).wait()
    sw.alloc(1 << 20)
    with pytest.raises(SwapFullError, match="io.max_swap_size"):
        sw.alloc(1 << 20)
    dst = pool.alloc(1 << 20)
    sw.read(e, dst).wait()
    np.testing.assert_array_equal(dst.numpy(), src.numpy())
    sw.close()


_SUBPROCESS = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from offload.io import BufferPool, SwapSpace, SwapFullError, ThreadEngine, AioEngine
    eng = (AioEngine if sys.argv[2] == "aio" else ThreadEngine)(block_size=1 << 16)
    sw = SwapSpace([sys.argv[1]], "full", eng, grow_step=1 << 20)
    pool = BufferPool(8 << 20)
    src = pool.alloc(1 << 20)
    src.numpy()[:] = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    first = sw.alloc(1 << 20)
    sw.write(first, src, 1 << 20).wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    out = {}
    try:
        sw.alloc(4 << 20)
    except SwapFullError as e:
        out["error"] = str(e)
    dst = pool.alloc(1 << 20)
    sw.read(first, dst).wait()
    out["intact"] = bool((dst.numpy() == src.numpy()).all())
    out["size"] = os.path.getsize(sw.paths[0])
    sw.close(); eng.close()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("name", ENGINES_AIO_SLOW)
def test_out_of_space_is_clear_and_loses_nothing(name, tmp_path):
    """A file-size limit (as a full disk would) stops growth with a clear error;
    the extent written before stays readable and the file is not left grown."""
    out = subprocess.run([sys.executable, "-c", _SUBPROCESS, str(tmp_path), name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert "cannot reserve swap space" in res["error"] and "ulimit -f" in res["error"]
    assert "File too large" in res["error"]
    assert res["intact"] and res["size"] == 1 << 20


_GROW = textwrap.dedent("""
    import json, os, resource, sys
    from offload.io import BufferPool, SwapSpace, SwapFullError, ThreadEngine, AioEngine
    eng = (AioEngine if sys.argv[2] == "aio" else ThreadEngine)(block_size=1 << 16)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    sw = SwapSpace([sys.argv[1]], "grow", eng, grow_step=8 << 20)
    out = {"sizes": []}
    try:
        for _ in range(3):
            sw.alloc(1 << 20)
            out["sizes"].append(os.path.getsize(sw.paths[0]))
    except SwapFullError as e:
        out["error"] = str(e)
    sw.close(); eng.close()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("name", ENGINES_AIO_SLOW)
def test_growth_falls_back_to_what_is_needed_when_the_grow_step_does_not_fit(name, tmp_path):
    """A disk (here a file-size limit) with room for the extents but not for
    io.grow_step more grows the file by only what each extent needs."""
    out = subprocess.run([sys.executable, "-c", _GROW, str(tmp_path), name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["sizes"] == [1 << 20, 2 << 20], res
    assert "cannot reserve swap space" in res["error"], res


def test_max_swap_size_says_what_whole_stripe_rows_it_allows(engine, tmp_path):
    """Striped over 3 paths of 1 MiB stripes, a 4 MiB limit holds 3 MiB (whole rows):
    the error says so, where it said "would be exceeded (3145728 in use)" alone."""
    sw = SwapSpace([str(tmp_path / f"d{i}") for i in range(3)], "m", engine,
                   grow_step=3 << 20, max_size=4 << 20)
    sw.alloc(3 << 20)
    with pytest.raises(SwapFullError, match=r"3145728 in use of the 3145728 it allows: whole "
                                            r"rows of io\.stripe_size x 3 io\.paths"):
        sw.alloc(4096)
    sw.close()


def test_a_grow_step_over_max_swap_size_still_grows_to_what_is_needed(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "m", engine, grow_step=4 << 20, max_size=2 << 20)
    sw.alloc(1 << 20)
    sw.alloc(1 << 20)
    assert sw.capacity == 2 << 20
    with pytest.raises(SwapFullError, match="io.max_swap_size"):
        sw.alloc(1 << 20)
    sw.close()


_HOLDER = textwrap.dedent("""
    import sys, time
    from offload.io import SwapSpace, ThreadEngine
    sw = SwapSpace([sys.argv[1]], "locked", ThreadEngine())
    print("ready", flush=True)
    time.sleep(60)
""")


def test_second_process_is_refused_then_stale_lock_reclaimed(engine, tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(SwapLockedError, match=rf"in use by another live process \(pid {p.pid}\)"):
            SwapSpace([str(tmp_path)], "locked", engine)
        # Another name in the same directory is independent.
        SwapSpace([str(tmp_path)], "other", engine).close()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # The killed holder left its files; its lock died with it, so this run takes over.
    assert os.path.exists(tmp_path / "offload-locked.swap.lock")
    sw = SwapSpace([str(tmp_path)], "locked", engine)
    sw.close()


def test_same_process_second_open_is_refused(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "dup", engine)
    with pytest.raises(SwapLockedError):
        SwapSpace([str(tmp_path)], "dup", engine)
    sw.close()


def test_a_lock_its_holder_removes_as_it_is_taken_is_taken_anew(engine, tmp_path, monkeypatch):
    """A job that opened the lock file just before its holder closed (removing it) went
    on to lock the removed file: a third job then locked the name's new file and
    emptied the swap file the second was using. The lock is the named file's."""
    import fcntl
    holder = [SwapSpace([str(tmp_path)], "race", engine)]
    real = fcntl.flock

    def flock(fd, op):  # the holder closes between this job's open and its lock
        if holder:
            holder.pop().close()
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    second = SwapSpace([str(tmp_path)], "race", engine)
    monkeypatch.undo()
    with pytest.raises(SwapLockedError):
        SwapSpace([str(tmp_path)], "race", engine)
    second.close()
    assert os.listdir(tmp_path) == []


def test_close_leaves_files_made_anew_under_its_names(engine, pool, tmp_path):
    """The directory removed under an open swap space and a new job's files made
    there: the old one's close removed the new one's files, and its lock with them."""
    d = tmp_path / "swap"
    old = SwapSpace([str(d)], "re", engine)
    old.alloc(4096)
    shutil.rmtree(d)
    new = SwapSpace([str(d)], "re", engine)
    src, dst = pool.alloc(4096), pool.alloc(4096)
    _fill(src, 4096, 3)
    ext = new.alloc(4096)
    new.write(ext, src, 4096).wait()
    old.close()
    assert sorted(os.listdir(d)) == ["offload-re.swap", "offload-re.swap.lock"]
    with pytest.raises(SwapLockedError):
        SwapSpace([str(d)], "re", engine)
    new.read(ext, dst).wait()
    np.testing.assert_array_equal(dst.numpy(), src.numpy())
    new.close()
    assert os.listdir(d) == []


def test_close_after_the_directory_became_a_file_closes_quietly(engine, tmp_path):
    """The directory removed under an open swap space and a file written under its
    name: close raised NotADirectoryError and told the user to check the disk, though
    nothing of it was left; the user's file stays."""
    d = tmp_path / "swap"
    sw = SwapSpace([str(d)], "nd", engine)
    sw.alloc(4096)
    shutil.rmtree(d)
    d.write_text("a user's file")
    sw.close()
    assert d.read_text() == "a user's file"


def test_close_keep_leaves_files(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "k", engine)
    sw.alloc(4096)
    sw.close(keep=True)
    assert os.path.exists(tmp_path / "offload-k.swap")


_NEVER_CLOSED = textwrap.dedent("""
    import sys
    from offload.io import BufferPool, SwapSpace, ThreadEngine
    eng = ThreadEngine()
    sw = SwapSpace([sys.argv[1], sys.argv[2]], "left", eng, grow_step=1 << 20)
    pool = BufferPool(1 << 20)
    buf = pool.alloc(4096)
    sw.write(sw.alloc(4096), buf, 4096).wait()
    print(" ".join(sw.paths), flush=True)
    if sys.argv[3] == "raise":
        raise RuntimeError("an error nobody caught")
""")


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_swap_files_are_removed_at_exit_without_close(tmp_path, how):
    """[Note: nothing left behind]: a process that never closes its swap space, ending
    normally or by an uncaught exception, leaves no swap or lock file."""
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    out = subprocess.run([sys.executable, "-c", _NEVER_CLOSED, *map(str, dirs), how],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == (1 if how == "raise" else 0), out.stderr
    if how == "raise":
        assert "an error nobody caught" in out.stderr
    paths = out.stdout.split()
    assert len(paths) == 2 and all(p.endswith("offload-left.swap") for p in paths)
    assert [os.listdir(d) for d in dirs] == [[], []]


def test_swap_files_are_removed_when_the_space_is_collected(engine, tmp_path):
    import gc
    sw = SwapSpace([str(tmp_path)], "gc", engine)
    assert sorted(os.listdir(tmp_path)) == ["offload-gc.swap", "offload-gc.swap.lock"]
    del sw
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_close_is_idempotent_and_stops_the_exit_hook(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "twice", engine)
    sw.close(keep=True)
    sw.close()  # nothing left to do: the kept files stay
    assert sorted(os.listdir(tmp_path)) == ["offload-twice.swap", "offload-twice.swap.lock"]


def test_a_write_is_readable_as_soon_as_its_wait_returns(engine, pool, tmp_path, monkeypatch):
    """[Note: a write is readable once it is done]: the engine's thread runs a write's
    callbacks after `wait()` has returned to the writer, so the one that records the
    write may not have run when the writer reads the extent back (held back here)."""
    import time

    with SwapSpace([str(tmp_path)], "t", engine, grow_step=1 << 20) as sw:
        record = sw._record

        def late(offset, handle):
            time.sleep(0.2)
            record(offset, handle)
        monkeypatch.setattr(sw, "_record", late)
        n = 65536
        src, dst = pool.alloc(n), pool.alloc(n)
        _fill(src, n, 7)
        ext = sw.alloc(n)
        sw.write(ext, src, n).wait()
        sw.read(ext, dst).wait()
        np.testing.assert_array_equal(dst.numpy()[:n], src.numpy()[:n])
        _fill(src, n, 8)  # a later write's record takes the place of the earlier one's
        sw.write(ext, src, n).wait()
        sw.read(ext, dst).wait()
        np.testing.assert_array_equal(dst.numpy()[:n], src.numpy()[:n])


def test_io_in_a_forked_child_raises_naming_the_parent(engine, pool, tmp_path):
    """A forked child's transfers on its parent's space: the engine's threads (or AIO
    context) are the parent's, so a read waited forever (threads) or failed with
    EINVAL (aio); both engines now raise at the call, naming the parent's pid. The
    parent's data and its own I/O are untouched."""
    import time

    with SwapSpace([str(tmp_path)], "t", engine, grow_step=1 << 20) as sw:
        buf = pool.alloc(8192)
        _fill(buf, 8192, 3)
        ext = sw.alloc(8192)
        sw.write(ext, buf, 8192).wait()
        parent = os.getpid()
        child = os.fork()
        if child == 0:  # the child: exit code 0 only for the clear error
            code = 3
            try:
                buf.numpy()[:] = 0
                for call in (lambda: sw.read(ext, buf), lambda: sw.write(ext, buf, 8192)):
                    try:
                        call().wait(timeout=5)
                        code = 1
                    except RuntimeError as e:
                        code = code if str(parent) in str(e) and "forked child" in str(e) else 2
                    if code != 3:
                        break
                else:
                    code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0
        out = pool.alloc(8192)
        sw.read(ext, out).wait()
        expect = pool.alloc(8192)
        _fill(expect, 8192, 3)
        np.testing.assert_array_equal(out.numpy(), expect.numpy())
