"""`offload bench step` as a user runs it: real worker processes, real swap files.

Runs offload alone (DeepSpeed is optional and not needed here) on a tiny MLP.
"""

import argparse
import json
import os
import subprocess
import sys

BENCH = [sys.executable, "-m", "offload.cli.bench_step"]
TINY = ["--dim", "256", "--layers", "2", "--batch", "4", "--steps", "2", "--warmup", "1",
        "--rounds", "1", "--system", "offload", "--disk-size", "8MiB"]
ROW_KEYS = {"system", "placement", "median_step_s", "peak_rss_GiB", "read_bytes_per_step",
            "write_bytes_per_step", "note"}


def _run(args, tmp_path, timeout=120):
    return subprocess.run(BENCH + TINY + ["--path", str(tmp_path)] + args,
                          capture_output=True, text=True, timeout=timeout)


def test_json_rows_per_placement(tmp_path):
    out = _run(["--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["benchmark"] == "step" and res["model"]["dim"] == 256
    assert res["bytes_source"].startswith("/proc/self/io")
    rows = {(r["system"], r["placement"]): r for r in res["results"]}
    assert set(rows) == {("offload", p) for p in ("none", "host", "nvme")}
    for r in rows.values():
        assert set(r) >= ROW_KEYS, r
        assert r["note"] is None, r["note"]
        assert r["median_step_s"] > 0 and r["peak_rss_GiB"] > 0
        assert r["last_loss"] < r["first_loss"]  # it trains
    nvme = rows[("offload", "nvme")]
    # the Adam moments (8 B/param; in fp32 the parameter partition is the master) go to
    # the disk and back every step
    assert nvme["read_bytes_per_step"] >= 8 * res["model"]["params"]
    assert nvme["write_bytes_per_step"] >= 8 * res["model"]["params"]
    assert rows[("offload", "none")]["write_bytes_per_step"] < nvme["write_bytes_per_step"]
    assert nvme["bound_s"] > 0 and nvme["step_over_bound"] > 0
    assert res["disk"]["read_GBps"] > 0 and res["disk"]["write_GBps"] > 0
    assert res["disk"]["mixed_GBps"] > 0 and res["disk"]["mixed_depth"] >= 1
    assert nvme["mixed_bound_s"] > 0 and nvme["step_over_mixed_bound"] > 0
    # the disk is probed right before each nvme run; the row's bound uses its own probes
    assert res["disk"]["probes"] == 1 and nvme["disk"]["read_GBps"] > 0
    io_s = (nvme["read_bytes_per_step"] / (nvme["disk"]["read_GBps"] * 1e9)
            + nvme["write_bytes_per_step"] / (nvme["disk"]["write_GBps"] * 1e9))
    assert abs(nvme["io_bound_s"] - io_s) < 1e-9
    assert isinstance(res["huge_pages"]["on"], bool) and res["huge_pages"]["why"]
    # without DeepSpeed rows, the targets that need only offload's row are still judged
    assert [t["limit"] for t in res["targets"]] == [1.15, 1.0]
    assert all(isinstance(t["met"], bool) for t in res["targets"])
    assert os.listdir(tmp_path) == []  # swap files and worker files are gone


def test_table_and_selection(tmp_path):
    out = _run(["--placement", "host"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "offload bench step" in out.stdout and "host" in out.stdout
    assert "nvme" not in out.stdout.split("RSS:")[0]  # only the selected placement ran


def test_bad_selection_is_clear(tmp_path):
    out = _run(["--system", "megatron"], tmp_path, timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "offload bench step: --system: 'megatron' is not one of offload, deepspeed; give a "
        "comma list of offload, deepspeed\n")


def test_device_selection(tmp_path):
    import torch

    out = _run(["--device", "tpu"], tmp_path, timeout=60)
    assert out.returncode == 2 and "--device: invalid choice: 'tpu'" in out.stderr
    if not torch.cuda.is_available():
        out = _run(["--device", "cuda"], tmp_path, timeout=60)
        assert out.returncode == 2 and "no CUDA device is visible" in out.stderr
        assert "Traceback" not in out.stderr
        return
    out = _run(["--device", "cuda", "--placement", "nvme", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["device"] == "cuda" and res["results"][0]["last_loss"] is not None


def test_missing_deepspeed_rows_say_why(tmp_path, monkeypatch):
    """Without DeepSpeed its rows carry a note and no numbers, never a made-up figure."""
    from offload.cli import bench_step

    monkeypatch.setattr(bench_step, "_deepspeed_status",
                        lambda: (None, "deepspeed is not installed"))
    p = argparse.ArgumentParser()
    bench_step.add_arguments(p)
    args = p.parse_args(["--dim", "256", "--layers", "2", "--steps", "1", "--rounds", "1",
                         "--system", "deepspeed", "--placement", "host,nvme",
                         "--disk-size", "8MiB"])
    res = bench_step.run_step_bench(args, str(tmp_path))
    assert [(r["system"], r["placement"]) for r in res["results"]] == \
        [("deepspeed", "host"), ("deepspeed", "nvme")]
    for r in res["results"]:
        assert r["median_step_s"] is None and r["read_bytes_per_step"] is None
        assert r["note"] == "deepspeed is not installed"
    assert res["targets"] == [] and res["deepspeed"] is None
