"""Swap directories are checked before any swap file is made: real files, real mounts."""

import errno
import os
import subprocess
import sys

import pytest
import torch

import offload

from offload.config import ConfigError, IoConfig
from offload.io import (SwapLockedError, SwapPathError, SwapSpace, check_swap_dirs, make_engine,
                        probe_direct)
from offload.io.engine import ThreadEngine

from .conftest import build_engine


def _tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_a_file_is_refused_with_its_path_and_errno(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for call in (lambda: check_swap_dirs([str(f)]),
                 lambda: make_engine(IoConfig(paths=[str(f)])),
                 lambda: SwapSpace([str(f)], "t", ThreadEngine())):
        with pytest.raises(SwapPathError) as e:
            call()
        assert e.value.errno == errno.ENOTDIR and e.value.filename == str(f)
        assert f"io.paths[0]: '{f}' exists and is not a directory; give a directory" in str(e.value)
        assert isinstance(e.value, OSError) and isinstance(e.value, ConfigError)
    assert _tree(tmp_path) == ["file"]


def test_a_path_under_a_file_says_which_component(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SwapPathError, match=rf"cannot be created: {f} is a file") as e:
        check_swap_dirs([str(f / "swap")])
    assert e.value.errno == errno.ENOTDIR


def test_empty_entry_is_refused():
    with pytest.raises(ConfigError, match=r"io.paths\[0\]: '' names no directory"):
        check_swap_dirs([""])
    with pytest.raises(ConfigError, match="io.paths: empty"):
        check_swap_dirs([])


def test_same_directory_twice_is_refused_before_anything_is_made(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match=rf"io.paths\[1\]: '{link}' is the same directory as "
                                          rf"io.paths\[0\] \('{real}'\), both {real}"):
        check_swap_dirs([str(real), str(link)])
    # two spellings through the symlink of a directory that does not exist yet
    with pytest.raises(ConfigError, match=r"io.paths\[1\]: .* same directory as io.paths\[0\]"):
        check_swap_dirs([str(real / "new"), str(link / "x" / ".." / "new")])
    assert not (real / "new").exists()
    # through a store's engine, before a single swap file is created
    with pytest.raises(ConfigError, match="same directory"):
        make_engine(IoConfig(paths=[str(real), str(link)]))
    with pytest.raises(ConfigError, match="same directory"):
        SwapSpace([str(real), str(link)], "t", ThreadEngine())
    assert _tree(tmp_path) == ["link", "real"]


def test_bind_mount_of_the_same_directory_is_one_directory(tmp_path):
    import subprocess
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = subprocess.run(["mount", "--bind", str(a), str(b)], capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"cannot bind-mount here: {out.stderr.strip()}")
    try:
        with pytest.raises(ConfigError, match=r"io.paths\[1\]: .* same directory"):
            check_swap_dirs([str(a), str(b)])
    finally:
        subprocess.run(["umount", str(b)], capture_output=True)


def test_missing_directories_are_created(tmp_path):
    (d,) = check_swap_dirs([str(tmp_path / "x" / "y")])
    assert (tmp_path / "x" / "y").is_dir() and d.direct
    assert _tree(tmp_path) == ["x", "x/y"]  # and the probe file is gone


def test_read_only_directory_is_a_permission_error_not_o_direct(readonly_dir):
    with pytest.raises(SwapPathError) as e:
        check_swap_dirs([str(readonly_dir)])
    assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    msg = str(e.value)
    assert f"io.paths[0]: '{readonly_dir}': cannot create files in it ([Errno " in msg
    assert "O_DIRECT" not in msg
    assert ("read-only" in msg) or ("permissions" in msg)
    # the engine is not built with a warning about O_DIRECT: the same error, up front
    with pytest.raises(SwapPathError, match="cannot create files in it"):
        make_engine(IoConfig(paths=[str(readonly_dir)]))
    with pytest.raises(SwapPathError, match="cannot create directory"):
        check_swap_dirs([str(readonly_dir / "sub")])


def test_directories_made_for_earlier_paths_are_removed_when_a_later_one_fails(
        tmp_path, readonly_dir):
    new = tmp_path / "new" / "swap"
    with pytest.raises(SwapPathError, match=r"io.paths\[1\]"):
        check_swap_dirs([str(new), str(readonly_dir / "sub")])
    assert not (tmp_path / "new").exists()


@pytest.fixture
def one_inode_left(tmp_path):
    """(mount, directory): a tmpfs with megabytes free but one inode (file) left to
    give, and a directory made on it before it ran out. Skips where mounting is not
    allowed."""
    from ..conftest import _mount, _umount
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    why = _mount("tmpfs", mnt, "size=8m", "nr_inodes=16") if os.geteuid() == 0 else "not root"
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs: {why}")
    try:
        (mnt / "swap").mkdir()
        n = 0
        while True:  # every inode taken ...
            try:
                (mnt / f"filler-{n}").touch()
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
            n += 1
        (mnt / "filler-0").unlink()  # ... but one
        yield mnt, mnt / "swap"
    finally:
        _umount(mnt)


def test_out_of_inodes_is_not_called_a_full_disk(one_inode_left):
    """A file system out of inodes refuses a new file with ENOSPC, as a full disk does,
    while `df` shows space free: the message says inodes, and what to do."""
    import shutil
    mnt, swap = one_inode_left
    assert shutil.disk_usage(mnt).free > 4 << 20
    eng = ThreadEngine(direct=False)
    try:  # the probe and the lock file fit in the one inode by turns; the swap file not
        with pytest.raises(SwapPathError) as e:
            SwapSpace([str(swap)], "t", eng)
    finally:
        eng.close()
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and f"cannot open swap file {swap}/offload-t" in msg
    assert "out of inodes (files)" in msg and "the disk is full" not in msg
    assert "remove files on that file system or give a directory on another one" in msg
    assert os.listdir(swap) == []
    with pytest.raises(SwapPathError) as e:  # the directory takes the last inode
        check_swap_dirs([str(mnt / "new")], direct=False)
    msg = str(e.value)
    assert f"io.paths[0]: '{mnt / 'new'}': cannot create files in it ([Errno 28]" in msg
    assert "out of inodes (files)" in msg and "the disk is full" not in msg
    assert not (mnt / "new").exists()


_HOLDER = """
import sys, time
from offload.io import SwapSpace, ThreadEngine
sw = SwapSpace([sys.argv[1]], sys.argv[2], ThreadEngine())
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("via", ["initialize", "swap space"])
def test_directories_made_are_removed_when_a_later_paths_lock_is_held(tmp_path, via):
    """[Note: directories made before the lock]: the directories are made (by the
    engine's check) before the swap files are locked; where another process holds a
    later path's lock, the SwapLockedError is right, and the new directories, with the
    parents made for them, go too (they stayed, empty)."""
    held, new = tmp_path / "held", tmp_path / "new" / "swap"
    name = "r0-param" if via == "initialize" else "t"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(held), name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(SwapLockedError, match=rf"in use by another live process "
                                                  rf"\(pid {holder.pid}\)"):
            if via == "initialize":
                offload.initialize(torch.nn.Linear(64, 64), {
                    "engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
                    "io": {"paths": [str(new), str(held)]}, "store": {"device": "cpu"}})
            else:
                eng = make_engine(IoConfig(paths=[str(new), str(held)]))
                try:
                    SwapSpace([str(new), str(held)], name, eng)
                finally:
                    eng.close()
        assert _tree(tmp_path) == ["held", f"held/offload-{name}.swap",
                                   f"held/offload-{name}.swap.lock"]
    finally:
        holder.communicate("")
    eng = ThreadEngine()
    try:
        with SwapSpace([str(new)], "t", eng) as sw:  # once opened there ...
            assert sw.paths == [str(new / "offload-t.swap")]
    finally:
        eng.close()
    assert new.is_dir() and os.listdir(new) == []  # ... they stay, as after a run


def test_o_direct_refused_is_reported_and_leaves_no_probe_file(no_direct_dir):
    ok, why = probe_direct(str(no_direct_dir))
    assert not ok and "refuses O_DIRECT" in why and "[Errno 22]" in why
    assert os.listdir(no_direct_dir) == []
    eng = make_engine(IoConfig(paths=[str(no_direct_dir)]))  # auto: buffered thread engine
    try:
        assert eng.name == "threads" and not eng.direct
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="io.direct"):
        make_engine(IoConfig(paths=[str(no_direct_dir)], engine="threads"))
    assert os.listdir(no_direct_dir) == []


@pytest.mark.parametrize("name", ["threads", "aio"])
def test_swap_space_with_o_direct_on_a_refusing_disk_is_clear(no_direct_dir, name):
    from ..conftest import AIO_OK
    if name == "aio" and not AIO_OK:
        pytest.skip("libaio is not installed")
    eng = build_engine(name, direct=True)
    try:
        with pytest.raises(SwapPathError, match="refuses O_DIRECT.*io.direct = false") as e:
            SwapSpace([str(no_direct_dir)], "t", eng)
        assert e.value.errno == errno.EINVAL and e.value.filename == str(no_direct_dir)
    finally:
        eng.close()
    assert os.listdir(no_direct_dir) == []


def test_same_process_lock_says_this_process(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "dup", engine)
    try:
        with pytest.raises(SwapLockedError, match=rf"already open in this process \(pid "
                                                  rf"{os.getpid()}\).*close it first"):
            SwapSpace([str(tmp_path)], "dup", engine)
    finally:
        sw.close()


def test_a_stale_lock_file_taken_over_names_only_its_new_holder(engine, tmp_path):
    """A lock file a killed run left, holding a longer pid than this process's: taken
    over, it holds this pid alone, not this pid over the end of the old one's digits
    (which named a process that may run)."""
    lock = tmp_path / "offload-stale.swap.lock"
    lock.write_text("41943049999\n")
    sw = SwapSpace([str(tmp_path)], "stale", engine)
    try:
        assert lock.read_text() == f"{os.getpid()}\n"
    finally:
        sw.close()


def test_kept_lock_file_names_no_holder(engine, tmp_path):
    sw = SwapSpace([str(tmp_path)], "kept", engine)
    lock = tmp_path / "offload-kept.swap.lock"
    assert lock.read_text().strip() == str(os.getpid())
    sw.close(keep=True)
    assert lock.exists() and lock.read_text() == ""
    SwapSpace([str(tmp_path)], "kept", engine).close()



def test_a_ctrl_c_after_any_call_of_the_probe_leaves_no_probe_file(tmp_path):
    """A KeyboardInterrupt right after each call the probe makes returns (where Python
    runs a signal's handler after a system call such as the file's creation): no
    `.offload-probe-*` file stays behind. Before, one right after the creation, before
    the `try` that removes it, left it (and its descriptor), and every later probe of
    that thread failed with "File exists"."""
    import sys

    from offload.io import paths

    def after(n, fired):
        def profile(frame, event, arg):
            if event == "c_return" and frame.f_code is paths._probe.__code__:
                fired.append(getattr(arg, "__name__", str(arg)))
                if len(fired) == n:
                    raise KeyboardInterrupt
        return profile

    n = 1
    while True:
        fired: list[str] = []
        sys.setprofile(after(n, fired))
        try:
            check_swap_dirs([str(tmp_path)])
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        assert [p.name for p in tmp_path.iterdir()] == [], fired
        if len(fired) < n:  # the probe ended before its n-th call
            break
        n += 1
    assert n > 5
    assert check_swap_dirs([str(tmp_path)])  # and it probes again
