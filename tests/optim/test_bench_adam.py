"""`offload bench adam` on a tiny partition: the JSON it prints has the promised shape."""

import argparse
import json

from offload.cli import bench_adam


def test_bench_adam_json(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_adam.add_arguments(p)
    args = p.parse_args(["--elements", "200K", "--rounds", "1", "--json", "--nvme",
                         str(tmp_path), "--chunk-elems", "65536", "--buffer-budget", "16MiB"])
    assert bench_adam.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    impls = {r["impl"]: r for r in out["results"]}
    assert {"offload", "torch AdamW fused", "torch AdamW foreach", "torch._fused_adamw_",
            "memory-bandwidth bound"} <= set(impls)
    assert all(r["Gelem_per_s"] > 0 for r in out["results"])
    assert "DeepSpeedCPUAdam" in impls or any("DeepSpeed" in n for n in out["notes"])
    nv = out["nvme"]
    assert nv["step_s"] > 0 and nv["disk_read_GBps"] > 0 and nv["bound_s"] > 0
    assert list(tmp_path.iterdir()) == []  # its files are gone
