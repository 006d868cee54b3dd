"""The I/O layer under failure and misuse, on real files: a failing disk (an ext4
loop mount shut down under the swap files, so every transfer returns EIO), swap
files that are links, transfers in flight at close, use after close, buffers and
segments the engine cannot address, callbacks that raise."""

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from offload.io import IoError, IoHandle, Segment, SwapPathError, SwapSpace
from offload.io.buffers import mapped_empty

from .conftest import ENGINES, build_engine

def _open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


# -- a failing disk --------------------------------------------------------------

@pytest.mark.parametrize("name", ENGINES)
def test_a_failing_disk_names_the_swap_file_and_leaves_nothing_open(name, pool, failing_disk):
    """EIO on reads, writes and growth is an IoError naming the swap file, at once; the
    extent written before stays as it was; close() closes every descriptor even though
    removing the files fails, and says which file and what to do."""
    d, fail = failing_disk
    eng = build_engine(name)
    sw = SwapSpace([d], "dead", eng, grow_step=1 << 20)
    buf = pool.alloc(256 << 10)
    buf.numpy()[:] = 5
    old, new = sw.alloc(256 << 10), sw.alloc(256 << 10)
    sw.write(old, buf, 256 << 10).wait()
    fail()
    with pytest.raises(IoError, match=r"write .* in .*offload-dead\.swap failed: Input/output"):
        sw.write(new, buf, 256 << 10).wait(10)
    with pytest.raises(IoError, match=r"read .* in .*offload-dead\.swap failed: Input/output"):
        sw.read(old, buf).wait(10)
    with pytest.raises(IoError) as grow:  # not "the disk is full"
        sw.alloc(8 << 20)
    assert grow.value.errno == errno.EIO and "offload-dead.swap" in str(grow.value)
    assert "free disk space" not in str(grow.value) and "check the disk" in str(grow.value)
    with pytest.raises(OSError, match=r"offload-dead\.swap.*check the disk"):
        sw.close()
    assert not any(p.startswith(d) for p in _open_fds()), "swap or lock file left open"
    eng.close()


@pytest.mark.parametrize("engine", ["threads", "aio"])
def test_room_a_failed_disk_cannot_make_is_an_io_error_not_a_budget(failing_disk, engine):
    """Room in HOST is made by writing a dirty partition down to the swap file; on a disk
    that died, that write fails with EIO. The reservation raised BudgetExceededError,
    which sends the user to raise a budget: it is the write's IoError, led by what it
    was for and caused by it, and the partition stays whole in HOST. A reservation no
    eviction could serve is a budget's still."""
    from offload.store import BudgetExceededError, Tier, TieredStore
    from ..conftest import AIO_OK
    from ..store.conftest import page_tensor, store_config
    if engine == "aio" and not AIO_OK:
        pytest.skip("libaio is not installed")
    d, fail = failing_disk
    s = TieredStore(store_config(d, engine=engine, device_pages=1, host_pages=1))
    try:
        s.put("b", page_tensor(3), tier="NVME").wait()  # the swap file is open and grown
        s.free("b")
        s.put("a", page_tensor(1), tier="HOST")  # dirty, its only copy
        fail()
        with pytest.raises(IoError) as e:
            s.put("x", page_tensor(2), tier="HOST")
        assert not isinstance(e.value, BudgetExceededError) and e.value.errno == errno.EIO
        assert str(e.value).startswith("cannot make room for ")
        assert "evicting partition 'a' failed: write of 4096 bytes at offset 0 in " \
               f"{d}/offload-r0-param.swap failed: Input/output error" in str(e.value)
        assert isinstance(e.value.__cause__, IoError) and e.value.filename == e.value.path
        assert torch.equal(s.get("a", Tier.HOST), page_tensor(1))
        with pytest.raises(BudgetExceededError, match="more than its whole budget"):
            s.put("y", page_tensor(4, 2), tier="HOST")
    finally:
        try:
            s.close()
        except OSError:  # removing the swap files fails on the dead disk
            pass


# -- links where swap files go ---------------------------------------------------------

@pytest.mark.parametrize("which", ["swap", "lock"])
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_swap_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, which, link):
    """A swap or lock file name that is a link to another file would truncate and
    overwrite that file; it is refused, naming the link, and the file keeps its bytes."""
    d = tmp_path / "swap"
    d.mkdir()
    target = tmp_path / "precious"
    target.write_bytes(b"the user's data\n")
    name = d / ("offload-l.swap" + (".lock" if which == "lock" else ""))
    (os.symlink if link == "symlink" else os.link)(target, name)
    eng = build_engine("threads")
    with pytest.raises(SwapPathError, match=rf"{name}.*(symbolic link|other name)") as e:
        SwapSpace([str(d)], "l", eng)
    assert e.value.filename == str(name)
    assert target.read_bytes() == b"the user's data\n"
    assert os.path.lexists(name)  # not ours to remove
    eng.close()


# -- close, and use after close ---------------------------------------------------------

@pytest.mark.parametrize("name", ENGINES)
def test_close_waits_for_transfers_in_flight(name, pool, tmp_path):
    """close() with a write still in flight lets it finish on the file it was meant for
    (its descriptor is not closed under it, nor reused by another file meanwhile)."""
    eng = build_engine(name, block_size=4096, queue_depth=2)
    sw = SwapSpace([str(tmp_path)], "busy", eng, grow_step=4 << 20)
    n = 4 << 20
    buf = pool.alloc(n)
    buf.numpy()[:] = 3
    ext = sw.alloc(n)
    h = sw.write(ext, buf, n)
    sw.close(keep=True)
    assert h.done(), "close() returned with a write in flight"
    h.wait(0)
    with open(tmp_path / "offload-busy.swap", "rb") as f:
        assert f.read(n) == bytes([3]) * n
    eng.close()


@pytest.mark.parametrize("name", ENGINES)
def test_a_closed_swap_space_refuses_use(name, pool, tmp_path):
    """alloc, write and read after close() raise a clear error: they failed with
    ZeroDivisionError or IndexError, and alloc handed out an extent of no file."""
    eng = build_engine(name)
    sw = SwapSpace([str(tmp_path)], "shut", eng, grow_step=1 << 20)
    buf = pool.alloc(4096)
    ext = sw.alloc(4096)
    sw.write(ext, buf, 4096).wait()
    sw.close()
    for use in (lambda: sw.alloc(4096), lambda: sw.write(ext, buf, 4096),
                lambda: sw.read(ext, buf)):
        with pytest.raises(RuntimeError, match="swap shut is closed"):
            use()
    sw.free(ext)  # returning an extent is bookkeeping: owners may close in any order
    eng.close()


# -- refused requests change nothing -----------------------------------------------------

@pytest.mark.parametrize("name", ENGINES)
def test_a_refused_write_keeps_the_extents_last_write_readable(name, pool, tmp_path):
    """A write the engine refuses before it starts (a misaligned buffer, a closed
    engine) moved no byte, so the extent still reads back its last write."""
    eng = build_engine(name)
    sw = SwapSpace([str(tmp_path)], "keep", eng, grow_step=1 << 20)
    n = 64 << 10
    buf = pool.alloc(n)
    buf.numpy()[:] = 9
    ext = sw.alloc(n)
    sw.write(ext, buf, n).wait()
    odd = torch.zeros(n + 64, dtype=torch.uint8)[1:1 + n]
    with pytest.raises(ValueError, match="aligned"):
        sw.write(ext, odd, n)
    out = pool.alloc(n)
    sw.read(ext, out).wait()
    assert (out.numpy()[:n] == 9).all()
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        sw.write(ext, buf, n)
    sw.close()


# -- what the engine cannot address ---------------------------------------------------------

_META = textwrap.dedent("""
    import sys, torch
    from offload.io import SwapSpace, ThreadEngine
    eng = ThreadEngine()
    sw = SwapSpace([sys.argv[1]], "meta", eng, grow_step=1 << 20)
    t = torch.empty(1 << 16, dtype=torch.uint8, device="meta")
    try:
        sw.write(sw.alloc(1 << 16), t, 1 << 16)
    except (TypeError, ValueError) as e:
        print("refused:", e)
    sw.close()
    eng.close()
""")


def test_a_tensor_without_host_memory_is_refused_not_dereferenced(tmp_path):
    """A tensor on another device (meta here; a CUDA tensor alike) has no host bytes at
    its data_ptr: hashing or reading there crashed the interpreter."""
    out = subprocess.run([sys.executable, "-c", _META, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert "refused: a meta tensor has no host memory" in out.stdout, out.stdout


@pytest.mark.parametrize("name", ENGINES)
def test_buffers_that_do_not_own_their_span_are_refused(name, pool, tmp_path):
    """Only contiguous host memory of the buffer's own may be read into or written from:
    an expanded (stride 0) or strided tensor or array spans fewer bytes than
    numel x itemsize, so a read there overran the allocation, and a read-only array
    cannot take a read."""
    eng = build_engine(name)
    sw = SwapSpace([str(tmp_path)], "bad", eng, grow_step=1 << 20)
    n = 1 << 20
    ext = sw.alloc(n)
    src = pool.alloc(n)
    sw.write(ext, src, n).wait()
    page = mapped_empty(1024, torch.float32)  # 4 KiB, page aligned
    expanded = page.view(1, 1024).expand(256, 1024)  # 1 MiB view of 4 KiB
    strided = mapped_empty(2 * n, torch.uint8)[::2]
    arr = np.broadcast_to(page.numpy().view(np.uint8), (256, 4096))
    readonly = pool.alloc(n).numpy()
    readonly.flags.writeable = False
    for bad in (expanded, strided, arr, strided.numpy()):
        with pytest.raises(ValueError, match="contiguous"):
            sw.read(ext, bad, n)
        with pytest.raises(ValueError, match="contiguous"):
            sw.write(ext, bad, n)
    with pytest.raises(ValueError, match="read-only"):
        sw.read(ext, readonly, n)
    sw.close()
    eng.close()


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("offset,address,length", [
    (0, 1 << 64, 4096), (0, -4096, 4096), (0, 0, 4096), (0, 1 << 20, -4096),
    (-4096, 1 << 20, 4096)], ids=["address-too-big", "address-negative", "address-null",
                                  "length-negative", "offset-negative"])
def test_impossible_segments_are_refused_before_submission(name, tmp_path, offset, address,
                                                           length):
    """Segments no file or memory can hold raise ValueError at submit: an address past
    the address space left the thread engine's handle waiting forever, a negative
    length completed as a transfer of negative bytes."""
    eng = build_engine(name)
    path = str(tmp_path / "raw")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 1 << 20)
    try:
        for op in ("read", "write"):
            with pytest.raises(ValueError, match=r"offset|address|length"):
                eng.submit(op, [Segment(fd, path, offset, address, length)]).wait(5)
    finally:
        os.close(fd)
        eng.close()


# -- callbacks ------------------------------------------------------------------------------

class _FailingRecorder:
    """A trace recorder whose end-of-request hook raises, on the engine's thread."""

    def async_begin(self, *a, **kw):
        return 0

    def async_end(self, *a, **kw):
        raise RuntimeError("recorder boom")


@pytest.mark.parametrize("name", ENGINES)
def test_a_raising_done_callback_does_not_stop_the_engine(name, pool, tmp_path, caplog):
    """A done callback that raises on the engine's thread is logged; the thread (the
    AIO reaper) lives on and completes later requests: it died, and every later wait
    hung."""
    eng = build_engine(name, recorder=_FailingRecorder())
    sw = SwapSpace([str(tmp_path)], "cb", eng, grow_step=1 << 20)
    buf = pool.alloc(65536)
    ext = sw.alloc(65536)
    with caplog.at_level("ERROR", logger="offload.io"):
        for _ in range(3):
            sw.write(ext, buf, 65536).wait(10)
            sw.read(ext, buf).wait(10)
    assert "recorder boom" in caplog.text
    sw.close()
    eng.close()


def test_callbacks_after_a_raising_one_still_run(caplog):
    h = IoHandle("write", 4096, "write 4096 B at f:0")
    h._add_blocks(1)
    ran = []

    def boom(h):
        raise RuntimeError("callback boom")
    h.add_done_callback(boom)
    h.add_done_callback(ran.append)
    assert h._block_done()
    with caplog.at_level("ERROR", logger="offload.io"):
        h._finish()
    assert ran == [h] and h.done() and h.wait(0) == 4096
    assert "callback boom" in caplog.text


def test_ctrl_c_anywhere_in_releasing_an_aio_context_never_releases_it_twice():
    """[Note: the context is released once] A KeyboardInterrupt raised at each line in
    turn while the context is released (as Ctrl-C arrives between two bytecodes): its
    close and __del__ afterwards never release it again. With libaio's own close, the
    interrupt between its release and its `del self._ctx` made the next close raise
    EINVAL (printed as "Exception ignored" when __del__ ran at exit)."""
    libaio = pytest.importorskip("libaio")
    from offload.io.engine import destroy_context, libaio_status
    if not libaio_status()[0]:
        pytest.skip(libaio_status()[1])
    interrupted = 0
    for at in range(1, 12):
        ctx = libaio.AIOContext(4)
        lines = 0

        def trace(frame, event, arg):
            nonlocal lines
            if event == "line":
                lines += 1
                if lines == at:
                    raise KeyboardInterrupt
            return trace
        sys.settrace(trace)
        try:
            destroy_context(ctx)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        ctx.close()  # raised OSError(EINVAL) where the context was released twice
        ctx.__del__()
    assert interrupted >= 3  # the trace reached the lines that release it
