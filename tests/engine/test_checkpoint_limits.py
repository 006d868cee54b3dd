"""Limits of the process and of the file system met by a checkpoint: an intact
checkpoint read under a low open-file limit is never called damaged (the error names
the limit and how to raise it), and a save path tensorstore or the file system cannot
take (not UTF-8, a name too long for the save's work files) is refused up front,
naming the path and the fix, with nothing written."""

import contextlib
import errno
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch

import offload
from offload.engine import CheckpointReader
from offload.engine.checkpoint_files import CheckpointLimitError
from offload.limits import limit_hint

from .models import TiedTwice, lm_batches, lm_loss
from .test_checkpoint_reader_errors import _cfg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ROOM = len(".") + len(".partial.lock")  # what `.<name>.partial.lock` adds to a name


def _trained(swap):
    torch.manual_seed(0)
    engine = offload.initialize(TiedTwice(), _cfg(swap))
    x, y = lm_batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    return engine


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An intact checkpoint of one step (never changed by the tests)."""
    root = tmp_path_factory.mktemp("limits")
    with _trained(root / "swap") as engine:
        engine.save_checkpoint(root / "ck")
    return root / "ck"


@contextlib.contextmanager
def _no_free_descriptors():
    """Every file descriptor this process may open taken (RLIMIT_NOFILE lowered to
    what is open and filled with /dev/null): the next open fails with EMFILE. The
    limit and the descriptors are given back on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _fresh(ck):
    return CheckpointReader(ck)


def _warm(ck, *reads):
    """A reader that has done `reads` (each a call on it) with descriptors to spare:
    the next read under the limit is the one past them."""
    r = CheckpointReader(ck)
    for read in reads:
        read(r)
    return r


# each: (what it reads under the limit, the reader to read with, the read, the file named)
_READS = {
    "commit record": (lambda ck: None, lambda ck, _r: CheckpointReader(ck), "checkpoint.json"),
    "rank file": (_fresh, lambda ck, r: r._rank_file(0), "ranks/0.json"),
    "buffers file": (_fresh, lambda ck, r: r.buffers(), "buffers.json"),
    "array metadata": (_fresh, lambda ck, r: r.read_range("param", "l1.weight", 0, 8),
                       "param/l1.weight/zarr.json"),
    "shard index": (lambda ck: _warm(ck, lambda r: r._grid("param", "l1.weight")),
                    lambda ck, r: r.read_range("param", "l1.weight", 0, 8),
                    "param/l1.weight/c/0/0"),
    "chunk I/O set-up": (lambda ck: _warm(ck, lambda r: r._locate("param", "l1.weight", 2, 0,
                                                                   48 * 32 * 4)),
                         lambda ck, r: r.read_range("param", "l1.weight", 0, 8),
                         "checkpoint.json"),
    "chunk": (lambda ck: _warm(ck, lambda r: r.read_range("param", "l1.weight", 0, 8)),
              lambda ck, r: r.read_range("param", "l1.weight", 0, 8), "param/l1.weight/c/0/0"),
    "verify": (_fresh, lambda ck, r: r.verify(), "ranks/0.json"),
    "tensorstore array": (_fresh, lambda ck, r: r._array("param", "l1.weight"),
                          "array param/l1.weight"),
}


@pytest.mark.parametrize("read", list(_READS))
def test_each_read_under_the_open_file_limit_names_the_limit_not_damage(saved, read):
    """Each file a resume, verify() or a tool reads, opened with no descriptor left, was
    a CheckpointCorruptError, "the checkpoint is damaged: resume from another", for an
    intact checkpoint: it is a CheckpointLimitError naming the file, RLIMIT_NOFILE and
    `ulimit -n`; verify() raises it rather than list it as a problem. With descriptors
    to spare again, the same read succeeds."""
    prepare, do, file = _READS[read]
    reader = prepare(saved)
    with _no_free_descriptors():
        with pytest.raises(offload.CheckpointError) as got:
            do(saved, reader)
    e = got.value
    assert isinstance(e, CheckpointLimitError), f"{type(e).__name__}: {e}"
    assert not isinstance(e, offload.CheckpointCorruptError) and "damaged" not in str(e)
    assert e.errno == errno.EMFILE, e.errno
    msg = str(e)
    assert f"{saved}" in msg and file in msg, msg
    assert "RLIMIT_NOFILE" in msg and "ulimit -n" in msg and "not damage" in msg, msg
    result = do(saved, reader)
    if read == "verify":
        assert result == [] and not reader.damaged, result
    if reader is not None:
        reader.close()


_SWEEP = """
import json, os, resource, sys
import offload
from offload.engine import CheckpointReader
from tests.engine.models import TiedTwice
from tests.engine.test_checkpoint_limits import _cfg
ck, swap = sys.argv[1], sys.argv[2]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
out = []
for spare in range(16):  # a resume and a verify with `spare` descriptors free
    for what in ("resume", "verify"):
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (len(os.listdir("/proc/self/fd")) - 1 + spare, hard))
        try:
            if what == "resume":
                offload.initialize(TiedTwice, _cfg(f"{swap}-{spare}"), resume=ck).close()
                got = "ok"
            else:
                problems = CheckpointReader(ck).verify()
                got = "ok" if not problems else ["problems", "; ".join(problems)]
        except Exception as e:
            got = [type(e).__name__, str(e)]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        out.append([what, spare, got])
reader = CheckpointReader(ck)
out.append(["verify", "unlimited", reader.verify() or "ok"])
offload.initialize(TiedTwice, _cfg(swap + "-unlimited"), resume=ck).close()
out.append(["resume", "unlimited", "ok"])
print(json.dumps(out))
"""


def test_resume_under_a_low_open_file_limit_names_the_limit_then_resumes(saved, tmp_path):
    """A process resuming (and verifying) an intact checkpoint with ever fewer spare
    descriptors: where it fails for the limit, the error names RLIMIT_NOFILE and
    `ulimit -n`, never damage (it said "the checkpoint is damaged: resume from
    another"); with the limit raised the same process verifies and resumes it."""
    run = subprocess.run([sys.executable, "-c", _SWEEP, str(saved), str(tmp_path / "swap")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    limited = []
    for what, spare, got in results:
        if got == "ok":
            continue
        kind, message = got
        assert kind != "CheckpointCorruptError" and "damaged" not in message, (what, spare, got)
        assert kind != "problems", (what, spare, got)  # verify() raises a limit, never lists it
        assert "RLIMIT_NOFILE" in message and "ulimit -n" in message, (what, spare, got)
        if kind == "CheckpointLimitError":
            assert str(saved) in message, message
            limited.append((what, spare))
    assert {w for w, _ in limited} == {"resume", "verify"}, results
    assert results[-2:] == [["verify", "unlimited", "ok"], ["resume", "unlimited", "ok"]]


def test_a_memory_limit_is_named_as_a_limit():
    """ENOMEM (a read's buffers under `ulimit -v` or a container's memory limit) is a
    limit of the process as EMFILE is: limit_hint names it and the fix, so the
    checkpoint reader (and the swap files, the save) call it a limit, not damage."""
    hint = limit_hint(errno.ENOMEM)
    assert "ulimit -v" in hint and "memory" in hint, hint


def test_a_file_systems_largest_file_is_named_with_a_fix_that_works():
    """EFBIG without `ulimit -f` is the file system's own cap (FAT32's 4 GiB): the hint
    was cut off ("give a directory on another") and the checkpoint's message told the
    user to retry once a limit was raised, which no limit of the process changes."""
    import resource

    from offload.engine.checkpoint_files import limit_reached

    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        pytest.skip("this process has a file size limit")
    err = limit_reached("checkpoint file /ck/a cannot be written",
                        OSError(errno.EFBIG, "File too large"))
    assert "takes larger files (ext4, xfs)" in str(err), err
    assert "retry once the limit is raised" not in str(err), err


# -- paths a save cannot be written under ---------------------------------------------
def test_a_checkpoint_path_not_in_utf8_is_refused_before_anything_is_written(tmp_path):
    """A checkpoint name (or a directory above it) holding a byte that is not UTF-8 (a
    Latin-1 name, legal on Linux) failed inside tensorstore with "Unable to cast Python
    instance of type <class 'str'> to C++ type '?'": it is refused before anything is
    written, blocking or not, naming the path (its bytes escaped) and UTF-8."""
    latin1 = os.fsdecode(b"run-\xe9t\xe9")
    parent = tmp_path / "ckpts"
    parent.mkdir()
    bad_dir = tmp_path / os.fsdecode(b"d\xe9j\xe0")
    with _trained(tmp_path / "swap") as engine:
        for path, shown in ((parent / latin1, "run-\\xe9t\\xe9"),
                            (bad_dir / "step-1", "d\\xe9j\\xe0/step-1")):
            for blocking in (True, False):
                with pytest.raises(offload.CheckpointError, match="not valid UTF-8") as got:
                    engine.save_checkpoint(path, blocking=blocking).wait()
                assert shown in str(got.value) and "tensorstore" in str(got.value)
                assert "nothing was written" in str(got.value), got.value
        assert os.listdir(parent) == [] and not bad_dir.exists()
        engine.save_checkpoint(parent / "run-été")  # UTF-8 beyond ASCII is fine
    assert CheckpointReader(parent / "run-été").verify() == []


def test_a_checkpoint_moved_to_a_path_not_in_utf8_resumes_and_tensorstore_is_refused(
        saved, tmp_path):
    """offload reads a checkpoint at any path; tensorstore (the reader's `_array`, for
    tools) cannot open one that is not UTF-8, and said the checkpoint was damaged:
    it is a CheckpointError naming UTF-8 and the path."""
    ck = tmp_path / os.fsdecode(b"run-\xe9t\xe9")
    shutil.copytree(saved, ck)
    assert CheckpointReader(ck).verify() == []
    offload.initialize(TiedTwice, _cfg(tmp_path / "swap"), resume=ck).close()
    with pytest.raises(offload.CheckpointError, match="not valid UTF-8") as got:
        CheckpointReader(ck)._array("param", "l1.weight")
    assert not isinstance(got.value, offload.CheckpointCorruptError), got.value
    assert "run-\\xe9t\\xe9" in str(got.value), got.value


def test_a_name_too_long_for_the_save_s_work_files_is_refused_naming_the_longest(tmp_path):
    """A legal name of 242-255 bytes failed with "[Errno 36] File name too long:
    '.../.<name>.partial.lock'", naming a file of the save's own and no fix: it is
    refused before anything is written, giving the longest name that works (counted
    in bytes: a name of two-byte characters is refused at half the characters), and
    a name of that length saves."""
    most = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = most - ROOM
    with _trained(tmp_path / "swap") as engine:
        for name in ("c" * (longest + 1), "c" * most, "é" * ((longest + 2) // 2)):
            path = tmp_path / "ckpts" / name
            with pytest.raises(offload.CheckpointError,
                               match=f"give a name of at most {longest} bytes") as got:
                engine.save_checkpoint(path)
            n = len(name.encode())
            assert str(path) in str(got.value) and f"is {n} bytes" in str(got.value)
            assert "nothing was written" in str(got.value), got.value
        assert not (tmp_path / "ckpts").exists()
        engine.save_checkpoint(tmp_path / "ckpts" / ("c" * longest))
    assert os.listdir(tmp_path / "ckpts") == ["c" * longest]
    assert CheckpointReader(tmp_path / "ckpts" / ("c" * longest)).verify() == []
