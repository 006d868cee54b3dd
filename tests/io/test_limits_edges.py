"""Operating-system limits a user's machine or container may set: Linux AIO contexts
used up (fs.aio-max-nr), few open files (ulimit -n), a small file-size limit
(ulimit -f), memory that cannot be mapped (ulimit -v, a cgroup), a file system
without fallocate, and environment variables a user may have set. Each gives an
error that names the limit and the fix, or a documented fallback, raised before
anything of the user's is overwritten.

Every case runs in a child process, so the limits never reach pytest itself."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import loop_mount, unmount

ROOT = Path(__file__).resolve().parents[2]
AIO_MAX = Path("/proc/sys/fs/aio-max-nr")

# The child's helpers: a small model, a config in the style of tests/engine's
# `engine_cfg("nvme", "host", "nvme")`, one training step, and `report()` to hand
# a result back as the last line of stdout.
PRELUDE = textwrap.dedent("""
    import json, os, resource, sys, traceback
    sys.path.insert(0, {root!r})
    import offload
    import torch
    from tests.engine.models import TiedTwice, lm_batches, lm_loss

    def cfg(paths, params="nvme", grads="host", optimizer="nvme", **io):
        return {{
            "engine": {{"params": params, "grads": grads, "optimizer": optimizer,
                        "dtype": "fp32", "group_size": 3000}},
            "optim": {{"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096}},
            "io": {{"paths": paths, "buffer_budget": "32MiB", "grow_step": "4MiB", **io}},
            "store": {{"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}},
        }}

    def step(engine, batch):
        x, y = batch
        engine.backward(lm_loss(engine(x), y))
        return engine.step()

    def failure(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except BaseException as e:
            return {{"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                     "msg": str(e), "errno": getattr(e, "errno", None)}}
        return None

    def report(**kw):
        print("RESULT " + json.dumps(kw), flush=True)

    torch.manual_seed(0)
""").format(root=str(ROOT))


def run_child(body: str, *, timeout: float = 60, env: dict | None = None,
              unset: tuple[str, ...] = ()) -> dict:
    """Runs PRELUDE + `body` in a fresh interpreter; returns what it reported."""
    child_env = {**os.environ, **(env or {})}
    for k in unset:
        child_env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout, env=child_env,
                          cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"child exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def aio_limit_writable() -> bool:
    try:
        return os.geteuid() == 0 and os.access(AIO_MAX, os.W_OK)
    except OSError:
        return False


@pytest.fixture
def aio_max_nr_restored():
    """Saves fs.aio-max-nr and writes it back afterwards, also when the child that
    lowered it was killed before its own `finally` ran."""
    if not aio_limit_writable():
        pytest.skip("lowering fs.aio-max-nr needs root and a writable /proc/sys")
    try:
        import libaio  # noqa: F401
    except (ImportError, OSError):
        pytest.skip("libaio does not load here")
    old = AIO_MAX.read_text().strip()
    yield old
    AIO_MAX.write_text(old)


# The child lowers fs.aio-max-nr to what is in use plus `room` only around `fn`, and
# restores it in a finally: other processes on the machine use AIO too.
AIO_WINDOW = """
    def with_aio_room(room, fn, *args, **kw):
        old = open("/proc/sys/fs/aio-max-nr").read().strip()
        try:
            used = int(open("/proc/sys/fs/aio-nr").read())
            with open("/proc/sys/fs/aio-max-nr", "w") as f:
                f.write(str(used + room))
            return fn(*args, **kw)
        finally:
            with open("/proc/sys/fs/aio-max-nr", "w") as f:
                f.write(old)
"""


def test_aio_contexts_used_up_name_the_limit_and_auto_falls_back(tmp_path, aio_max_nr_restored):
    """With no AIO request slots left on the machine (fs.aio-nr at fs.aio-max-nr),
    io.engine = 'aio' raises an OSError (EAGAIN) naming fs.aio-max-nr, the sysctl
    that raises it, io.queue_depth and io.engine = 'threads', not libaio's bare
    "io_queue_init"; so does a queue depth larger than the slots left. io.engine =
    'auto' falls back to the thread engine."""
    out = run_child(AIO_WINDOW + f"""
    from offload.config import IoConfig
    from offload.io import make_engine

    def make(**kw):
        e = make_engine(IoConfig(paths=[{str(tmp_path / "swap")!r}], **kw))
        name = e.name
        e.close()
        return name

    def tried(want, *args, **kw):  # the slots are the machine's: another process (a
        for _ in range(5):  # test beside this one) may free some meanwhile; a broken
            got = with_aio_room(*args, **kw)  # engine gives the same answer every time
            if want(got):
                break
        return got

    res = {{}}
    res["aio"] = tried(lambda r: r is not None, 0, failure, make, engine="aio")
    res["deep"] = tried(lambda r: r is not None, 256, failure, make, engine="aio",
                        queue_depth=1024)
    res["auto"] = tried(lambda r: r == "threads", 0, make, engine="auto")
    report(**res)
    """, timeout=60)
    for case in ("aio", "deep"):
        err = out[case]
        assert err is not None, f"{case}: the engine was made with no AIO slots left"
        assert "OSError" in err["mro"] and err["errno"] == 11, err
        for words in ("fs.aio-max-nr", "sysctl", "io.queue_depth", "io.engine = 'threads'"):
            assert words in err["msg"], (case, words, err["msg"])
    assert "1024" in out["deep"]["msg"]
    assert out["auto"] == "threads"


@pytest.mark.slow  # lowers a machine-wide limit for a whole save: other processes' AIO fails
def test_checkpoint_save_when_aio_contexts_run_out(tmp_path, aio_max_nr_restored):
    """AIO slots taken by other processes after initialize do not fail a checkpoint
    save: its chunk I/O falls back to threads, and the checkpoint loads."""
    out = run_child(AIO_WINDOW + f"""
    d = {str(tmp_path)!r}
    engine = offload.initialize(TiedTwice(), cfg([d + "/swap"], engine="aio"))
    step(engine, lm_batches(1)[0])
    err = with_aio_room(0, failure, engine.save_checkpoint, d + "/ckpt")
    engine.close()
    loaded = failure(lambda: offload.initialize(TiedTwice(), cfg([d + "/swap2"]),
                                                resume=d + "/ckpt").close())
    report(err=err, loaded=loaded)
    """, timeout=60)
    assert out["err"] is None, out["err"]["msg"]
    assert out["loaded"] is None, out["loaded"]["msg"]


def test_few_open_files_name_ulimit_n(tmp_path):
    """Under a low open-file limit (ulimit -n) a swap directory's probe, a swap file's
    open over several striped io.paths, and a checkpoint save each raise an error
    that names the limit and how to raise it, never "remove what is there" or a
    disk-fault hint; nothing of the swap directories is left behind by the probe."""
    out = run_child(f"""
    import offload.engine.training_checkpoint  # imported before the limit is lowered
    from offload.config import IoConfig
    from offload.io import check_swap_dirs, make_engine, open_swap

    d = {str(tmp_path)!r}
    paths = [d + f"/s{{i}}" for i in range(3)]
    for p in paths:
        os.makedirs(p)
    eng = make_engine(IoConfig(paths=paths, engine="threads"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def limited(extra, fn, *args):
        used = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + extra, hard))
        try:
            return failure(fn, *args)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    res = {{}}
    res["probe"] = limited(0, check_swap_dirs, paths)
    res["swap"] = limited(3, open_swap, IoConfig(paths=paths, engine="threads"), "t", eng)
    res["leftover"] = sorted(os.listdir(paths[0]) + os.listdir(paths[2]))
    eng.close()
    engine = offload.initialize(TiedTwice(), cfg(paths))
    step(engine, lm_batches(1)[0])
    res["save"] = limited(1, engine.save_checkpoint, d + "/ckpt")
    res["published"] = os.path.exists(d + "/ckpt")
    engine.close()
    report(**res)
    """)
    for case in ("probe", "swap", "save"):
        err = out[case]
        assert err is not None, f"{case}: did not fail under the lowered limit"
        assert "ulimit -n" in err["msg"], (case, err["msg"])
        assert "remove what is there" not in err["msg"], (case, err["msg"])
        assert "local, writable disk" not in err["msg"], (case, err["msg"])
    assert out["leftover"] == []
    assert not out["published"]


def test_an_open_file_limit_met_by_initialize_is_named_wherever_it_falls(tmp_path):
    """initialize under open-file limits one descriptor apart, from the first that
    fails to the first that trains: each failure names ulimit -n. One limit got past
    the swap files and failed inside torch's lazy import of torch.distributed.tensor,
    a raw EMFILE naming a torch source file."""
    out = run_child(f"""
    paths = [{str(tmp_path)!r} + f"/s{{i}}" for i in range(3)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    import offload.engine  # imported before the limit is lowered
    assert "torch.distributed.tensor" not in sys.modules  # what initialize imports
    errors = []
    for extra in range(60):
        used = len(os.listdir("/proc/self/fd")) - 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + extra, hard))
        try:
            engine = offload.initialize(TiedTwice(), cfg(paths))
        except Exception as e:
            errors.append(str(e))
            continue
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        engine.close()
        break
    report(errors=errors, trained=extra < 59)
    """)
    assert out["trained"] and out["errors"], out
    for msg in out["errors"]:
        assert "ulimit -n" in msg, msg


@pytest.mark.slow  # 3 s; the ulimit -f hint is checked by default in test_swap.py
def test_small_file_size_limit_names_ulimit_f(tmp_path):
    """Under a file-size limit (ulimit -f; Python ignores SIGXFSZ, so writes fail with
    EFBIG) initialize refuses with SwapFullError, a step fails whole with a message
    naming the limit (the state stays at its previous version and the next step,
    the limit lifted, trains), and a checkpoint save fails naming the limit and
    publishes nothing."""
    out = run_child(f"""
    import offload.engine.training_checkpoint  # imported before the limit is lowered
    import signal
    d = {str(tmp_path)!r}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limited(n, fn, *args):
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
        try:
            return failure(fn, *args)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    res = {{"sigxfsz_ignored": signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN}}
    res["init"] = limited(64 << 10, offload.initialize, TiedTwice(), cfg([d + "/a"]))
    engine = offload.initialize(TiedTwice(), cfg([d + "/b"]))
    batches = lm_batches(3)
    step(engine, batches[0])
    before = engine.global_step
    res["step"] = limited(64 << 10, step, engine, batches[1])
    res["same_step"] = engine.global_step == before
    res["next"] = failure(step, engine, batches[1])
    res["save"] = limited(4096, engine.save_checkpoint, d + "/ckpt")
    res["published"] = os.path.exists(d + "/ckpt")
    engine.close()
    report(**res)
    """)
    assert out["sigxfsz_ignored"]
    assert out["init"] is not None and out["init"]["type"] == "SwapFullError", out["init"]
    assert "ulimit -f" in out["init"]["msg"]
    assert out["step"] is not None and "ulimit -f" in out["step"]["msg"], out["step"]
    assert out["same_step"] and out["next"] is None, out
    assert out["save"] is not None and "ulimit -f" in out["save"]["msg"], out["save"]
    assert not out["published"]


def test_host_memory_that_cannot_be_mapped_names_the_budget_keys(tmp_path):
    """Where the budgets cannot be backed by memory (ulimit -v, a container's limit:
    mmap fails with ENOMEM), the step raises MemoryError naming store.host_budget
    and io.buffer_budget, not a bare "[Errno 12] Cannot allocate memory" from
    inside the buffer pool; with the limit lifted the next step trains."""
    out = run_child(f"""
    d = {str(tmp_path)!r}
    # everything a step imports lazily, imported before the limit
    warm = offload.initialize(TiedTwice(), cfg([d + "/warm"]))
    step(warm, lm_batches(1)[0])
    warm.close()
    engine = offload.initialize(TiedTwice(), cfg([d + "/swap"]))
    vm = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
              if ln.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm, resource.RLIM_INFINITY))
    err = failure(step, engine, lm_batches(1)[0])
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    after = failure(step, engine, lm_batches(1)[0])
    engine.close()
    report(err=err, after=after)
    """)
    err = out["err"]
    assert err is not None, "the step ran with no address space left"
    assert "MemoryError" in err["mro"], err
    assert "store.host_budget" in err["msg"] and "io.buffer_budget" in err["msg"], err["msg"]
    assert out["after"] is None, out["after"]  # the limit lifted, training goes on


def test_an_address_space_limit_at_the_first_step_leaves_no_swap_files(tmp_path):
    """Under an address-space limit with no room for a thread's stack, the first step's
    parallel ops could not start OpenMP's threads (the main thread's, the update
    thread's), and libgomp ended the process with exit(1): no unwinding, the swap
    files and locks left. Started at initialize, the step runs (or raises) and close
    removes them."""
    out = run_child(f"""
    d = {str(tmp_path)!r}
    torch.set_num_threads(2)
    engine = offload.initialize(TiedTwice(), cfg([d + "/swap"]))
    vm = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
              if ln.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
    err = failure(step, engine, lm_batches(1, batch=4, seq=64)[0])
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    engine.close()
    report(err=err, left=os.listdir(d + "/swap"))
    """)
    assert out["left"] == [], out
    assert out["err"] is None or "MemoryError" in out["err"]["mro"], out["err"]


def test_a_file_written_whole_under_the_open_file_limit_names_it_and_the_limit(tmp_path):
    """A trace, a tuned configuration or a report written whole (replace_atomically)
    under `ulimit -n` said "Too many open files" of its temporary file's name, with no
    limit or fix; the file that was there stays."""
    out = run_child(f"""
    from pathlib import Path
    from offload.files import replace_atomically
    target = Path({str(tmp_path)!r}) / "run.trace.json"
    target.write_text("kept")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
    err = failure(replace_atomically, target, lambda f: f.write(b"new"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    report(err=err, kept=target.read_text(), files=os.listdir(target.parent))
    """)
    assert out["err"]["errno"] == 24 and "ulimit -n" in out["err"]["msg"], out["err"]
    assert str(tmp_path / "run.trace.json") in out["err"]["msg"], out["err"]
    assert out["kept"] == "kept" and out["files"] == ["run.trace.json"], out


@pytest.fixture
def ext2_dir(tmp_path):
    """A directory on a fresh ext2 file system (no fallocate: its files have no
    extents), loop mounted; skips where mounting is not allowed."""
    mnt = loop_mount(tmp_path, "mnt", 64, "ext2")
    try:
        yield mnt
    finally:
        unmount(mnt)


def test_swap_on_a_file_system_without_fallocate(ext2_dir):
    """Swap files on a file system that has no fallocate (ext2; some network and FUSE
    file systems) are reserved by writing zeros instead: training, a checkpoint
    save, resuming from it and close work, and no "the disk failed" error is
    raised; more than the disk holds is still a SwapFullError from alloc(), with
    the file cut back to what it held."""
    out = run_child(f"""
    from offload.config import IoConfig
    from offload.io import make_engine, open_swap

    d = {str(ext2_dir)!r}
    engine = offload.initialize(TiedTwice(), cfg([d + "/swap"]))
    ok = [step(engine, b) for b in lm_batches(2)]
    engine.save_checkpoint(d + "/ckpt")
    engine.close()
    left = sorted(os.listdir(d + "/swap"))
    resumed = offload.initialize(TiedTwice(), cfg([d + "/swap"]), resume=d + "/ckpt")
    step_after = resumed.global_step
    resumed.close()
    io = IoConfig(paths=[d + "/big"], grow_step="1MiB")
    eng = make_engine(io)
    swap = open_swap(io, "big", eng)
    swap.alloc(1 << 20)
    full = failure(swap.alloc, 256 << 20)
    size = os.path.getsize(swap.paths[0])
    swap.close()
    eng.close()
    report(ok=ok, left=left, step_after=step_after, full=full and full["type"], size=size)
    """)
    assert out == {"ok": [True, True], "left": [], "step_after": 2, "full": "SwapFullError",
                   "size": 1 << 20}


@pytest.mark.slow  # 3 s; it passed before any change here: a guard, not a fix
def test_user_environment_and_tmpfs_swap(tmp_path):
    """A user's environment (OMP_NUM_THREADS=1, TMPDIR naming a missing directory,
    HOME unset) and swap files on tmpfs (/dev/shm, which may refuse O_DIRECT: auto
    then uses buffered I/O) still initialize, train, save a checkpoint and close."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    shm = f"/dev/shm/offload-limits-{os.getpid()}"
    try:
        out = run_child(f"""
        d = {str(tmp_path)!r}
        engine = offload.initialize(TiedTwice(), cfg([{shm!r}]))
        ok = [step(engine, b) for b in lm_batches(2)]
        engine.save_checkpoint(d + "/ckpt")
        engine.close()
        report(ok=ok, left=sorted(os.listdir({shm!r})), home=os.environ.get("HOME"))
        """, env={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "missing")},
                        unset=("HOME",))
    finally:
        subprocess.run(["rm", "-rf", shm], check=False)
    assert out == {"ok": [True, True], "left": [], "home": None}


def test_memory_refused_while_meta_buffers_are_made_leaves_the_model_as_it_was(tmp_path):
    """Making a model's meta buffers swaps scratch copies in for its real tensors while
    its initialisers run; they were swapped in one at a time as they were made, so a
    copy refused under an address-space limit left the ones before it in the user's
    model (a write to the weight no longer reached the user's tensor). Every copy is
    made before the first is put in place: the model is as it was."""
    out = run_child(f"""
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.b = nn.Parameter(torch.zeros(100_000_000))  # 400 MB: its copy is refused
            self.register_buffer("steps", torch.empty(8, device="meta"))

        def _init_weights(self, module):
            if module is self:
                self.steps.copy_(torch.arange(8.0))

        def forward(self, x):
            return x * self.a.sum() + self.b[:1]

    m = M()
    a, b = m.a, m.b
    vm = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
              if ln.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (200 << 20), resource.RLIM_INFINITY))
    err = failure(offload.initialize, m, cfg([{str(tmp_path)!r} + "/swap"]))
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    report(err=err, same=[m._parameters["a"] is a, m._parameters["b"] is b],
           meta=m.steps.is_meta)
    """)
    assert out["err"] is not None and "allocate" in out["err"]["msg"], out
    assert out["same"] == [True, True] and out["meta"], out
