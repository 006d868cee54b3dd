"""`offload bench step` as a user runs it: real worker processes, real swap files.

Runs offload alone (DeepSpeed is optional and not needed here) on a tiny MLP.
"""

import argparse
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = [sys.executable, "-m", "offload.cli.bench_step"]
TINY = ["--dim", "256", "--layers", "2", "--batch", "4", "--steps", "2", "--warmup", "1",
        "--rounds", "1", "--system", "offload", "--disk-size", "8MiB"]
ROW_KEYS = {"system", "placement", "median_step_s", "peak_rss_GiB", "read_bytes_per_step",
            "write_bytes_per_step", "note"}


def _run(args, tmp_path, timeout=120):
    return subprocess.run(BENCH + TINY + ["--path", str(tmp_path)] + args,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # every placement, a process each: the default run has test_table_and_selection
def test_json_rows_per_placement(tmp_path):
    out = _run(["--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["benchmark"] == "step" and res["model"]["dim"] == 256
    assert res["bytes_source"].startswith("/proc/self/io")
    rows = {(r["system"], r["placement"]): r for r in res["results"]}
    assert set(rows) == {("offload", p) for p in ("none", "host", "nvme-opt", "nvme")}
    for r in rows.values():
        assert set(r) >= ROW_KEYS, r
        assert r["note"] is None, r["note"]
        assert r["median_step_s"] > 0 and r["peak_rss_GiB"] > 0
        assert r["last_loss"] < r["first_loss"]  # it trains
        # CPU time of every thread over the timed steps; over the cores, no more than the step
        assert 0 < r["cpu_floor_s"] < r["cpu_s_per_step"]
        # a floor of the mean step, give or take the CPU clock's lag behind threads
        # running at the time of a read (a few ms: these steps take about one)
        assert r["cpu_floor_s"] <= r["median_step_s"] * 1.5 + 0.01
    params = res["model"]["params"]
    for placement in ("nvme-opt", "nvme"):
        row = rows[("offload", placement)]
        # the Adam moments (8 B/param; in fp32 the parameter partition is the master) go
        # to the disk and back every step: forced on every system, and moved
        assert row["forced_read_bytes"] == row["forced_write_bytes"] == 8 * params
        assert row["read_bytes_per_step"] >= row["forced_read_bytes"]
        assert row["write_bytes_per_step"] >= row["forced_write_bytes"]
        # the bound: the forced bytes at the rates probed right before the row's runs
        d = row["disk"]
        assert row["bound_terms_s"]["read"] == 8 * params / (d["read_GBps"] * 1e9)
        assert set(row["bound_terms_s"]) == {"compute", "read", "write"}
        assert row["mixed_s"] == 16 * params / (d["mixed_GBps"] * 1e9)  # beside, not in it
        assert row["bound_s"] == max(row["bound_terms_s"].values())
        assert row["step_over_bound"] == row["median_step_s"] / row["bound_s"]
    nvme = rows[("offload", "nvme")]
    assert rows[("offload", "none")]["write_bytes_per_step"] < nvme["write_bytes_per_step"]
    assert res["disk"]["read_GBps"] > 0 and res["disk"]["write_GBps"] > 0
    assert res["disk"]["mixed_GBps"] > 0 and res["disk"]["mixed_depth"] >= 1
    assert res["disk"]["probes"] == 2  # before each offloading run: nvme-opt, nvme
    assert isinstance(res["huge_pages"]["on"], bool) and res["huge_pages"]["why"]
    # without DeepSpeed rows, the targets that need only offload's row are still judged
    assert [t["limit"] for t in res["targets"]][0] == 1.10 and len(res["targets"]) == 2
    assert all(isinstance(t["met"], bool) for t in res["targets"])
    assert os.listdir(tmp_path) == []  # swap files and worker files are gone


def test_table_and_selection(tmp_path):
    out = _run(["--placement", "host"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "offload bench step" in out.stdout and "host" in out.stdout
    assert "nvme" not in out.stdout.split("RSS:")[0]  # only the selected placement ran


def test_a_worker_s_error_and_the_disk_line_keep_their_figures(tmp_path):
    """A worker refused by initialize: its error, longer than a line, is cut at a word,
    and the figure the fix names is whole (it was cut inside it, "at least 4202");
    the disk line gives a request under 1 MiB in KiB (it said "0 MiB in flight")."""
    import re
    out = _run(["--placement", "nvme-opt,nvme", "--device-budget", "700KiB", "--host-budget",
                "1MiB", "--buffer-budget", "4MiB"], tmp_path)
    text = out.stdout + out.stderr
    assert "worker exited with 1" in text, text
    assert re.search(r"raise store\.\w+ to at least \d+ bytes", text), text
    assert not re.search(r"at least \d*\)?$", text, re.M), text  # cut inside the figure
    assert re.search(r"writes of \d+\.\d (KiB|MiB) in flight", text), text
    assert os.listdir(tmp_path) == []


def test_bad_selection_is_clear(tmp_path):
    out = _run(["--system", "megatron"], tmp_path, timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "offload bench step: --system: 'megatron' is not one of offload, offload-bf16, "
        "offload-int8, deepspeed; give a comma list of offload, offload-bf16, offload-int8, "
        "deepspeed\n")


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


def test_forced_bytes_are_a_lower_bound_on_what_streaming_parameters_must_move():
    """Parameters that do not fit the memory budgets must be read in forward and
    backward and the updated ones written; the figure is the fewest possible reads."""
    from offload.cli.bench_step import forced_bytes
    from offload.store import footprint

    dim, layers = 256, 6
    size = footprint(dim * (dim + 1) * 4)
    moments = 8 * layers * dim * (dim + 1)
    assert forced_bytes("nvme", dim, layers, 6 * size) == (moments, moments)  # all fit
    # room for 4 of 6 layers: forward finds the last 4 of the previous backward's order
    # gone... the fewest reads of the order 0..5, 5..0 with 4 slots: 2 + 2 per step
    r, w = forced_bytes("nvme", dim, layers, 4 * size)
    assert (r - moments, w - moments) == (4 * size, 2 * size)
    # room for 4.5 layers: a system that keeps half a layer reads 2 x 1.5 layers, not
    # the 2 x 2 of whole layers: memory holds at most 4.5 at the start of each pass
    r, w = forced_bytes("nvme", dim, layers, 9 * size // 2)
    assert (r - moments, w - moments) == (3 * size, 3 * size // 2)
    assert forced_bytes("none", dim, layers, size) == (0, 0)


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


def test_practicality_is_reported_on_both_disk_placements_against_the_systems_own_none():
    """[Note: practicality]: each system's disk rows over its own fastest none step
    (offload's forms of the moments against offload fp32's); the int8 target is
    checked on nvme-opt and nvme alike, and neither stands in for the other."""
    import pytest

    from offload.cli.bench_step_targets import compressed_targets, practicality

    def row(system, placement, s):
        return {"system": system, "placement": placement, "median_step_s": s,
                "read_bytes_per_step": 1, "write_bytes_per_step": 1}
    rows = [row("offload", "none", 0.30), row("offload", "none", 0.40),
            row("offload-int8", "none", 0.20),
            {**row("offload-int8", "nvme-opt", 0.35), "cpu_floor_s": 0.32},
            row("offload-int8", "nvme", 0.60), row("offload", "nvme", 0.90),
            row("deepspeed", "none", 0.60), row("deepspeed", "nvme-opt", 2.0)]
    practicality(rows)
    got = {(r["system"], r["placement"]): r.get("practicality") for r in rows}
    assert got[("offload-int8", "nvme-opt")] == pytest.approx(0.30 / 0.35)
    assert got[("offload-int8", "nvme")] == pytest.approx(0.5)
    assert got[("deepspeed", "nvme-opt")] == pytest.approx(0.3)
    assert got[("offload", "none")] is None
    limits = {(r["system"], r["placement"]): r.get("practicality_cpu_limit") for r in rows}
    assert limits[("offload-int8", "nvme-opt")] == pytest.approx(0.30 / 0.32)
    assert limits[("offload-int8", "nvme")] is None  # no CPU floor in that row
    checks = {t["target"].split(" practicality")[0]: t["met"]
              for t in compressed_targets({(r["system"], r["placement"]): r for r in rows})
              if "practicality" in t["target"]}
    assert checks == {"offload-int8 nvme-opt": True, "offload-int8 nvme": False}


def test_the_mixed_probe_of_a_file_of_an_odd_count_of_pages(tmp_path):
    """A probe size that is an odd multiple of 4 KiB (a quarter of some disk's free
    space) once put the writes' half of the file at an offset O_DIRECT refuses."""
    from offload.cli.benchutil import DiskProbe
    from offload.config import IoConfig

    probe = DiskProbe(IoConfig(paths=[str(tmp_path)]), str(tmp_path), 8 * 2**20 + 4096)
    try:
        probe.measure()
        assert probe.measure_mixed(2**20, 2, seconds=0.05) > 0
    finally:
        probe.close()


def test_forced_reads_follow_a_steady_cycle_of_several_steps():
    """Orders whose cheapest loop alternates two memory states between steps (reads
    of 4 then 2; a group used in the forward only): the figure is the loop's mean,
    not the second step's from empty memory (4 and 2, above the fewest possible)."""
    from offload.cli.benchutil import forced_param_reads

    assert forced_param_reads([0, 0, 2, 3, 0], {0: 3, 2: 2, 3: 2}, 5) == 3
    assert forced_param_reads([0, 1, 2, 0], {0: 1, 1: 3, 2: 3}, 6) <= 1.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12),
       st.lists(st.integers(1, 5), min_size=5, max_size=5), st.integers(0, 10))
def test_forced_reads_never_exceed_a_real_plans(order, pages, spare):
    """The forced reads are a lower bound: no more than the reads of the planner's
    plan of whole records over the same uses and memory (the mean of the steps after
    the first, over as many steps)."""
    from offload.cli.benchutil import STEADY_STEPS, forced_param_reads
    from offload.planner import RecordSpec, Use, make_plan

    sizes = {k: 4096 * pages[k] for k in set(order)}
    memory = 4096 * (max(pages[k] for k in sizes) + spare)
    uses = [Use((k,)) for k in order * STEADY_STEPS]
    plan = make_plan(uses, {k: RecordSpec(n) for k, n in sizes.items()}, memory)
    planned = sum(op.nbytes for op in plan.ops if op.op == "fetch" and op.needed_at >= len(order))
    assert forced_param_reads(order, sizes, memory) <= planned / (STEADY_STEPS - 1)
