"""`offload tune` as a user runs it: real processes, a real swap directory, and the TOML
it writes given unchanged to `offload.initialize`."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.cli.tune_probe import probe_disk
from offload.cli.tune_verify import spread, steadiest_fastest
from offload.config import load_config

from .one_process import run_each

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = textwrap.dedent("""
    from torch import nn

    def mlp():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])

    def wide():
        return nn.Sequential(nn.Linear(1 << 20, 4))
    """)
MiB = 1 << 20


@pytest.fixture
def work(tmp_path):
    (tmp_path / "tinymodels.py").write_text(MODELS)
    return tmp_path


def _tune(work, *argv, timeout=600):
    return subprocess.run(OFFLOAD + ["tune", "tinymodels:mlp", "--dtype", "fp32", "--device",
                                     "cpu", "--probe-size", "8MiB", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=work,
                          env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})


def _mlp():
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])


@pytest.mark.slow  # 14 s; tune -> file -> initialize -> training is checked by default in
# test_tune_edges.py (test_written_config_trains_like_adamw_within_its_budgets)
def test_tune_writes_a_config_that_initialize_takes_unchanged(work):
    out = _tune(work, "--swap", str(work / "swap"), "--host-budget", "12MiB",
                "--device-budget", "1MiB", "--write", "offload.toml", "--verify", "1", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    steps = [r["predicted_step_s"] for r in res["results"]]
    # ranked best first; predictions within a microsecond tie and go by bytes moved
    rounded = [round(s, 6) for s in steps]
    assert rounded == sorted(rounded) and len(steps) == res["candidates"] > 1
    assert len(res["verify"]) == 1 and all(v["measured_step_s"] > 0 for v in res["verify"])
    assert res["verify_left"] == 0  # else a line says how many did not run
    assert res["calibration_runs"] and res["calibration"]
    # calibration measures the best-predicted placement of each optimizer tier that fits
    assert {r["class"].split("@")[0].split("/")[2] for r in res["calibration_runs"]} == \
        {"host", "nvme"}
    # the finalists: the fastest measured configurations, at most 2 of a class, measured
    # again in interleaved rounds; the written one is the steadiest of the near-fastest
    runs = [(v["measured_step_s"], res["results"][v["rank"] - 1]["config"])
            for v in res["verify"]]
    runs += [(r["measured_step_s"], r["config"]) for r in res["calibration_runs"]]
    final = res["final"]
    fin = final["finalists"]
    assert final["rounds"] >= 1 and 2 <= len(fin) <= 5
    classes = [f["class"] for f in fin]
    assert max(classes.count(c) for c in classes) <= 2  # at most 2 of a class
    assert all(fin.count(f) == 1 for f in fin)
    assert fin[0]["config"] == min(runs, key=lambda r: r[0])[1]
    assert all(len(f["samples_s"]) == final["rounds"] * final["steps"] for f in fin)
    stats = {str(i): spread(f["samples_s"]) for i, f in enumerate(fin)}
    assert final["chosen"] == int(steadiest_fastest(stats))
    assert res["best"] == fin[final["chosen"]]["config"]
    row = res["results"][res["chosen"] - 1]
    assert row["config"] == res["best"]
    assert {"predicted_step_s", "tokens_per_s", "peak", "bytes_read", "bytes_written",
            "limit"} <= set(row)
    assert row["limit"] in ("disk", "CPU", "compute")
    # the budgets hold: the store's, host optimizer state and I/O buffers within --host-budget
    cfg = load_config(str(work / "offload.toml"))
    assert cfg.store.device_budget <= 1 * MiB
    assert row["peak"]["host"] <= 12 * MiB and cfg.store.host_budget <= 12 * MiB
    engine = offload.initialize(_mlp, str(work / "offload.toml"))
    try:
        x = torch.randn(8, 256)
        engine.backward(engine(x).square().mean())
        assert engine.step()
        tiers = engine.store.stats().tiers
        assert tiers["DEVICE"].peak <= cfg.store.device_budget
        assert tiers["HOST"].peak <= cfg.store.host_budget
    finally:
        engine.close()


@pytest.mark.slow  # 23 s; the default suite runs tune in test_tune_writes_a_config_...
def test_tune_table_with_progress_bars(work):
    out = _tune(work, "--swap", str(work / "swap"), "--host-budget", "256MiB",
                "--device-budget", "64MiB", "--top", "3")
    assert out.returncode == 0, out.stderr
    for phase in ("probe disk", "record step", "search"):
        assert phase in out.stderr
    assert "step s" in out.stdout and "tokens/s" in out.stdout and "limit" in out.stdout
    assert not (work / "swap").exists()  # made by tune, named by no config: removed


def test_impossible_budgets_say_what_is_missing_in_which_tier(work):
    out = _tune(work, "--swap", str(work / "swap"), "--host-budget", "8KiB",
                "--device-budget", "1MiB", timeout=300)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("offload tune: the model does not fit"), out.stderr
    assert "host: " in line and "missing" in line and "--host-budget to at least" in line
    assert "device:" not in line
    assert "Traceback" not in out.stderr


BAD_FLAGS = [
    ([], "--swap"),
    (["--swap", "/etc/hosts"], "--swap: '/etc/hosts' exists and is not a directory"),
    (["--swap", "/proc/offload-swap"], "--swap: '/proc/offload-swap' cannot be created: /proc "
     "is on a file system without storage"),
    (["--swap", "SWAP", "--verify", "-1"], "--verify: '-1' is below 0"),
    (["--swap", "SWAP", "--host-budget", "lots"], "--host-budget: 'lots' is not a byte size"),
    (["--swap", "SWAP", "--batch", str(1 << 63)], f"--batch: '{1 << 63}' is out of range"),
    (["--swap", "SWAP", "--seq", str(1 << 63)], f"--seq: '{1 << 63}' is out of range"),
]


def test_bad_flags_are_one_line_exit_2(work):
    argvs = [["tune", "tinymodels:mlp", "--dtype", "fp32", "--device", "cpu", "--probe-size",
              "8MiB", *(str(work / "swap") if a == "SWAP" else a for a in argv)]
             for argv, _ in BAD_FLAGS]
    got = run_each(argvs, work, {**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})
    for (argv, words), (rc, err) in zip(BAD_FLAGS, got, strict=True):
        assert rc == 2, (argv, rc, err)
        assert words in err and err.count("\n") == 1, (argv, err)
    assert not (work / "swap").exists()


def test_a_batch_the_model_cannot_take_creates_no_swap_directory(work):
    out = subprocess.run(OFFLOAD + ["tune", "tinymodels:wide", "--swap", str(work / "swap"),
                                    "--batch", "1048576", "--seq", "16777216"],
                         capture_output=True, text=True, timeout=120, cwd=work,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2
    assert out.stderr.startswith("offload tune: --batch/--seq: a batch of shape") and \
        out.stderr.count("\n") == 1, out.stderr
    assert not (work / "swap").exists()


def test_disk_probe_removes_only_the_directories_it_made(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    rates = probe_disk(str(swap / ".offload-tune-probe" / "sub"), 8 * MiB,
                       grid=((1 * MiB, 8),))
    assert len(rates) == 1 and rates[0].read_Bps > 0
    assert swap.is_dir() and list(swap.iterdir()) == []
