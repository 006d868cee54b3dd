"""The bytes the tuner's modelled step moves for gradients homed on NVMe against a real
step's, as tune's real steps measure it (`tune_verify.measure_config`, each step its
engine.grad_accum_steps micro-batches): the engine writes each stored gradient down once its
backward has summed it, reads it back to sum each later micro-batch into it, for the
norm (clipping) and for its update, whatever the memory budgets."""

from __future__ import annotations

import pytest

from offload.cli.model_arg import ModelSpec
from offload.cli.tune_verify import measure_config
from offload.planner.estimate import Placement
from offload.planner.search import UnitUse, modelled_step, plan_step

N = 256 * 257  # one Linear(256, 256) a group


@pytest.mark.parametrize("clip,accum,optimizer", [
    (1.0, 1, "host"), (0.0, 2, "host"), (1.0, 3, "host"), (0.0, 2, "nvme"), (1.0, 1, "nvme")])
def test_modelled_gradient_traffic_is_a_real_steps(tmp_path, monkeypatch, clip, accum,
                                                   optimizer):
    (tmp_path / "tunemodelio.py").write_text(
        "from torch import nn\n\n\ndef mlp():\n"
        "    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {"engine": {"params": "host", "grads": "nvme", "optimizer": optimizer,
                      "dtype": "fp32", "group_size": N, "grad_accum_steps": accum},
           "optim": {"max_grad_norm": clip},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "8MiB", "block_size": "64KiB",
                  "grow_step": "1MiB"},
           "store": {"device": "cpu", "device_budget": "64MiB", "host_budget": "64MiB"}}
    m = measure_config(ModelSpec("function", "tunemodelio:mlp", 8, None, "fp32"), cfg,
                       steps=1, warmup=1)  # the swap file grown, the trace recorded first
    real = (m["read_bytes_per_step"], m["write_bytes_per_step"])
    micro = [UnitUse("forward", (i,), 0.0) for i in range(6)]
    micro += [UnitUse("backward", (i,), 0.0) for i in reversed(range(6))]
    step = modelled_step(micro * accum, [(N, True)] * 6, "fp32",
                         Placement("host", "nvme", optimizer),
                         1 << 16 if optimizer == "nvme" else 0, 1e9, master=False,
                         clipping=clip > 0, accum=accum)
    plan = plan_step(step, (64 << 20, 64 << 20), 2, 4)
    assert plan.bytes_read == pytest.approx(real[0], rel=0.03), (plan.bytes_read, real)
    assert plan.bytes_written == pytest.approx(real[1], rel=0.03), (plan.bytes_written, real)
