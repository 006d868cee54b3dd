"""Hooks a user registers on a unit's module after `initialize` see the unit's weights,
as they would in torch ([Note: our forward hooks run last] in engine/units.py)."""

import copy

import pytest
import torch
from torch import nn

import offload

from .models import assert_weights_as_torch
from .test_model_params import IDS, PLACEMENTS


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _hooks(model: nn.Module, seen: list) -> None:
    """On layer 1: a forward hook that reads the weight, one that changes the output with
    the bias (its gradient flows), and a pre-hook registered after them."""
    layer = model.layers[1]
    layer.register_forward_hook(lambda m, a, out: seen.append(m.weight.detach().clone()))
    layer.register_forward_hook(lambda m, a, out: out + 0.5 * m.bias)
    layer.register_forward_pre_hook(lambda m, a: (a[0] * m.weight[0, 0].detach(),))


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_forward_hooks_registered_after_initialize_read_the_weights(engine_cfg, placement):
    torch.manual_seed(0)
    ref = _Stack()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg(*placement, group_size=300))
    assert len(engine.units) >= 4  # layer 1 is a unit of its own
    seen, seen_ref = [], []
    _hooks(engine.module, seen)
    _hooks(ref, seen_ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randn(8, 16, generator=g)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            opt.zero_grad()
            ref(x).pow(2).mean().backward()
            opt.step()
        with torch.no_grad():
            torch.testing.assert_close(engine(x), ref(x), atol=2e-6, rtol=0)
        assert len(seen) == len(seen_ref) == 4
        for got, want in zip(seen, seen_ref):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        assert_weights_as_torch(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_a_forward_hook_on_a_model_that_is_one_unit(engine_cfg):
    """The root module is the only unit: the user's hook runs before the unit gives its
    weights back and before the engine's one-thread guard is left."""
    torch.manual_seed(0)
    ref = _Stack()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg("nvme", "nvme", "nvme",
                                                               group_size=10**6))
    assert len(engine.units) == 1 and engine.units[0].module is engine.module
    sums = []
    engine.module.register_forward_hook(lambda m, a, out: sums.append(
        float(m.layers[2].weight.sum())))
    try:
        x = torch.randn(8, 16)
        with torch.no_grad():
            torch.testing.assert_close(engine(x), ref(x), atol=1e-6, rtol=0)
        assert sums == [pytest.approx(float(ref.layers[2].weight.detach().sum()), abs=1e-5)]
    finally:
        engine.close()
