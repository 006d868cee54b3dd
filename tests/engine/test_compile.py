"""torch.compile over an engine's model ([Note: torch.compile] in engine/units.py):
compiled before or after `initialize`, it trains to torch's numbers; the units' hooks
run eagerly, between the compiled graphs."""

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import offload

from .models import assert_weights_as_torch


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])


class _Counting:
    """A torch.compile backend that runs each graph as traced (aot_eager would
    decompose it), counting the graphs."""

    def __init__(self) -> None:
        self.graphs = 0
        torch._dynamo.reset()  # a frame skipped in an earlier test stays skipped

    def __call__(self, gm: torch.fx.GraphModule, inputs) -> object:
        self.graphs += 1
        return gm.forward


def _train_both(engine, call, ref, steps=3):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 32, generator=g)
        out = call(x)
        torch.testing.assert_close(out, ref(x), atol=1e-6, rtol=0)
        engine.backward(out.pow(2).mean())
        engine.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("group_size", [1100, pytest.param(10**6, marks=pytest.mark.slow)],
                         ids=["unit-per-layer", "one-unit"])
def test_compiled_engine_trains_as_torch(engine_cfg, group_size, caplog):
    ref = _stack()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg("nvme", "host", "nvme",
                                                               group_size=group_size))
    backend = _Counting()
    compiled = torch.compile(engine, backend=backend)
    try:
        with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            _train_both(engine, compiled, ref)
        if group_size > 1100:  # the model's forward between its one unit's hooks
            assert backend.graphs >= 1
        assert_weights_as_torch(engine, ref, atol=1e-6)
        # the engine's own frames are not compiled: no graph broken at os.getpid, no
        # hook wrapper compiled once per hook up to the recompile limit
        assert not [w for w in warned if "getpid" in str(w.message)], warned
        assert "recompile_limit" not in caplog.text, caplog.text
    finally:
        engine.close()


def test_model_compiled_before_initialize_trains_as_torch(engine_cfg):
    ref = _stack()
    backend = _Counting()
    engine = offload.initialize(torch.compile(copy.deepcopy(ref), backend=backend),
                                engine_cfg("host", "host", "host", group_size=10**6))
    try:
        _train_both(engine, engine, ref)
        assert backend.graphs >= 1
        want = {f"_orig_mod.{k}": v for k, v in ref.state_dict().items()}  # as torch names them
        got = engine.state_dict()
        assert list(got) == list(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)
    finally:
        engine.close()
