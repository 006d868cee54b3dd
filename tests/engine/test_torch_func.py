"""torch.func with the engine's model: `functional_call` computed with the engine's own
weights and ignored the caller's (its gradients None), without a word; the transforms
(grad, vmap, jacrev) failed inside the engine's gather. Both are refused, naming the
parameter or the unit and what to use, and the engine trains on as torch does."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import offload


def _pair(engine_cfg, place):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    model = copy.deepcopy(ref)
    cfg = engine_cfg(*place, group_size=600)
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg["optim"]["lr"],
                            weight_decay=cfg["optim"]["weight_decay"])
    return ref, opt, model, offload.initialize(model, cfg)


@pytest.mark.parametrize("place", [("host", "host", "host"), ("nvme", "nvme", "nvme")],
                         ids=["host", "nvme"])
def test_torch_func_is_refused_and_training_goes_on_as_torch(engine_cfg, place):
    ref, opt, model, engine = _pair(engine_cfg, place)
    x = torch.randn(4, 16)
    whole = {k: torch.zeros_like(v) for k, v in ref.named_parameters()}
    head = {"2.weight": torch.zeros(1, 32), "2.bias": torch.full((1,), 5.0)}
    with engine:
        for given, name in ((whole, "0.weight"), (head, "2.weight")):
            with pytest.raises(RuntimeError, match=name + " holds another tensor than the "
                               "parameter the engine registered"):
                functional_call(model, given, (x,))
            assert model[2].bias.shape == (1,)  # functional_call put the stand-ins back
        for transform in (lambda: grad(lambda t: engine(t).sum())(x),
                          lambda: vmap(engine)(x.unsqueeze(1)),
                          lambda: jacrev(engine)(x)):
            with pytest.raises(RuntimeError, match="ran under a torch.func transform"):
                transform()
        for _ in range(2):
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
            engine.backward(engine(x).square().mean())
            assert engine.step()
        got = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)


def test_a_parameter_assigned_after_initialize_is_refused_at_its_next_forward(engine_cfg):
    """Training would not see it; the forward computed with the engine's weights."""
    _, _, model, engine = _pair(engine_cfg, ("host", "host", "host"))
    with engine:
        model[2].weight = nn.Parameter(torch.zeros(1, 32))
        with pytest.raises(RuntimeError, match="2.weight holds another tensor"):
            engine(torch.randn(4, 16))
