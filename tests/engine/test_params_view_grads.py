"""The parameters the user sees after a backward, as torch shows them: which have a
.grad, a .grad dropped from one of two, and the buffers state_dict holds."""

import copy

import pytest
import torch
from torch import nn

import offload


def test_after_a_backward_only_what_had_a_gradient_shows_a_grad(engine_cfg):
    """[Note: absent gradients]: as in torch, a frozen parameter and one no forward used
    have `.grad` None after the backward; the others show one (not None)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"frozen": nn.Linear(8, 8), "used": nn.Linear(8, 8),
                           "unused": nn.Linear(8, 8)})
    model["frozen"].requires_grad_(False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["used"](self.m["frozen"](x))
    net = Net()
    ref = copy.deepcopy(net)
    ref(torch.randn(2, 8)).sum().backward()
    want = {n: p.grad is not None for n, p in ref.named_parameters()}
    with offload.initialize(net, engine_cfg("host", group_size=100)) as engine:
        engine.backward(engine(torch.randn(2, 8)).sum())
        got = {n: p.grad is not None for n, p in net.named_parameters()}
        assert got == want, got
        assert engine.step()


def test_dropping_one_of_two_grads_is_refused(engine_cfg):
    """[Note: a .grad the program dropped]: a model of two parameters, one `.grad` set to
    None and the other kept, is refused (the engine cannot take one parameter's gradient
    out), not taken for a drop of the whole step."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    with offload.initialize(lin, engine_cfg("host")) as engine:
        engine.backward(engine(torch.randn(3, 4)).square().mean())
        before = engine.state_dict()
        lin.bias.grad = None
        with pytest.raises(RuntimeError, match=r"\.grad of parameter 'bias' was set to None "
                                               r"after the backward while 1 other"):
            engine.step()
        after = engine.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k


class _WithCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.lin(x) + self.table


def test_state_dict_leaves_out_non_persistent_buffers_as_torch(engine_cfg):
    """A buffer registered with persistent=False (rotary tables, causal masks) is not in
    torch's state_dict, nor in the engine's, and torch's dict loads strictly."""
    torch.manual_seed(0)
    model = _WithCache()
    want = copy.deepcopy(model).state_dict()
    with offload.initialize(model, engine_cfg("host")) as engine:
        got = engine.state_dict()
        assert list(got) == list(want)
        engine.load_state_dict(want)  # strict
