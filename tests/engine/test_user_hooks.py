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


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).sum(1)


def _grad_hooks(model: nn.Module, calls: list, when: str) -> None:
    """Before initialize: a mask training only the embedding's rows 8-15 (new tokens);
    after: a scale on the head's weight, and one hook removed at once."""
    if when == "before":
        mask = torch.zeros(16, 1)
        mask[8:] = 1
        model.emb.weight.register_hook(lambda g: calls.append("emb") or g * mask)
    else:
        model.head.weight.register_hook(lambda g: calls.append("head") or g * 0.25)
        model.head.bias.register_hook(lambda g: calls.append("removed")).remove()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_gradient_hooks_on_parameters_run_as_in_torch(engine_cfg, placement):
    """[Note: gradient hooks on parameters] `p.register_hook` on a parameter, before or
    after initialize, was kept on the stand-in and never ran: the embedding's masked
    rows trained. It runs on the gradient of each use, and the weights are torch's."""
    torch.manual_seed(0)
    ref = _Tokens()
    model = copy.deepcopy(ref)
    calls, calls_ref = [], []
    _grad_hooks(model, calls, "before")
    _grad_hooks(ref, calls_ref, "before")
    _grad_hooks(ref, calls_ref, "after")
    before = ref.emb.weight.detach().clone()
    cfg = engine_cfg(*placement, group_size=100)
    cfg["optim"]["weight_decay"] = 0.0
    engine = offload.initialize(model, cfg)
    _grad_hooks(engine.module, calls, "after")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            ids = torch.randint(0, 16, (4, 6), generator=g)
            engine.backward(engine(ids).pow(2).mean())
            engine.step()
            opt.zero_grad()
            ref(ids).pow(2).mean().backward()
            opt.step()
        assert sorted(calls) == sorted(calls_ref) == ["emb"] * 3 + ["head"] * 3
        assert_weights_as_torch(engine, ref, atol=2e-6)
        with engine.full_weights() as w:
            assert torch.equal(w["emb.weight"][:8], before[:8])  # the masked rows
    finally:
        engine.close()


def test_a_post_accumulate_grad_hook_is_refused_naming_the_parameter(engine_cfg):
    """`register_post_accumulate_grad_hook` would never run (the gradients accumulate in
    the engine's partitions): refused before initialize makes anything, and after."""
    model = _Tokens()
    handle = model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(offload.ConfigError, match=r"post-accumulate-grad hook on "
                                                  r"parameter 'head.weight' would never run"):
        offload.initialize(model, engine_cfg("host", group_size=100))
    handle.remove()
    with offload.initialize(model, engine_cfg("host", group_size=100)) as engine:
        with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' would never run"):
            engine.module.emb.weight.register_post_accumulate_grad_hook(lambda p: None)
        engine.backward(engine(torch.tensor([[1, 2]])).sum())
        assert engine.step()
