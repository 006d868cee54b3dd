"""A unit's output may be any structure holding tensors: the engine finds them to hook
the unit's backward (else the backward would run on its freed weights). Checked
against torch AdamW for each kind of output."""

import copy
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import nn

import offload


@dataclass
class AsDataclass:
    h: torch.Tensor


class AsNamedTuple(NamedTuple):
    h: torch.Tensor


class AsObject:
    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


WRAP = {"dataclass": AsDataclass, "namedtuple": AsNamedTuple, "object": AsObject,
        "dict": lambda h: {"h": h}}


class Block(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.lin, self.wrap = nn.Linear(16, 16), wrap

    def forward(self, x):
        return self.wrap(torch.tanh(self.lin(x)))


class Model(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(wrap) for _ in range(2))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            out = b(h)
            h = out["h"] if isinstance(out, dict) else out.h
        return self.out(h)


@pytest.mark.parametrize("kind", list(WRAP))
def test_units_returning_any_structure_train_as_torch(engine_cfg, kind):
    torch.manual_seed(0)
    model = Model(WRAP[kind])
    ref = copy.deepcopy(model)
    cfg = engine_cfg("device", "host", "host", group_size=300)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-8)
    x = torch.randn(4, 8)
    with offload.initialize(model, cfg) as engine:
        assert len(engine.units) > 2  # the blocks are units of their own
        for _ in range(2):
            engine.backward(engine(x).pow(2).sum())
            engine.step()
            opt.zero_grad()
            ref(x).pow(2).sum().backward()
            opt.step()
        got = engine.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6, msg=name)
