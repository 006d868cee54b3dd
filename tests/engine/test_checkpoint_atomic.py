"""Checkpoints are published atomically: kill -9 mid-save, partial directories, keep-last-K."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import offload
from offload.engine.training_checkpoint import PARTIAL, RECORD

from .models import TiedTwice, lm_batches, lm_loss

REPO = Path(__file__).resolve().parents[2]


def _step(engine, batch):
    x, y = batch
    engine.backward(lm_loss(engine(x), y))
    engine.step()


def _paused_save(cfg: dict, root: Path, pause: str) -> subprocess.Popen:
    """A process (tests/engine/checkpoint_child.py) that saved ROOT/step-2 and now stands
    still in its save of ROOT/step-3, at `pause`; the caller kills it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "tests.engine.checkpoint_child",
                              json.dumps(cfg), str(root), pause], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "PAUSED":
        child.kill()
        pytest.fail(f"{line!r} {child.stderr.read()}")
    return child


@pytest.mark.parametrize("pause", ["write", "rename"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path, engine_cfg, pause):
    cfg = engine_cfg("nvme", "nvme", "nvme", dtype="bf16")
    cfg["io"]["paths"] = [str(tmp_path / "swap-child")]
    root = tmp_path / "ckpt"
    root.mkdir()
    child = _paused_save(cfg, root, pause)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    partial = root / f".step-3{PARTIAL}"
    assert partial.is_dir() and not (root / "step-3").exists()
    with pytest.raises(offload.CheckpointError, match="not a committed checkpoint"):
        offload.initialize(TiedTwice(), cfg, resume=partial)

    want = torch.load(root / "want.pt")
    cfg["io"]["paths"] = [str(tmp_path / "swap-resume")]
    with offload.initialize(TiedTwice, cfg, resume=root / "step-2") as engine:
        got = engine.state_dict()
        assert set(got) == set(want["sd"])
        for k, v in want["sd"].items():
            assert torch.equal(got[k], v), k
        for gid, state in want["opt"].items():
            mine = engine.optimizer.partition_state(gid)
            for k, v in state.items():
                assert torch.equal(mine[k], v), (gid, k)
        _step(engine, lm_batches(3)[2])
        engine.save_checkpoint(root / "step-3")  # the next save removes the partial one
    assert not partial.exists()
    assert (root / "step-3" / RECORD).is_file()
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3", "want.pt"]


def test_keep_last_k(tmp_path, engine_cfg):
    cfg = engine_cfg("host", "host", "host", keep_checkpoints=2)
    root = tmp_path / "ckpt"
    (root / "not-a-checkpoint").mkdir(parents=True)
    (root / ".old.partial").symlink_to(root / "not-a-checkpoint")  # an earlier pruning's
    (root / "nested").mkdir()  # a record no JSON reader follows: another program's
    (root / "nested" / RECORD).write_text("[" * 100_000)
    with offload.initialize(TiedTwice(), cfg) as engine:
        for i, batch in enumerate(lm_batches(4)):
            _step(engine, batch)
            engine.save_checkpoint(root / f"step-{i + 1}")
            latest = root / "latest"  # a link to the newest, as a loop keeps one
            latest.unlink(missing_ok=True)
            latest.symlink_to(root / f"step-{i + 1}")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "nested", "not-a-checkpoint",
                                                      "step-3", "step-4"]
    assert json.loads((root / "latest" / RECORD).read_text())["global_step"] == 4


def test_keep_counts_one_trainings_checkpoints_over_its_resumes(tmp_path, engine_cfg):
    """[Note: a training's checkpoints]: another training's checkpoint in the same parent
    (a run started from scratch there before) is neither removed nor counted; a resumed
    engine's saves count with those of the training it resumed."""
    cfg = engine_cfg("host", "host", "host", keep_checkpoints=2)
    root = tmp_path / "ckpt"
    batches = lm_batches(5)
    with offload.initialize(TiedTwice(), cfg) as other:
        _step(other, batches[0])
        other.save_checkpoint(root / "other-1")
    with offload.initialize(TiedTwice(), cfg) as engine:
        for i in range(3):
            _step(engine, batches[i])
            engine.save_checkpoint(root / f"a-{i + 1}")
    assert sorted(p.name for p in root.iterdir()) == ["a-2", "a-3", "other-1"]
    with offload.initialize(TiedTwice(), cfg, resume=root / "a-3") as engine:
        _step(engine, batches[3])
        engine.save_checkpoint(root / "a-4")
    assert sorted(p.name for p in root.iterdir()) == ["a-3", "a-4", "other-1"]
    cfg["engine"]["keep_checkpoints"] = 1  # a save below a later step stays: it is the newest
    with offload.initialize(TiedTwice(), cfg, resume=root / "a-3") as engine:
        engine.save_checkpoint(root / "a-3b")
    assert sorted(p.name for p in root.iterdir()) == ["a-3b", "a-4", "other-1"]


def test_keep_after_a_rollback_keeps_the_point_it_rolled_back_to(tmp_path, engine_cfg, caplog):
    """[Note: checkpoints of a rolled-back training] in checkpoint_publish.py: resumed
    from step 4 of a training that had saved step 6 (a rollback past a loss spike),
    keep_checkpoints=2 removed step 4 at the first new save, kept the abandoned step 6
    (two checkpoints of step 6 for a while). The abandoned part is neither counted nor
    removed now, and said once."""
    cfg = engine_cfg("host", "host", "host", keep_checkpoints=2)
    root = tmp_path / "ckpt"
    batches = lm_batches(8)
    with offload.initialize(TiedTwice(), cfg) as engine:
        for i in range(6):
            _step(engine, batches[i])
            if engine.global_step % 2 == 0:
                engine.save_checkpoint(root / f"step-{engine.global_step}")
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]
    names = []
    with caplog.at_level("INFO", logger="offload"), \
            offload.initialize(TiedTwice(), cfg, resume=root / "step-4") as engine:
        for i in range(4, 7):
            _step(engine, batches[i])
            engine.save_checkpoint(root / f"new-{engine.global_step}")
            names.append(sorted(p.name for p in root.iterdir()))
    assert names == [["new-5", "step-4", "step-6"], ["new-5", "new-6", "step-6"],
                     ["new-6", "new-7", "step-6"]]
    assert caplog.text.count("from after step 4, which it resumed at, are kept") == 1

def test_a_save_in_progress_in_another_process_is_left_alone(tmp_path, engine_cfg):
    """[Note: partial directories]: two trainings save into one parent; one's save in
    progress (its `.partial` directory) is not removed by the other's save, which
    removes it only once its process is gone."""
    cfg = engine_cfg("host", "host", "host")
    cfg["io"]["paths"] = [str(tmp_path / "swap-child")]
    root = tmp_path / "ckpt"
    root.mkdir()
    child = _paused_save(cfg, root, "write")
    partial = root / f".step-3{PARTIAL}"
    try:
        cfg["io"]["paths"] = [str(tmp_path / "swap-other")]
        with offload.initialize(TiedTwice(), cfg) as other:
            _step(other, lm_batches(1)[0])
            other.save_checkpoint(root / "other-1")
            assert partial.is_dir()  # still being written
            child.send_signal(signal.SIGKILL)
            child.wait()
            other.save_checkpoint(root / "other-2")
    finally:
        child.kill()
        child.wait()
    assert sorted(p.name for p in root.iterdir()) == ["other-1", "other-2", "step-2",
                                                      "want.pt"]


_KILLED_IN_PRUNE = """
import os, signal, sys
from pathlib import Path
import torch
import offload
import offload.engine.checkpoint_publish as publish
from tests.engine.models import TiedTwice, lm_batches, lm_loss

root, cfg = Path(sys.argv[1]), {"engine": {"params": "host", "grads": "host",
    "optimizer": "host", "keep_checkpoints": 1}, "io": {"paths": [sys.argv[2]]},
    "store": {"device": "cpu"}}
engine = offload.initialize(TiedTwice(), cfg)
for i, (x, y) in enumerate(lm_batches(2)):
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    if i == 1:
        rmtree = publish.shutil.rmtree

        def killed(path, ignore_errors=False):  # a checkpoint's removal cut after a file
            if not (Path(path) / "checkpoint.json").is_file():
                return rmtree(path, ignore_errors=ignore_errors)
            (Path(path) / "checkpoint.json").unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        publish.shutil.rmtree = killed
    engine.save_checkpoint(root / f"step-{i + 1}")
"""


def test_a_prune_killed_half_way_leaves_nothing_behind(tmp_path, engine_cfg):
    """`keep_checkpoints`: a process killed while it removes an old checkpoint leaves
    a `.partial` directory (the old one is renamed before it is removed), which the
    next save removes, never a damaged directory under a checkpoint's name."""
    root = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-c", _KILLED_IN_PRUNE, str(root),
                          str(tmp_path / "swap")], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [f".step-1{PARTIAL}",
                                                                    "step-2"]
    cfg = engine_cfg("host", "host", "host", keep_checkpoints=1)
    with offload.initialize(TiedTwice(), cfg) as engine:
        _step(engine, lm_batches(1)[0])
        engine.save_checkpoint(root / "step-3")  # (global step 1: step-2 stays the newest)
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]


@pytest.mark.parametrize("name, extra, match", [
    ("run.partial", None, r"ends in '\.partial', the name of a save in progress"),
    ("ck", {"epoch": 1, 7: "x"}, r"extra must be JSON-serialisable, with keys of one type")])
def test_a_save_refused_up_front_writes_nothing(tmp_path, engine_cfg, name, extra, match):
    """A name the next save would take for a killed one, or an `extra` the commit
    record cannot hold (it is written with sorted keys), is refused before any file."""
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "host")) as engine:
        _step(engine, lm_batches(1)[0])
        with pytest.raises(offload.CheckpointError, match=match):
            engine.save_checkpoint(tmp_path / "ckpt" / name, extra=extra)
    assert not (tmp_path / "ckpt").exists()


def test_an_empty_path_or_one_under_a_file_is_a_checkpoint_error(tmp_path, engine_cfg,
                                                                    monkeypatch):
    """"" would be the working directory (Path("") is "."): save and resume both name
    the empty path; a path under a file is a CheckpointError like every other refused
    save, naming the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "host")) as engine:
        _step(engine, lm_batches(1)[0])
        with pytest.raises(offload.CheckpointError, match="the path is empty"):
            engine.save_checkpoint("")
        with pytest.raises(offload.CheckpointError, match=r"afile is a file, not a directory"):
            engine.save_checkpoint(tmp_path / "afile" / "ck")  # (a FileExistsError too)
    with pytest.raises(offload.CheckpointError, match="the checkpoint path is empty"):
        offload.initialize(TiedTwice(), engine_cfg("host", "host", "host"), resume="")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "swap"]


def test_a_path_under_a_link_to_nothing_says_so(tmp_path, engine_cfg):
    """A parent that is a symbolic link whose target is missing (a mount not there, a
    directory removed) was called "a file, not a directory": the message names the
    link and where it leads, and nothing is written."""
    gone = tmp_path / "gone"
    (tmp_path / "link").symlink_to(gone)
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "host")) as engine:
        _step(engine, lm_batches(1)[0])
        with pytest.raises(offload.CheckpointError) as e:
            engine.save_checkpoint(tmp_path / "link" / "ck")
        assert str(e.value) == (
            f"save_checkpoint: {tmp_path / 'link'} is a symbolic link to {gone}, which does "
            "not exist; create that directory, or remove the link, or give a path under a "
            "directory")
        with pytest.raises(offload.CheckpointError, match=r"loop-a is a symbolic link to "
                                                          r".*loop-b, a loop of links"):
            engine.save_checkpoint(tmp_path / "loop-a" / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "loop-a", "loop-b", "swap"]


def test_what_no_save_made_at_a_saves_work_names_is_refused_not_removed(tmp_path,
                                                                        engine_cfg):
    """[Note: partial directories]: a file at `.<name>.partial`, or a directory at its
    lock's name, blocked every save of that name with a bare FileExistsError or
    IsADirectoryError. No save leaves either, so neither is removed: the save is refused
    naming it and the fix, leaving nothing of its own, and saves of other names go on.
    A symbolic link there is ours (an earlier version's pruning's): the link goes, never
    what it points to."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / f".a{PARTIAL}").write_text("notes")
    (root / f".b{PARTIAL}.lock").mkdir()
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "f").write_text("mine")
    (root / f".c{PARTIAL}").symlink_to(tmp_path / "keep")
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "host")) as engine:
        _step(engine, lm_batches(1)[0])
        with pytest.raises(offload.CheckpointError) as e:
            engine.save_checkpoint(root / "a")
        assert str(e.value) == (
            f"save_checkpoint: {root / '.a.partial'} is a file, where a save of {root / 'a'} "
            "writes its partial directory; offload removes only what its saves left, and no "
            "save leaves a file there: remove it, or save under another name")
        with pytest.raises(offload.CheckpointError) as e:
            engine.save_checkpoint(root / "b", blocking=False).wait()
        assert str(e.value) == (
            f"save_checkpoint: {root / '.b.partial.lock'} is a directory, where a save of "
            f"{root / 'b'} keeps its lock file; offload removes only what its saves left, "
            "and no save leaves that: remove it (rmdir), or save under another name")
        assert sorted(p.name for p in root.iterdir()) == [".a.partial", ".b.partial.lock",
                                                          ".c.partial"]
        engine.save_checkpoint(root / "c")
        assert sorted(p.name for p in root.iterdir()) == [".a.partial", ".b.partial.lock",
                                                          "c"]
        assert (root / ".a.partial").read_text() == "notes"
        assert (tmp_path / "keep" / "f").read_text() == "mine"
        (root / ".a.partial").unlink()  # as the message says
        engine.save_checkpoint(root / "a")
    assert (root / "a" / RECORD).is_file()


def test_keep_last_k_passes_over_directories_of_other_programs(tmp_path, engine_cfg, caplog):
    """Pruning read every directory with a commit record as one of ours: a record that
    is a JSON list, or whose step is no number, failed the save after its checkpoint
    was published, saying "nothing was published". Such directories are now left
    alone, and the save succeeds."""
    cfg = engine_cfg("host", "host", "host", keep_checkpoints=1)
    root = tmp_path / "ckpt"
    for name, record in (("a-list", []), ("a-string-step", {"format": None, "global_step": "x"})):
        (root / name).mkdir(parents=True)
        (root / name / RECORD).write_text(json.dumps(record))
    fmt = None
    with offload.initialize(TiedTwice(), cfg) as engine:
        for i, batch in enumerate(lm_batches(3)):
            _step(engine, batch)
            engine.save_checkpoint(root / f"step-{i + 1}")
            if fmt is None:  # a record of our format whose step is no number
                fmt = json.loads((root / "step-1" / RECORD).read_text())["format"]
                (root / "a-string-step" / RECORD).write_text(
                    json.dumps({"format": fmt, "global_step": "x"}))
    assert sorted(p.name for p in root.iterdir()) == ["a-list", "a-string-step", "step-3"]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_disk_that_dies_mid_save_gives_a_checkpoint_error(tmp_path, engine_cfg,
                                                            failing_disk, blocking):
    """The disk under the checkpoint dies once the save has locked its partial
    directory: the save raises CheckpointError naming the path and the cause, and
    keeps no descriptor on that disk. Before, removing the lock file failed (EIO) and
    replaced that error with a bare OSError, and its descriptor leaked."""
    mnt, fail = failing_disk
    engine = offload.initialize(TiedTwice(), engine_cfg("host", "host", "host"))
    try:
        _step(engine, lm_batches(1)[0])

        def trace(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "_write_partitions":
                sys.settrace(None)
                threading.settrace(None)
                fail()
            return None
        sys.settrace(trace)
        threading.settrace(trace)  # a background save runs on a thread of its own
        try:
            with pytest.raises(offload.CheckpointError, match="ck failed .*Input/output"):
                engine.save_checkpoint(Path(mnt) / "ck", blocking=blocking).wait()
        finally:
            sys.settrace(None)
            threading.settrace(None)
        fds = [os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
               if os.path.islink(f"/proc/self/fd/{n}")]
        assert not [f for f in fds if f.startswith(mnt)], fds
        assert engine.save_checkpoint(tmp_path / "ok").wait() == tmp_path / "ok"
    finally:
        engine.close()
