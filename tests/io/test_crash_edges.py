"""Crash tests of the public I/O API: each attempt runs in a child process, so a
segfault, an abort or a hang shows as the child's return code (or a timeout)
instead of taking the test run down. A child prints OK when the API answered
with the expected Python exception (or the right bytes)."""

import subprocess
import sys
import textwrap

import pytest

from ..conftest import AIO_OK, AIO_WHY, ENGINES, ENGINES_AIO_SLOW

PRELUDE = """
import os, sys, threading, time, torch
from offload.io import BufferPool, SwapExtent, SwapSpace
from offload.io.engine import AioEngine, ThreadEngine
D, ENG = sys.argv[1], sys.argv[2]
def engine(**kw):
    kw.setdefault("block_size", 64 << 10)
    kw.setdefault("queue_depth", 8)
    return AioEngine(**kw) if ENG == "aio" else ThreadEngine(threads=1, **kw)
"""


def run_child(body: str, tmp_path, engine: str = "threads", timeout: float = 30) -> str:
    code = PRELUDE + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path), engine],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"child hung for {timeout} s")
    assert p.returncode == 0, f"child died with {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "OK" in p.stdout, f"{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.mark.parametrize("name", ENGINES_AIO_SLOW)
def test_read_checked_after_its_buffer_was_released_and_the_pool_closed(name, tmp_path):
    # The checksum check of a read runs in wait(), on the caller's thread, after the
    # handle let go of the buffer: the pool's close unmapped the bytes it hashed (SIGSEGV).
    run_child("""
        swap = SwapSpace([D], "t", engine(), grow_step=1 << 20)
        pool = BufferPool(64 << 20)
        src = pool.alloc(8 << 20); src.tensor.fill_(7)
        ext = swap.alloc(8 << 20); swap.write(ext, src, 8 << 20).wait()
        dst = pool.alloc(16 << 20)
        h = swap.read(ext, dst)
        while not h.done(): time.sleep(0.01)
        dst.release(); src.release(); pool.close()
        h.wait()
        print("OK")
    """, tmp_path, name)


@pytest.mark.parametrize("name", ENGINES_AIO_SLOW)
def test_read_checked_after_the_tensors_storage_was_freed_is_a_value_error(name, tmp_path):
    # untyped_storage().resize_(0) between the read's completion and wait(): the check
    # hashed freed memory (SIGSEGV); now it says the storage went away.
    run_child("""
        swap = SwapSpace([D], "t", engine(), grow_step=1 << 20)
        src = torch.full((8 << 20,), 3, dtype=torch.uint8)
        ext = swap.alloc(8 << 20); swap.write(ext, src, 8 << 20).wait()
        dst = torch.empty(8 << 20, dtype=torch.uint8)
        h = swap.read(ext, dst)
        while not h.done(): time.sleep(0.01)
        dst.untyped_storage().resize_(0)
        try:
            h.wait()
        except ValueError as e:
            assert "storage was resized or freed" in str(e), e
            print("OK")
    """, tmp_path, name)


def _gated_read_into(victim_action: str) -> str:
    """A read into a small heap tensor `t` queued behind a read whose done callback
    holds the one worker of a thread engine (buffered I/O, so heap memory passes the
    alignment check); `victim_action` runs on `t` meanwhile, then a bystander tensor
    of the same size is allocated (malloc hands it the freed chunk)."""
    return f"""
        swap = SwapSpace([D], "t", ThreadEngine(threads=1, direct=False), grow_step=1 << 20)
        n = 256 << 10
        ext = swap.alloc(n); swap.write(ext, torch.full((n,), 5, dtype=torch.uint8), n).wait()
        gate = threading.Event()
        first = swap.read(ext, torch.empty(n, dtype=torch.uint8))
        first.add_done_callback(lambda h: gate.wait(10))
        t = torch.empty(n, dtype=torch.uint8)
        h = swap.read(ext, t)
        {victim_action}
        bystander = torch.zeros(n, dtype=torch.uint8)
        gate.set()
        try:
            h.wait()
        except ValueError:
            pass
        assert int(bystander.count_nonzero()) == 0, "the read landed in another tensor"
        print("OK")
    """


def test_a_tensor_whose_storage_is_dropped_mid_read_keeps_it_alive(tmp_path):
    # t.set_() dropped the storage the queued read was about to fill (the handle only
    # held the tensor): the read overwrote whatever malloc put there next (SIGSEGV or
    # a silently changed tensor). The transfer now holds the storage itself.
    run_child(_gated_read_into("t.set_()"), tmp_path)


@pytest.mark.xfail(strict=True, reason="torch cannot lock a storage against resize_: a "
                   "storage freed with untyped_storage().resize_(0) while a read into it is "
                   "queued still receives the read, into memory malloc has given to another "
                   "tensor; needs the engine to move bytes through memory it owns "
                   "(a BufferPool bounce buffer) for caller-owned tensors")
def test_a_tensor_whose_storage_is_resized_mid_read_does_not_corrupt_another(tmp_path):
    run_child(_gated_read_into("t.untyped_storage().resize_(0)"), tmp_path)


@pytest.mark.parametrize("name", ENGINES_AIO_SLOW)
def test_an_extent_with_a_longer_length_than_reserved_is_refused(name, tmp_path):
    # SwapExtent(first.offset, 8192) over a 4 KiB extent: only the offset was checked,
    # so the write ran over the next extent, whose bytes were lost.
    run_child("""
        swap = SwapSpace([D], "t", engine(), grow_step=1 << 20)
        pool = BufferPool(16 << 20)
        a, b = swap.alloc(4096), swap.alloc(4096)
        keep = pool.alloc(4096); keep.tensor.fill_(2)
        swap.write(b, keep, 4096).wait()
        big = pool.alloc(8192); big.tensor.fill_(1)
        try:
            swap.write(SwapExtent(a.offset, 8192), big, 8192)
            raise SystemExit("a forged extent was written")
        except ValueError as e:
            assert "is not allocated" in str(e), e
        try:
            swap.read(SwapExtent(b.offset, 8192), keep, 4096)
            raise SystemExit("a forged extent was read")
        except ValueError:
            pass
        swap.read(b, keep).wait()
        assert int(keep.tensor.sum()) == 2 * 4096
        import numpy as np
        swap.write(a, big, np.int64(4096)).wait()  # a numpy count is a count
        print("OK")
    """, tmp_path, name)


@pytest.mark.parametrize("name", ENGINES)
def test_closing_a_swap_space_from_a_done_callback_refuses_rather_than_hangs(name, tmp_path):
    # close() waits for the transfers in flight, which the engine's completion thread
    # (where done callbacks run) must finish: called there, it waited for itself.
    run_child("""
        swap = SwapSpace([D], "t", engine(), grow_step=4 << 20)
        pool = BufferPool(64 << 20)
        src = pool.alloc(1 << 20); src.tensor.fill_(1)
        e1, e2 = swap.alloc(1 << 20), swap.alloc(1 << 20)
        swap.write(e1, src, 1 << 20).wait(); swap.write(e2, src, 1 << 20).wait()
        errors, submitted = [], threading.Event()
        def close_here(h):
            submitted.wait(10)  # h2 queued behind this callback, or unreaped
            try:
                swap.close()
            except RuntimeError as e:
                errors.append(e)
        h1 = swap.read(e1, pool.alloc(1 << 20))
        h1.add_done_callback(close_here)
        h2 = swap.read(e2, pool.alloc(1 << 20))
        submitted.set()
        h1.wait(10); h2.wait(10)
        assert errors and "completion thread" in str(errors[0]), errors
        swap.close()
        assert not os.listdir(D), os.listdir(D)
        print("OK")
    """, tmp_path, name, timeout=40)


def test_an_exception_inside_libaios_submit_fails_the_requests_rather_than_hangs(tmp_path):
    # A signal handler of the program's that raises inside libaio's submit(), after
    # io_submit returned, made libaio forget requests the kernel took: their completion
    # killed the reaper thread (KeyError) and every later wait lasted forever. Here the
    # exception is raised where such a handler would (a profile hook at that call).
    out = run_child("""
        import libaio
        swap = SwapSpace([D], "t", engine(queue_depth=32), grow_step=1 << 20)
        pool = BufferPool(64 << 20)
        src = pool.alloc(4 << 20); src.tensor.fill_(7)
        ext = swap.alloc(4 << 20)
        armed = [True]
        def prof(frame, event, arg):
            if armed[0] and event == "call" and frame.f_code.co_name == "_raise_on_negative" \\
                    and frame.f_back is not None and frame.f_back.f_code.co_name == "submit":
                armed[0] = False
                raise KeyboardInterrupt
        sys.setprofile(prof)
        try:
            swap.write(ext, src, 4 << 20).wait(timeout=20)
            print("no interrupt")
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        time.sleep(0.5)  # the forgotten requests complete: the reaper fails
        try:
            h = swap.write(ext, src, 4 << 20)
            h.wait(timeout=20)
            print("second write done")
        except TimeoutError:
            print("HUNG")
        except Exception as e:
            print("failed:", type(e).__name__, e)
        src.release(); swap.close(); pool.close()
        print("OK")
    """, tmp_path, "aio")
    assert "HUNG" not in out and "no interrupt" not in out, out
    assert "failed:" in out and ("completion was lost" in out or "is closed" in out), out


@pytest.mark.skipif(not AIO_OK, reason=AIO_WHY)
def test_a_forked_child_that_drops_an_inherited_aio_engine_prints_nothing(tmp_path):
    # The child's copy of the AIO context is the parent's: libaio's __del__ released
    # it there as the child dropped it ("Exception ignored ... io_queue_release").
    # A forked child now forgets the contexts it inherited; the parent's still works.
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent("""
        import gc
        eng = engine()
        pid = os.fork()
        if pid == 0:
            del eng
            gc.collect()
            sys.stderr.flush()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        pool = BufferPool(1 << 20)
        swap = SwapSpace([D], "t", eng, grow_step=1 << 20)
        buf = pool.alloc(4096)
        buf.tensor.fill_(7)
        swap.write(swap.alloc(4096), buf, 4096).wait()
        swap.close(); eng.close()
        print("OK", os.waitstatus_to_exitcode(status))
        """), str(tmp_path), "aio"], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "OK 0" and p.stderr == "", (p.stdout, p.stderr)
