"""Processes around a live engine, as training scripts make them: DataLoader workers
(fork, spawn, forkserver), bare `os.fork()` children and `multiprocessing` children
that exit normally or touch the engine, a second process on the same `io.paths`, and
forks while a step's I/O or a background save is in flight. The parent's training
numbers and swap files stay as they are, and nothing hangs."""

import faulthandler
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import offload
from offload.io import SwapLockedError

from .models import TiedTwice, lm_batches, lm_train

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT = 20.0  # seconds a child may take before the test calls it hung


def _listing(directory: str) -> list[tuple[str, int]]:
    """(name, bytes) of every file in `directory`, sorted."""
    return sorted((f, os.path.getsize(os.path.join(directory, f))) for f in os.listdir(directory))


def _model() -> TiedTwice:
    torch.manual_seed(0)  # every engine of a test starts from the same weights
    return TiedTwice()


def _weights(engine) -> dict[str, torch.Tensor]:
    with engine.full_weights() as w:
        return {n: t.detach().clone() for n, t in w.items()}


def _wait_child(pid: int, timeout: float = CHILD_TIMEOUT) -> int:
    """The child's exit status; kills it and fails the test if it has not ended in
    `timeout` seconds (a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child {pid} still running after {timeout} s (hung)")
        time.sleep(0.01)


def _fork(child) -> int:
    """Forks; the child runs `child()` and leaves with os._exit (0, or 1 on an error,
    printed), never returning into pytest."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        faulthandler.dump_traceback_later(CHILD_TIMEOUT / 2, exit=True)  # says where it hung
        try:
            child()
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


# -- DataLoader workers ---------------------------------------------------------------

class TokenBatches(torch.utils.data.Dataset):
    """Deterministic (x, y) batches of token ids, the same in any worker."""

    def __init__(self, n: int) -> None:
        self.batches = lm_batches(n)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        return self.batches[i]


def _loader(n: int, workers: int, context: str | None = None, persistent: bool = False):
    return torch.utils.data.DataLoader(
        TokenBatches(n), batch_size=None, shuffle=False, num_workers=workers,
        multiprocessing_context=context if workers and context != "fork" else None,
        persistent_workers=persistent)


def _loader_run(cfg: dict, workers: int, context: str | None = None
                ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Trains 3 steps from a DataLoader made after initialize, then 3 more from one
    with persistent workers that is deleted (fork only: spawning is slow); the swap
    files are as before each."""
    swap = cfg["io"]["paths"][0]
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(1, seed=7))  # the swap files hold state before any worker
        before = _listing(swap)
        losses = lm_train(e, _loader(3, workers, context))  # exhausted: workers end
        assert _listing(swap) == before, f"{context}: swap files changed by the workers"
        if context in (None, "fork"):
            loader = _loader(3, workers, context, persistent=bool(workers))
            losses += lm_train(e, loader)
            del loader  # persistent workers shut down here
            assert _listing(swap) == before, f"{context}: swap files changed by the workers"
        losses += lm_train(e, lm_batches(1, seed=8))  # the files still work
        return losses, _weights(e)


@pytest.mark.parametrize("context", [  # spawn: 4 s, its workers share no state by design
    "fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers_leave_training_and_swap_files_unchanged(engine_cfg, context):
    """A DataLoader with 2 workers made after initialize (fork: the default on Linux,
    and spawn) trains to the same losses and weights as num_workers=0, and its
    workers, ending or deleted, leave the parent's swap files as they were."""
    cfg = engine_cfg("nvme", "host", "nvme")
    ref_losses, ref_weights = _loader_run(cfg, 0, context)
    losses, weights = _loader_run(cfg, 2, context)
    assert losses == ref_losses
    for n, t in ref_weights.items():
        assert torch.equal(weights[n], t), n


def test_dataloader_forkserver_workers(engine_cfg):
    """forkserver workers too: the same losses as num_workers=0, files unchanged."""
    cfg = engine_cfg("host", "host", "nvme")
    swap = cfg["io"]["paths"][0]
    with offload.initialize(_model(), cfg) as e:
        ref = lm_train(e, lm_batches(2))
    with offload.initialize(_model(), cfg) as e:
        before = _listing(swap)
        assert lm_train(e, _loader(2, 2, "forkserver")) == ref
        assert _listing(swap) == before


# -- children that exit normally ------------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent("""
    import json, multiprocessing as mp, os, sys, time
    import torch
    import offload
    from tests.engine.models import TiedTwice, lm_batches, lm_train

    cfg = json.loads(sys.argv[1])
    swap = cfg["io"]["paths"][0]

    def listing():
        return sorted((f, os.path.getsize(os.path.join(swap, f))) for f in os.listdir(swap))

    def wait(pid):
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hung"

    def returns():
        return None

    report = {}
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), cfg) as e:
        lm_train(e, lm_batches(2))
        report["before"] = listing()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit handlers run, and the with block's exit
        report["sys.exit"] = [wait(pid), listing()]
        pid = os.fork()
        if pid == 0:
            e.close()  # cleanup code in a child
            sys.exit(0)
        report["close"] = [wait(pid), listing()]
        p = mp.get_context("fork").Process(target=returns)
        p.start()
        p.join(15)
        report["mp.Process"] = [p.exitcode, listing()]
        report["losses"] = lm_train(e, lm_batches(2, seed=3))
    print("REPORT", json.dumps(report))
""")


def _run_script(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_children_that_exit_normally_leave_the_parents_swap_files(engine_cfg):
    """A forked child that does nothing with the engine and leaves by sys.exit(0) (its
    atexit hooks run, and a `with` block's exit closes the engine there), one that
    calls engine.close(), and a multiprocessing fork Process whose target returns:
    each ends promptly, and the parent's swap and lock files are all still there, the
    same size, and keep training to the same losses as a run without children."""
    cfg = engine_cfg("nvme", "host", "nvme")
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(2))
        ref = lm_train(e, lm_batches(2, seed=3))
    r = _run_script(_EXIT_SCRIPT, json.dumps(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    # the children's exit hooks (the AIO context's too) leave the parent's things alone
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    report = json.loads(r.stdout.split("REPORT ", 1)[1])
    before = report["before"]
    assert [n for n, _ in before if n.endswith(".swap")], before
    for case in ("sys.exit", "close", "mp.Process"):
        code, after = report[case]
        assert code == 0, f"{case}: child exit {code}"
        assert after == before, f"{case}: parent's swap files changed: {before} -> {after}"
    assert report["losses"] == ref


# -- a child that uses the engine ------------------------------------------------------

@pytest.mark.parametrize("placement", [("nvme", "host", "nvme"), ("host", "host", "host")])
def test_engine_used_in_a_forked_child_raises_clearly(engine_cfg, tmp_path, placement):
    """A forked child calling the engine (forward, backward, step, a save, state_dict)
    gets a RuntimeError saying the engine belongs to the parent process, at once, not
    a hang; its close() touches nothing of the parent's, a new engine there on the
    same io.paths is refused naming the parent, and the parent's files and training
    stay as they were."""
    cfg = engine_cfg(*placement)
    swap = cfg["io"]["paths"][0]
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(2))
        ref = lm_train(e, lm_batches(1, seed=5))
    out = tmp_path / "child.json"
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(2))
        before = _listing(swap)
        x, y = lm_batches(1, seed=5)[0]

        def child():
            calls = {"forward": lambda: e(x), "backward": lambda: e.backward(x.float().sum()),
                     "step": e.step, "save": lambda: e.save_checkpoint(tmp_path / "ck"),
                     "state_dict": e.state_dict, "module": lambda: e.module(x)}
            errors = {}
            for name, call in calls.items():
                try:
                    call()
                    errors[name] = None
                except RuntimeError as err:
                    errors[name] = str(err)
            e.close()
            try:  # a new engine in the child on the parent's io.paths
                offload.initialize(_model(), cfg).close()
                errors["initialize"] = None
            except SwapLockedError as err:
                errors["initialize"] = str(err)
            out.write_text(json.dumps(errors))

        assert _wait_child(_fork(child)) == 0
        errors = json.loads(out.read_text())
        locked = errors.pop("initialize")
        assert locked is not None and swap in locked and f"pid {os.getpid()}" in locked, locked
        for name, msg in errors.items():
            assert msg is not None and "fork" in msg and str(os.getpid()) in msg, (name, msg)
        assert not (tmp_path / "ck").exists()
        assert _listing(swap) == before
        assert lm_train(e, [(x, y)]) == ref


# -- a second process on the same paths ------------------------------------------------

_SECOND = textwrap.dedent("""
    import json, sys
    import offload
    from tests.engine.models import TiedTwice
    try:
        offload.initialize(TiedTwice(), json.loads(sys.argv[1]))
    except Exception as e:
        print(type(e).__name__, e)
        sys.exit(3)
""")


def test_second_process_on_the_same_paths_is_refused(engine_cfg):
    """Another Python calling offload.initialize with the same io.paths while this
    engine is open is refused with an error naming the swap file and this process;
    this engine's files and training are untouched."""
    cfg = engine_cfg("nvme", "host", "nvme")
    swap = cfg["io"]["paths"][0]
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(2))
        ref = lm_train(e, lm_batches(1, seed=5))
    with offload.initialize(_model(), cfg) as e:
        lm_train(e, lm_batches(2))
        before = _listing(swap)
        r = _run_script(_SECOND, json.dumps(cfg))
        assert r.returncode == 3, (r.stdout, r.stderr[-3000:])
        assert "SwapLockedError" in r.stdout and swap in r.stdout, r.stdout
        assert f"pid {os.getpid()}" in r.stdout, r.stdout
        assert _listing(swap) == before
        assert lm_train(e, lm_batches(1, seed=5)) == ref


# -- forks while I/O is in flight ------------------------------------------------------

def _forking(stop: threading.Event, pids: list[int]) -> threading.Thread:
    """A thread forking children that run the finalizers a normal exit runs and leave,
    until `stop`. (Not every atexit hook: tensorstore's waits for a lock that a save
    in flight held at the fork, so a child of a process saving through it can hang in
    sys.exit; multiprocessing's and DataLoader's children leave by os._exit.)"""
    import weakref

    def child():
        weakref.finalize._exitfunc()

    def loop():
        while not stop.is_set():
            pids.append(_fork(child))
            time.sleep(0.002)
    t = threading.Thread(target=loop, name="test-forker", daemon=True)
    t.start()
    return t


@pytest.mark.slow  # 6 s; the swap files a child leaves are checked by default above
def test_forks_during_steps_and_a_background_save(engine_cfg, tmp_path):
    """Children forked from another thread while steps run (their I/O in flight) and
    while a background save writes: every child ends, the parent's losses and weights
    equal a run without forks, and the checkpoint resumes to the same weights."""
    cfg = engine_cfg("nvme", "host", "nvme")
    batches = lm_batches(4)
    with offload.initialize(_model(), cfg) as e:
        ref_losses = lm_train(e, batches)
        ref_weights = _weights(e)
    swap = cfg["io"]["paths"][0]
    stop, pids = threading.Event(), []
    with offload.initialize(_model(), cfg) as e:
        losses = lm_train(e, batches[:1])
        before = _listing(swap)
        forker = _forking(stop, pids)
        try:
            losses += lm_train(e, batches[1:])
            save = e.save_checkpoint(tmp_path / "ck", blocking=False)
            save.wait()
        finally:
            stop.set()
            forker.join(CHILD_TIMEOUT)
        assert pids
        for pid in pids:
            assert _wait_child(pid) == 0
        assert _listing(swap) == before
        assert losses == ref_losses
        weights = _weights(e)
    for n, t in ref_weights.items():
        assert torch.equal(weights[n], t), n
    with offload.initialize(_model(), cfg, resume=tmp_path / "ck") as r:
        for n, t in _weights(r).items():
            assert torch.equal(t, ref_weights[n]), n
