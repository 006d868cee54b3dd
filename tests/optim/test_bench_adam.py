"""`offload bench adam` on a tiny partition: the JSON it prints has the promised shape."""

import argparse
import json

from offload.cli import bench_adam


def test_bench_adam_json(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_adam.add_arguments(p)
    args = p.parse_args(["--elements", "200K", "--rounds", "1", "--json", "--nvme",
                         str(tmp_path), "--chunk-elems", "65536", "--buffer-budget", "16MiB",
                         "--state-dtype", "int8"])
    assert bench_adam.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    impls = {r["impl"]: r for r in out["results"]}
    assert {"offload", "torch AdamW fused", "torch AdamW foreach", "torch._fused_adamw_",
            "memory-stream reference", "offload int8 moments, new master apart"} <= set(impls)
    assert all(r["Gelem_per_s"] > 0 for r in out["results"])
    assert "DeepSpeedCPUAdam" in impls or any("DeepSpeed" in n for n in out["notes"])
    nv = out["nvme"]
    assert nv["step_s"] > 0 and nv["disk_read_GBps"] > 0 and nv["bound_s"] > 0
    # its bound's compute term: the in-memory update of its own moments' form (it was the
    # fp32 row's whatever --state-dtype)
    assert nv["memory_update_s"] == impls["offload int8 moments"]["seconds"]
    assert list(tmp_path.iterdir()) == []  # its files are gone


def test_bench_adam_convergence_json(tmp_path, capsys, monkeypatch):
    """`--convergence`: one row per (model, seed, form), ratios against the fp32 run of
    the same seed, one target per (model, compressed form); no files left behind."""
    monkeypatch.chdir(tmp_path)
    p = argparse.ArgumentParser()
    bench_adam.add_arguments(p)
    args = p.parse_args(["--convergence", "--steps", "21", "--seeds", "1", "--json"])
    assert bench_adam.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["model"], r["state_dtype"]): r for r in out["rows"]}
    assert {sd for _, sd in rows} == {"fp32", "bf16", "int8"} and len(rows) == 6
    for (model, sd), r in rows.items():
        assert r["vs_fp32"] == r["final_loss"] / rows[(model, "fp32")]["final_loss"]
    assert len(out["targets"]) == 4
    assert list(tmp_path.iterdir()) == []
