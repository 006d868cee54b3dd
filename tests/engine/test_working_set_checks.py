"""The checks initialize makes before anything is written: host parameters counted up to
store.host_budget, and gradients stored for accumulation on the NVMe budget (the swap
directory's free space: tests/engine/test_input.py)."""

import re

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, load_config
from offload.engine import working_set as ws
from offload.engine.units import build_units
from offload.store import footprint


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def _cfg(engine_cfg, *placement, **store):
    """The suite's config with one unit per layer, no clipping, and `store` keys."""
    cfg = engine_cfg(*placement, group_size=64 * 65)
    cfg["optim"]["max_grad_norm"] = 0.0
    cfg["store"].update(store)
    return cfg


def test_the_memory_check_counts_host_parameters_only_up_to_the_host_budget(
        engine_cfg, monkeypatch):
    """engine.params = "host" keeps at most store.host_budget of parameters in memory (the
    store writes the rest to NVMe): a machine with room for that much, but not for the
    whole model, is not refused."""
    _, groups = build_units(_model(), 64 * 65, 1)
    params = sum(footprint(g.shard * 4) for g in groups)
    budget = params // 3
    cfg = load_config(_cfg(engine_cfg, "host", "host", "nvme", host_budget=budget,
                           device_budget="64MiB"))
    placed = ws.memory_bytes_placed(cfg, groups, torch.float32, "cpu")
    assert placed == {'engine.params = "host" (up to store.host_budget)': budget}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(ws, "available_memory", lambda: budget + budget // 2)
    ws.check_memory(cfg, groups, torch.float32)  # room for the budget, not for every layer
    monkeypatch.setattr(ws, "available_memory", lambda: budget - 1)
    with pytest.raises(ConfigError, match=r"engine\.params"):
        ws.check_memory(cfg, groups, torch.float32)


def _train(engine, steps=2, accum=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(accum):
            x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
            engine.backward(nn.functional.mse_loss(engine(x), y))
        assert engine.step()
    return engine.state_dict()


def test_accumulation_with_the_optimizer_on_nvme_counts_the_stored_gradients(engine_cfg):
    """With engine.grad_accum_steps > 1 the gradients are stored between micro-batches
    even where the optimizer state is on NVMe without clipping (no early update): the
    NVMe budget named at initialize counts the gradients homed there, and that least
    trains two steps."""
    cfg = _cfg(engine_cfg, "nvme", "nvme", "nvme")
    cfg["engine"]["grad_accum_steps"] = 2
    cfg["store"]["nvme_budget"] = 1
    with pytest.raises(ConfigError, match=r"store\.nvme_budget") as err:
        offload.initialize(_model(), cfg)
    need = int(re.search(r"at least (\d+) bytes", str(err.value)).group(1))
    _, groups = build_units(_model(), 64 * 65, 1)
    grads = sum(footprint(g.shard * 4) for g in groups)
    cfg["engine"]["grad_accum_steps"] = 1  # early updates: no gradient is stored
    with pytest.raises(ConfigError, match=r"store\.nvme_budget") as err:
        offload.initialize(_model(), cfg)
    assert need == int(re.search(r"at least (\d+) bytes", str(err.value)).group(1)) + grads
    cfg["engine"]["grad_accum_steps"] = 2
    cfg["store"]["nvme_budget"] = need
    with offload.initialize(_model(), cfg) as engine:
        _train(engine)
