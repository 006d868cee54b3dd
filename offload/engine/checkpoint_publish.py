"""The directories of a checkpoint's parent: saves in progress, killed saves, pruning
([Note: publishing a checkpoint] in training_checkpoint.py).

[Note: partial directories]
A save writes into `.<name>.partial` and renames it when done; a save killed
part way leaves that directory, which a later save into the same parent removes.
Several saves may share a parent at once (two jobs of a sweep, two engines of a
process), so a `.partial` directory is removed only when no save is writing it:
the save that writes it holds an exclusive `flock` on `.<name>.partial.lock`
beside it from before the directory exists until it is renamed or removed, and
the lock goes with the process however it ends (SIGKILL included). A remover
takes that lock without waiting; held, the directory is left alone. Pruning a
checkpoint renames it to a `.partial` name first, so a prune killed half way
leaves a directory the next save removes, never a damaged one under its name.
What a save or prune leaves at those names is ours: a directory at `.<name>.partial`
(a symbolic link there, where an earlier version's pruning moved a `latest` link) and
a regular file at its lock's name. Nothing of ours is a file at the first or a
directory at the second: such a thing is someone else's, and a save of that name is
refused, naming it and the fix, rather than remove it (it blocked the name for good
with a bare FileExistsError or IsADirectoryError).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

from ..files import json_loads, lock_named, read_regular_text, unlink_own
from .checkpoint_files import CheckpointError, CheckpointPathError
from .checkpoint_layout import check_utf8

log = logging.getLogger(__name__)

__all__ = ["LOCK", "PARTIAL", "RECORD", "PartialLock", "check_save_path", "is_committed",
           "partial_of", "prune", "remove_partials"]

RECORD = "checkpoint.json"
PARTIAL = ".partial"
LOCK = ".lock"


ROOM = 1 + len(PARTIAL) + len(LOCK)  # bytes a save's lock file's name adds to the name


def partial_of(path: Path) -> Path:
    """The directory a save of `path` (absolute) writes until it is published; first
    `check_save_path(path)`, so a path no save can be written under is refused
    before anything is."""
    check_save_path(path)
    return _partial(path)


def _partial(path: Path) -> Path:
    return path.parent / f".{path.name}{PARTIAL}"


def _name_max(directory: Path) -> int:
    """The longest file name (bytes) the file system of `directory`, or of its nearest
    existing ancestor, takes; 255 (Linux's NAME_MAX) where it cannot be asked, -1
    where it has no limit."""
    for p in (directory, *directory.parents):
        try:
            return os.pathconf(p, "PC_NAME_MAX")
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            break
    return 255


def check_save_path(path: Path) -> None:
    """CheckpointError where a save cannot be written under the absolute `path`: a path
    that is not valid UTF-8 (`check_utf8`: tensorstore requires it), or a name too
    long for the save's work files beside it (`.<name>.partial.lock`, `ROOM` bytes
    longer than the name) on its parent's file system; the message names the path
    and the fix, and says nothing was written."""
    check_utf8(path, "save_checkpoint", "give the checkpoint a path of UTF-8 characters "
               "(rename the directories and name that are not, e.g. with convmv; nothing "
               "was written)")
    most = _name_max(path.parent)
    have = len(os.fsencode(path.name))
    if 0 <= most < have + ROOM:
        raise CheckpointError(
            f"save_checkpoint: the checkpoint name of {path} is {have} bytes; its file "
            f"system takes names of at most {most} bytes, and a save writes beside the "
            f"checkpoint a directory and a lock file named .<name>{PARTIAL}{LOCK} ({ROOM} "
            f"bytes more): give a name of at most {most - ROOM} bytes (nothing was written)")


class PartialLock:
    """The lock a save holds on its `.partial` directory ([Note: partial directories])."""

    def __init__(self, partial: Path, wait: bool) -> None:
        """Takes the lock; without `wait`, raises BlockingIOError where it is held, and
        CheckpointPathError (an OSError) where the lock's name or `partial` holds what
        no save made ([Note: partial directories])."""
        self.path = partial.with_name(partial.name + LOCK)
        self._fd: int | None = lock_named(self.path, self._open, wait)
        try:
            _clear_partial(partial)
        except BaseException:
            self.release()
            raise

    def _open(self) -> int:
        """The lock file, created where missing; a directory (or another thing that is
        not a regular file) at its name is someone else's: CheckpointPathError."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        except IsADirectoryError:
            kind, fix = "a directory", "remove it (rmdir)"
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            kind, fix = "not a regular file", "remove it"
        raise CheckpointPathError(
            f"save_checkpoint: {self.path} is {kind}, where a save of {_target(self.path)} "
            f"keeps its lock file; offload removes only what its saves left, and no save "
            f"leaves that: {fix}, or save under another name")

    def release(self) -> None:
        """Removes the lock file and gives the lock back (the directory is gone or
        published by now). A lock file that cannot be removed (a disk that failed
        under the save) is left for a later save to remove, logged: the error of
        the save, if any, is the one raised, and the lock is given back either way."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            unlink_own(self.path, fd)
        except OSError as e:
            log.warning("cannot remove the lock file %s (%s); a later save into its "
                        "directory removes it", self.path, e)
        finally:
            os.close(fd)


def _target(work: Path) -> Path:
    """The checkpoint a save's `.<name>.partial` (or its lock file) is for."""
    name = work.name[1:]
    name = name[:-len(LOCK)] if name.endswith(LOCK) else name
    return work.with_name(name[:-len(PARTIAL)])


def _clear_partial(partial: Path) -> None:
    """With its lock held: removes a symbolic link at `partial` (ours: [Note: partial
    directories]); raises CheckpointPathError where something other than a directory
    is there."""
    try:
        mode = os.lstat(partial).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):  # the link alone, never what it points to
        partial.unlink(missing_ok=True)
    elif not stat.S_ISDIR(mode):
        raise CheckpointPathError(
            f"save_checkpoint: {partial} is a file, where a save of {_target(partial)} writes "
            "its partial directory; offload removes only what its saves left, and no save "
            "leaves a file there: remove it, or save under another name")


def is_committed(p: Path) -> bool:
    return (p / RECORD).is_file() and not p.name.endswith(PARTIAL)


def remove_partials(parent: Path) -> None:
    """Removes the `.partial` directories of `parent` that no save is writing (and the
    lock files killed saves left)."""
    found = {d for d in parent.glob(f".*{PARTIAL}") if d.is_dir() or d.is_symlink()}
    found |= {f.with_name(f.name[:-len(LOCK)]) for f in parent.glob(f".*{PARTIAL}{LOCK}")}
    for d in sorted(found):
        try:
            lock = PartialLock(d, wait=False)
        except BlockingIOError:  # a save in progress, in this process or another
            continue
        except OSError as e:  # a parent we may not write to, or something no save made
            log.debug("cannot lock %s: %s", d, e)  # there: nothing to clean up here
            continue
        try:  # (a link there, an earlier version's pruning's, went with the lock taken)
            if d.is_dir():
                log.info("removing partial checkpoint %s (a save that did not finish)", d)
                shutil.rmtree(d, ignore_errors=True)
        finally:
            lock.release()


def prune(parent: Path, keep: int, newest: Path, fmt: str, run: str,
          resumed_step: int | None = None, saved_here: frozenset[str] = frozenset()
          ) -> list[Path]:
    """Keeps the `keep` committed checkpoints of `parent` (format `fmt`) of training `run`
    with the highest steps; each other one is renamed to a `.partial` name, then removed.
    Returns those of a rolled-back part of the training, neither counted nor removed.

    [Note: a training's checkpoints]
    Each engine names its training (`run_id`, a random hex string); a save records it
    and a resume takes it back, so the checkpoints of one training, over any number of
    resumes, carry one name. Pruning counts only those: two trainings that save into
    one parent (a second run started from scratch, a sweep's configurations) never
    remove each other's checkpoints, nor those of a save that named no training.

    [Note: checkpoints of a rolled-back training]
    A training resumed from an older checkpoint than its last (a rollback past a
    loss spike) has checkpoints of the same training with higher steps, from the
    part it abandoned: they outranked the new ones, so the rollback's own point was
    removed first, and for a while two checkpoints held one step. Those of the
    training with a step above the one this engine resumed at (`resumed_step`),
    which this engine did not save (`saved_here`, real paths), are that part: left
    alone and not counted, as another training's."""
    found, ahead = [], []
    for d in parent.iterdir():
        try:  # another process may prune the same parent: an entry can vanish
            if d.is_symlink() or not (d.is_dir() and is_committed(d)):
                continue  # a link (`latest`) names a checkpoint; it is not one
            rec = json_loads(read_regular_text(d / RECORD))
            step = rec.get("global_step", 0) if isinstance(rec, dict) else None
            if (rec.get("format") == fmt and isinstance(step, int)  # not another program's
                    and rec.get("run") == run):  # nor another training's
                if (resumed_step is not None and step > resumed_step
                        and os.path.realpath(d) not in saved_here):
                    ahead.append(d)  # [Note: checkpoints of a rolled-back training]
                    continue
                found.append((step, d.stat().st_mtime, d))
        except (OSError, ValueError, AttributeError):
            continue
    found.sort(key=lambda t: (t[0], t[1]))
    for _step, _t, d in found[:max(0, len(found) - keep)]:
        if d == newest:
            continue
        log.info("removing checkpoint %s (engine.keep_checkpoints=%d)", d, keep)
        doomed = _partial(d)
        try:
            lock = PartialLock(doomed, wait=False)
        except OSError as e:
            log.warning("cannot remove checkpoint %s: %s", d, e)
            continue
        try:
            os.rename(d, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        except OSError as e:
            log.warning("cannot remove checkpoint %s: %s", d, e)
        finally:
            lock.release()
    return sorted(ahead)
