"""Shared by every test package: `gpu` tests skip without CUDA, the I/O engines
(threads always, aio where libaio loads) as a parametrised fixture, and a disk that
fails on demand (`failing_disk`)."""

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings


from offload.io import AioEngine, ThreadEngine, libaio_status
from offload.io.errors import AioSetupError

# A suite started in the background of a shell without job control inherits SIGINT
# ignored (and passes that on to its children). The Ctrl-C tests stand for a user at a
# terminal, where Python's own handler is in place: put it back for the whole run.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The property tests draw the same examples on every run of `make test`, so the suite
# passes or fails on the code alone; `make test-all` (HYPOTHESIS_PROFILE=explore) draws
# new ones each run, as a search for the cases those fixed draws miss.
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

AIO_OK, AIO_WHY = libaio_status()
ENGINES = ["threads", pytest.param("aio", marks=pytest.mark.skipif(not AIO_OK, reason=AIO_WHY))]
# For what runs the same whichever engine moves the bytes (the caller's thread, the
# swap space's checks): the threads engine by default, aio as well under `slow`.
ENGINES_AIO_SLOW = ["threads", pytest.param("aio", marks=[
    pytest.mark.slow, pytest.mark.skipif(not AIO_OK, reason=AIO_WHY)])]


def build_engine(name: str, **kw):
    """A small-block engine, so small test files still split into many blocks."""
    kw.setdefault("block_size", 64 << 10)
    kw.setdefault("queue_depth", 8)
    if name == "aio":
        # tests/io/test_limits_edges.py lowers the machine's fs.aio-max-nr for a moment
        # while the other worker's tests run: an engine made then finds no AIO slots
        for wait in (0.2, 0.5, 1.0, None):
            try:
                return AioEngine(**kw)
            except AioSetupError:
                if wait is None:
                    raise
                time.sleep(wait)
    return ThreadEngine(threads=4, **kw)


@pytest.fixture(params=ENGINES)
def engine(request):
    eng = build_engine(request.param)
    yield eng
    eng.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_together(cmds: list[list[str]], timeout: float = 120,
                 envs: list[dict[str, str]] | None = None, **kw) -> list:
    """subprocess.run for each of `cmds` (output captured as text; `kw` for every one,
    `envs` each one's environment), all started at once: a test of several independent
    processes waits for the slowest, not the sum. Returns their CompletedProcess in
    order; kills every one still running when one outlasts `timeout` (and raises its
    TimeoutExpired)."""
    import subprocess
    import time

    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **kw, **({} if envs is None else {"env": envs[i]}))
             for i, c in enumerate(cmds)]
    deadline = time.monotonic() + timeout
    try:
        done = []
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def flip_byte(path, offset: int) -> None:
    """Flips one byte of a file behind offload's back, through a normal (buffered) fd
    apart from its O_DIRECT one; flipping it again restores it."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _mount(fstype: str, target, *options: str) -> str | None:
    """Mounts a fresh `fstype` at `target`; None on success, else why not."""
    import shutil
    import subprocess

    if shutil.which("mount") is None:
        return "no mount command"
    cmd = ["mount", "-t", fstype] + (["-o", ",".join(options)] if options else []) + \
        [fstype, str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return None if out.returncode == 0 else (out.stderr.strip() or f"mount exited {out.returncode}")


def _umount(target) -> None:
    import subprocess

    subprocess.run(["umount", str(target)], capture_output=True)


@pytest.fixture
def readonly_dir(tmp_path):
    """An existing directory this process cannot create files in, for real: mode 0555
    for an ordinary user; for root (who ignores permission bits) a read-only tmpfs
    mount, else an immutable directory (chattr +i). Skips if none can be had."""
    import os
    import subprocess

    d = tmp_path / "readonly"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    why = _mount("tmpfs", d, "ro")
    if why is None:
        yield d
        _umount(d)
        return
    chattr = subprocess.run(["chattr", "+i", str(d)], capture_output=True, text=True)
    if chattr.returncode != 0:
        pytest.skip(f"cannot make a read-only directory as root: mount: {why}; chattr: "
                    f"{chattr.stderr.strip()}")
    yield d
    subprocess.run(["chattr", "-i", str(d)], capture_output=True)


@pytest.fixture
def no_direct_dir(tmp_path):
    """A directory on a file system that refuses O_DIRECT: a ramfs mount (needs
    root); /dev/shm where this kernel's tmpfs refuses it. Skips otherwise."""
    import os

    d = tmp_path / "ramfs"
    d.mkdir()
    why = _mount("ramfs", d) if os.geteuid() == 0 else "not root"
    if why is None:
        yield d
        _umount(d)
        return
    import shutil

    shm = f"/dev/shm/offload-test-{os.getpid()}"
    probe = os.path.join(shm, "probe")
    refused = False
    try:
        os.makedirs(shm, exist_ok=True)
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        refused = os.path.isdir(shm)
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    if refused:
        yield shm
        shutil.rmtree(shm, ignore_errors=True)
        return
    shutil.rmtree(shm, ignore_errors=True)
    pytest.skip(f"no file system here refuses O_DIRECT (ramfs: {why}; tmpfs takes it)")


_EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
_SHUTDOWN_NOLOGFLUSH = 2


def loop_mount(tmp_path, name: str, size_mib: int, fstype: str = "ext4") -> Path:
    """A fresh `fstype` file system of `size_mib` MiB, loop mounted at tmp_path/name
    (`unmount` it after the test); skips where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounting a file system needs root")
    image, mnt = tmp_path / f"{name}.{fstype}", tmp_path / name
    mnt.mkdir()
    subprocess.run(["truncate", "-s", f"{size_mib}M", str(image)], check=True)
    reserve = ["-m", "0"] if fstype == "ext4" else []
    mk = subprocess.run([f"mkfs.{fstype}", "-q", "-F", *reserve, str(image)],
                        capture_output=True, text=True)
    if mk.returncode:
        pytest.skip(f"mkfs.{fstype} failed: {mk.stderr.strip()}")
    r = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot loop-mount an {fstype} image here: {r.stderr.strip()}")
    return mnt


def unmount(mnt) -> None:
    """Unmounts a `loop_mount`; where something still holds a file there, detaches it
    anyway, so no mount or loop device outlives the test (the loop device is freed
    with the last descriptor)."""
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def failing_disk(tmp_path):
    """(directory, fail()): a directory on a fresh ext4 loop mount; fail() shuts the file
    system down (EXT4_IOC_SHUTDOWN), after which every read, write and sync under it
    returns EIO, as from a dead disk. Skips where loop mounts are not allowed."""
    mnt = loop_mount(tmp_path, "disk", 32)

    def fail() -> None:
        fd = os.open(mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, _SHUTDOWN_NOLOGFLUSH.to_bytes(4, "little"))
        finally:
            os.close(fd)
    yield str(mnt), fail
    unmount(mnt)
