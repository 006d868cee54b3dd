"""`offload demo --nproc N`: the process that launches the ranks under torchrun, and
what it does when they stop or fail ([Note: stopping under torchrun])."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..io.process import usable_cpus
from .args import missing_directories, remove_directories
from .demo_view import DIR_PREFIX, Reporter

if TYPE_CHECKING:
    from .demo import DemoPlan

__all__ = ["children", "peer_lost", "relaunch", "remove_dead_runs", "torchrun"]


def remove_dead_runs(root: Path, notes: list[str], prefix: str = DIR_PREFIX) -> None:
    """Removes the directories `root/<prefix><pid>` of processes that are gone (a run
    killed by SIGKILL), noting each in `notes`."""
    for old in root.glob(prefix + "*"):
        pid = old.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)) and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
            notes.append(f"removed {old}, left by a run that was killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def relaunch(child_argv: list[str], plan: DemoPlan, reporter: Reporter) -> int:
    """Runs this command again under torchrun (one process per rank, gloo), with
    `child_argv` (the command's flags but --nproc).

    [Note: stopping under torchrun]
    torchrun answers SIGINT or SIGTERM by signalling its workers and then raising,
    traceback and all, and reports any worker that exits with an error the same
    way. So the launch runs in a session of its own, out of reach of the
    terminal's Ctrl-C, and the first Ctrl-C here creates a stop file that every
    rank polls at the end of each step: they stop together at the same step and
    exit 0, torchrun finishes quietly, and this process returns 130. A second
    Ctrl-C (or a SIGTERM) sends SIGWINCH to the ranks themselves (torchrun's
    children): a rank stops at once on it, removes its files and exits 0, and
    this process returns 130 (143). SIGWINCH because its default is to ignore it:
    a rank not yet running, or one on its way out (Python's exit gives SIGINT its
    default, fatal action back), is not killed by it; each rank is in a session of
    its own, with no terminal to send it. The stop file is created too, for a rank
    that was not listening yet. One more goes to the whole launch, torchrun's way.
    """
    # in a directory of this launch's own: a file named by the pid that a launcher
    # killed outright left behind stopped a later launch with that pid after one step
    stop_dir = Path(tempfile.mkdtemp(prefix="offload-launch-"))
    stop_file = stop_dir / "stop"
    cmd = [sys.executable, "-c", "import sys; from offload.cli.demo_launch import torchrun; "
           "sys.exit(torchrun(sys.argv[1:]))", "--standalone",
           f"--nproc_per_node={plan.world}", "-m", "offload.cli.main", "demo",
           *child_argv]
    env = {**os.environ, "OFFLOAD_DEMO_HEADER": "1", "OFFLOAD_DEMO_STOP_FILE": str(stop_file),
           "OMP_NUM_THREADS": str(max(1, usable_cpus() // plan.world))}
    created = missing_directories(str(plan.swap_root))
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except BaseException:
        shutil.rmtree(stop_dir, ignore_errors=True)
        raise
    stopped_by = 0  # the exit code of a stop asked for here: 130 Ctrl-C, 143 SIGTERM

    signalled = False  # the ranks were told to stop now

    def now(code: int, sig: int) -> None:
        nonlocal stopped_by, signalled
        stopped_by = stopped_by or code
        ranks = [] if signalled else children(proc.pid)
        signalled = True
        stop_file.touch()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGWINCH)
            except ProcessLookupError:  # it ended meanwhile
                pass
        if not ranks:  # none started yet, or asked before: the launch, torchrun's way
            os.killpg(proc.pid, sig)
    old = signal.signal(signal.SIGTERM, lambda *_: now(143, signal.SIGTERM))
    asked = False
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                if asked:
                    now(130, signal.SIGINT)
                    continue
                asked = True
                stop_file.touch()
                reporter.note("stopping after this step (Ctrl-C again to stop now); swap "
                              "files are removed either way")
    finally:
        signal.signal(signal.SIGTERM, old)
        if proc.poll() is None:  # leaving on an error of this process's own (a Ctrl-C
            _stop_now(proc, now)  # as the note prints, a closed stderr): the ranks stop
        shutil.rmtree(stop_dir, ignore_errors=True)
    notes: list[str] = []  # a rank killed (SIGKILL, the OOM killer) left its directory
    if plan.swap_root.is_dir():
        remove_dead_runs(plan.swap_root, notes)
    for note in notes:
        reporter.note(note)
    remove_directories(created)  # each rank removed its own directory; the rest is here
    return stopped_by or (130 if asked else rc)


def _stop_now(proc: subprocess.Popen, now: Callable[[int, int], None]) -> None:
    """Stops the launch that `relaunch` leaves with an error of its own: the ranks, in
    sessions of their own, would run on out of the terminal's reach. Each is told to
    stop now, as by a second Ctrl-C, and given a while to remove its files; what is
    still running then is killed."""
    try:
        now(130, signal.SIGTERM)
        proc.wait(timeout=60)
    except BaseException:  # noqa: BLE001 - leaving already: what is left ends here
        for pid in [*children(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def torchrun(argv: list[str]) -> int:
    """torchrun on `argv`, where a rank that failed is one line, not torchrun's
    traceback and report ([Note: stopping under torchrun]): the rank that failed first
    and how (its own error, if it raised one, is above), and how the others ended
    (torchrun stops them)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except ChildFailedError as e:
        first, failure = e.get_first_failure()
        others = [f"rank {r} {_how(f)}" for r, f in sorted(e.failures.items()) if r != first]
        print(f"offload demo: rank {first} (pid {failure.pid}) {_how(failure)}"
              + (f"; then {', '.join(others)}" if others else ""), file=sys.stderr)
        return 1
    except SignalException as e:  # the launch signalled as a whole: [Note: stopping ...]
        return 128 + int(e.sigval)
    return 0


def _how(failure: Any) -> str:
    """How a rank ended, from torchrun's record of it."""
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/*/stat)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")  # gloo's transport


def peer_lost(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, is a collective's failure because
    another rank's connection closed (gloo: the rank ended, killed or failed)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False
