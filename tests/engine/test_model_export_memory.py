"""`save_pretrained` of a model on NVMe whose weights are larger than the host budget
streams it: peak RSS of the exporting process stays within the budgets + 0.5 GiB."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

LAYERS, WIDTH = 64, 2048  # 64 x 16 MiB fp32 = 1 GiB of weights

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import offload

    layers, width, swap, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme",
                      "group_size": width * width},
           "io": {"paths": [swap], "buffer_budget": "32MiB", "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}

    def build():
        m = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
        return m.requires_grad_(False)

    engine = offload.initialize(build, cfg)  # built on meta: never whole in memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS (VmHWM) starts again from the current RSS
    files = engine.save_pretrained(out, max_shard_size="200MB")
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    peak = int(status["VmHWM"].split()[0]) * 1024
    budgets = sum(int(v) for v in (engine.cfg.store.host_budget, engine.cfg.store.device_budget,
                                   engine.cfg.io.buffer_budget))
    first = engine.module[0].weight.shape
    engine.close()
    print(json.dumps({"peak": peak, "budgets": budgets, "files": len(files),
                      "shape": list(first)}))
""")


def test_export_of_a_model_larger_than_the_host_budget_streams(tmp_path):
    res = subprocess.run([sys.executable, "-c", CHILD, str(LAYERS), str(WIDTH),
                          str(tmp_path / "swap"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    weights = LAYERS * WIDTH * WIDTH * 4
    assert weights > 4 * got["budgets"]
    print(f"export peak RSS {got['peak'] / 2**20:.0f} MiB, budgets "
          f"{got['budgets'] / 2**20:.0f} MiB, weights {weights / 2**20:.0f} MiB")
    assert got["peak"] <= got["budgets"] + 2**29, (got, weights)
    from safetensors import safe_open
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == LAYERS and index["metadata"]["total_size"] == weights
    name = "63.weight"
    with safe_open(str(tmp_path / "out" / index["weight_map"][name]), framework="pt") as f:
        assert tuple(f.get_tensor(name).shape) == (WIDTH, WIDTH)
