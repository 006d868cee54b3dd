"""An engine's life as a notebook meets it: cells run again, two engines side by
side, the model after `close()`, a job killed or interrupted and the next one on the
same swap directory, an engine dropped while it saves in the background."""

import copy
import gc
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch

import offload
from offload.config import ConfigError
from offload.io import SwapLockedError

from .models import TiedTwice, assert_weights_as_torch, lm_batches, lm_loss

ROOT = str(Path(__file__).resolve().parents[2])
CLOSED = "belonged to an OffloadEngine that is closed"


def _adamw(ref):
    return torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)


def _both(engine, ref, opt, x, y) -> None:
    """One step of the engine and the same step of plain torch."""
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    opt.zero_grad()
    lm_loss(ref(x), y).backward()
    opt.step()


def test_the_model_after_close_says_its_engine_is_closed(engine_cfg, tmp_path):
    """After close() the model's parameters are stand-ins of weights that went with the
    engine: every use says so (not "use engine.full_weights()", which a closed engine
    refuses), metadata still reads, a second initialize of it says the engine is
    closed, and a fresh model on the same swap directory trains as torch at once."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    model = TiedTwice()
    engine = offload.initialize(model, cfg)
    x, y = lm_batches(1)[0]
    engine.backward(lm_loss(engine(x), y))  # closed between backward and step
    engine.close()
    p = model.emb.weight
    for use in (lambda: model(x), lambda: copy.deepcopy(model), p.tolist,
                lambda: torch.save(model, io.BytesIO()),
                lambda: torch.save(model.state_dict(), io.BytesIO()),
                lambda: p.grad + 1, lambda: model.load_state_dict(TiedTwice().state_dict())):
        with pytest.raises(RuntimeError, match=CLOSED) as e:
            use()
        assert "full_weights" not in str(e.value)
    assert "Embedding(64, 32)" in str(model) and p.shape == (64, 32)
    assert sum(q.numel() for q in model.parameters()) == 64 * 32 + 32 * 48 * 2 + 48 + 32 * 4
    with pytest.raises(ConfigError, match="wrapped by an OffloadEngine that is closed now"):
        offload.initialize(model, cfg)
    with pytest.raises(ConfigError, match="that is closed now"):  # one of its modules
        offload.initialize(torch.nn.Sequential(model.l1), cfg)

    torch.manual_seed(1)
    ref = TiedTwice()
    again = offload.initialize(copy.deepcopy(ref), cfg)  # the same io.paths at once
    try:
        opt = _adamw(ref)
        _both(again, ref, opt, *lm_batches(1, seed=1)[0])
        assert_weights_as_torch(again, ref, atol=1e-5)
    finally:
        again.close()
    assert os.listdir(tmp_path / "swap") == []


def test_two_engines_interleaved_step_by_step_train_as_torch_each(engine_cfg, tmp_path):
    """Two engines open at once on their own directories, stepped in turn, one's
    forward between the other's forward and backward, then one closed while the
    other trains on: each gives torch AdamW's weights."""
    torch.manual_seed(0)
    refs = [TiedTwice(), TiedTwice()]
    cfgs = [engine_cfg("nvme", "nvme", "nvme"), engine_cfg("device", "host", "host")]
    cfgs[1]["io"]["paths"] = [str(tmp_path / "swap-b")]
    engines = [offload.initialize(copy.deepcopy(r), c) for r, c in zip(refs, cfgs)]
    opts = [_adamw(r) for r in refs]
    try:
        batches = [lm_batches(3, seed=1), lm_batches(3, seed=2)]
        for i in range(2):
            for k in (0, 1):
                _both(engines[k], refs[k], opts[k], *batches[k][i])
        (xa, ya), (xb, yb) = batches[0][2], batches[1][2]
        la, lb = lm_loss(engines[0](xa), ya), lm_loss(engines[1](xb), yb)
        engines[1].backward(lb)
        engines[0].backward(la)
        engines[0].step()
        engines[1].step()
        for k, (x, y) in ((0, (xa, ya)), (1, (xb, yb))):
            opts[k].zero_grad()
            lm_loss(refs[k](x), y).backward()
            opts[k].step()
        assert_weights_as_torch(engines[0], refs[0], atol=1e-5)
        engines[0].close()
        assert os.listdir(tmp_path / "swap") == []
        _both(engines[1], refs[1], opts[1], *lm_batches(1, seed=3)[0])
        assert_weights_as_torch(engines[1], refs[1], atol=1e-5)
    finally:
        for e in engines:
            e.close()


def test_a_dropped_engine_whose_model_is_kept_names_how_to_free_its_directory(
        engine_cfg, tmp_path):
    """`del engine` with the model kept leaves the engine open (the model's hooks hold
    it): a new engine on the same directory is refused, saying what keeps the old one
    open, and goes once the model is dropped too."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    model = TiedTwice()
    engine = offload.initialize(model, cfg)
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    try:
        with pytest.raises(SwapLockedError, match=r"while its model .* `del` those and run "
                                                  r"gc\.collect\(\)"):
            offload.initialize(TiedTwice(), cfg)
        with pytest.warns(ResourceWarning, match="without close"):
            del model
            gc.collect()
        assert alive() is None
        offload.initialize(TiedTwice(), cfg).close()
    finally:
        if alive() is not None:
            alive().close()


def test_an_engine_dropped_while_it_saves_in_the_background_publishes_the_save(
        engine_cfg, tmp_path):
    """`del engine, model` and gc.collect() while a background save runs: the save
    finishes and resumes to torch's numbers, then the engine's files are given back."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, cfg)
    opt = _adamw(ref)
    _both(engine, ref, opt, *lm_batches(1)[0])
    saving = engine.save_checkpoint(tmp_path / "ck", blocking=False)
    alive = weakref.ref(engine)
    del engine, model
    gc.collect()
    deadline = time.monotonic() + 60
    while not saving.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saving.done(), "the background save of a dropped engine did not end"
    assert saving.wait() == tmp_path / "ck"
    with pytest.warns(ResourceWarning, match="without close"):
        gc.collect()
    assert alive() is None
    assert not any(n.endswith(".swap") for n in os.listdir(tmp_path / "swap"))
    resumed = offload.initialize(TiedTwice(), cfg, resume=tmp_path / "ck")
    try:
        assert resumed.global_step == 1
        assert_weights_as_torch(resumed, ref, atol=1e-5)
    finally:
        resumed.close()


_SAVES_LAST = textwrap.dedent("""
    import json, sys
    import offload
    from tests.engine.models import TiedTwice, lm_batches, lm_loss
    engine = offload.initialize(TiedTwice(), json.loads(sys.argv[1]))
    for i in range(2):
        x, y = lm_batches(1, seed=i)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(sys.argv[2], blocking=False)  # the script's last line
""")


def test_a_script_that_ends_on_a_background_save_publishes_it(engine_cfg, tmp_path):
    """A script whose last line starts a background save, never closing its engine:
    the save was lost without a word (the engine was released at exit under it); it
    is waited for, and the checkpoint resumes."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    p = subprocess.run([sys.executable, "-c", _SAVES_LAST, json.dumps(cfg),
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    assert not any(n.endswith(".swap") for n in os.listdir(tmp_path / "swap"))
    resumed = offload.initialize(TiedTwice(), cfg, resume=tmp_path / "ck")
    try:
        assert resumed.global_step == 2
    finally:
        resumed.close()


# A job's lock as a killed job with a live child leaves it: the job takes the swap
# file's flock (as offload-r0-param.swap.lock is taken) and writes its pid, forks a
# child that inherits the open file (a DataLoader worker), and is then killed.
_LOCKER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _running(pid: int) -> bool:
    """Whether `pid` runs (neither gone nor a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _killed_job_with_a_live_child(lock: Path) -> int:
    """Leaves `lock` as a job killed with SIGKILL while its forked child lives;
    returns that child's pid."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    job = subprocess.Popen([sys.executable, "-c", _LOCKER, str(lock)], stdout=subprocess.PIPE,
                           text=True)
    try:
        child = int(job.stdout.readline())
    finally:
        job.kill()
        job.wait(timeout=30)
        job.stdout.close()
    return child


def _refused_then_taken_over(cfg, child: int) -> None:
    model = TiedTwice()
    with pytest.raises(SwapLockedError, match=rf"no longer running\) started: pid {child}\b"):
        offload.initialize(model, cfg)
    _kill(child)
    deadline = time.monotonic() + 30  # the killed job's child, not ours: wait for its end
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine = offload.initialize(model, cfg)  # the model was left as it was
    try:
        engine.backward(lm_loss(engine(lm_batches(1)[0][0]), lm_batches(1)[0][1]))
        engine.step()
    finally:
        engine.close()


def test_a_lock_kept_by_a_killed_job_s_child_names_that_child(engine_cfg, tmp_path):
    """A job killed while a child it forked lives on leaves its lock held by that child
    with the dead job's pid in the file: the refusal names the child holding it (not
    "in use by another live process (pid <the dead job>)"), and once the child is gone
    the next engine takes the directory over."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    child = _killed_job_with_a_live_child(tmp_path / "swap" / "offload-r0-param.swap.lock")
    try:
        _refused_then_taken_over(cfg, child)
    finally:
        _kill(child)


_TRAINING_JOB = textwrap.dedent("""
    import json, os, sys, time
    import offload
    from tests.engine.models import TiedTwice, lm_batches, lm_loss
    engine = offload.initialize(TiedTwice(), json.loads(sys.argv[1]))
    if sys.argv[2] == "fork":  # a worker forked after initialize holds the swap files too
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
    for i in range(10_000):
        x, y = lm_batches(1, seed=i)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        if i == 1:
            print("training", flush=True)
""")


@pytest.mark.slow  # test_a_lock_kept_by_a_killed_job_s_child_names_that_child covers the path
@pytest.mark.parametrize("fork", [False, True])
def test_a_training_job_killed_by_sigkill_leaves_a_directory_the_next_one_takes(
        engine_cfg, tmp_path, fork):
    """A real training job killed with SIGKILL mid-loop: its swap and lock files stay,
    and the next engine takes them over; with a forked child of the job still alive,
    it is refused, naming the child, until the child is gone."""
    cfg = engine_cfg("nvme", "nvme", "nvme")
    job = subprocess.Popen([sys.executable, "-c", _TRAINING_JOB, json.dumps(cfg),
                            "fork" if fork else "plain"], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT})
    child = None
    try:
        line = job.stdout.readline()
        if fork:
            child, line = int(line), job.stdout.readline()
        assert line.strip() == "training"
    finally:
        job.kill()
        job.wait(timeout=30)
        job.stdout.close()
    assert any(n.endswith(".swap.lock") for n in os.listdir(tmp_path / "swap"))
    try:
        if child is not None:
            _refused_then_taken_over(cfg, child)
        else:
            torch.manual_seed(0)
            ref = TiedTwice()
            engine = offload.initialize(copy.deepcopy(ref), cfg)
            try:
                opt = _adamw(ref)
                for x, y in lm_batches(2):
                    _both(engine, ref, opt, x, y)
                assert_weights_as_torch(engine, ref, atol=1e-5)
            finally:
                engine.close()
    finally:
        if child is not None:
            _kill(child)
    assert os.listdir(tmp_path / "swap") == []


_INTERRUPTED_CELL = textwrap.dedent("""
    import copy, json, sys
    import torch
    import offload
    from tests.engine.models import TiedTwice, lm_batches, lm_loss
    torch.manual_seed(0)
    ref = TiedTwice()
    engine = offload.initialize(copy.deepcopy(ref), json.loads(sys.argv[1]))
    batches, used, i = lm_batches(10_000), [], 0
    try:  # one cell: trains until Ctrl-C
        while True:
            x, y = batches[i]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            used.append(i)
            i += 1
            if i == 3:
                print("training", flush=True)
    except KeyboardInterrupt:
        if engine.global_step > len(used):  # the interrupted step committed
            used.append(i)
        engine.zero_grad()
        i += 1
    for _ in range(3):  # the next cell trains on
        x, y = batches[i]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        used.append(i)
        i += 1
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for j in used:
        opt.zero_grad()
        lm_loss(ref(batches[j][0]), batches[j][1]).backward()
        opt.step()
    with engine.full_weights() as w:
        diff = max((w[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    print(json.dumps({"steps": engine.global_step, "used": len(used), "diff": diff}))
    engine.close()
""")


@pytest.mark.slow  # test_interrupts.py's test_ctrl_c_at_lines_spread_over_a_step covers the path
@pytest.mark.parametrize("placement", [("nvme", "nvme", "nvme"), ("device", "host", "host")])
def test_a_real_sigint_between_cells_then_training_goes_on_as_torch(engine_cfg, tmp_path,
                                                                    placement):
    """A real SIGINT to a process in a training loop (a notebook's interrupt), caught,
    then three more steps: the weights are torch AdamW's over the steps that
    committed, and no swap file is left."""
    cfg = engine_cfg(*placement)
    cfg["store"]["wait_timeout"] = 10.0  # a move left waiting fails in seconds
    job = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_CELL, json.dumps(cfg)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert job.stdout.readline().strip() == "training"
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["steps"] == got["used"] >= 6
    assert got["diff"] < 1e-5
    assert os.listdir(tmp_path / "swap") == []
