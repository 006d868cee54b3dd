"""Checkpoints are published atomically: kill -9 mid-save, partial directories, keep-last-K."""

import json
import os
import signal
import subprocess
import sys
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


@pytest.mark.parametrize("pause", ["write", "rename"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path, engine_cfg, pause):
    cfg = engine_cfg("nvme", "nvme", "nvme", dtype="bf16")
    cfg["io"]["paths"] = [str(tmp_path / "swap-child")]
    root = tmp_path / "ckpt"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "tests.engine.checkpoint_child",
                              json.dumps(cfg), str(root), pause], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "PAUSED", (line, child.stderr.read() if child.poll() else "")
    finally:
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
    with offload.initialize(TiedTwice(), cfg) as engine:
        for i, batch in enumerate(lm_batches(4)):
            _step(engine, batch)
            engine.save_checkpoint(root / f"step-{i + 1}")
    assert sorted(p.name for p in root.iterdir()) == ["not-a-checkpoint", "step-3", "step-4"]
    assert json.loads((root / "step-4" / RECORD).read_text())["global_step"] == 4
