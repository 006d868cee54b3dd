"""How a model is cut into units and partitions: padding to the alignment only, the
place of each element in the whole model, a module of exactly group_size parameters,
and outputs the unit hooks must walk."""

import torch
from torch import nn

from offload.engine.units import SHARD_ALIGN, build_units


def test_a_partition_is_the_least_multiple_of_the_alignment_that_holds_the_share():
    """Each rank's partition is the rank's share rounded up to SHARD_ALIGN elements, no
    more: a group of exactly SHARD_ALIGN elements is not padded at all (padding is memory
    and disk in every tier, and what the budgets and the working set count)."""
    exact = nn.Linear(SHARD_ALIGN - 1, 1)  # 2047 weights + 1 bias
    over = nn.Linear(SHARD_ALIGN, 1)  # one element past
    _, groups = build_units(nn.Sequential(exact, over), SHARD_ALIGN + 1, 1)
    assert [(g.numel, g.shard) for g in groups] == [(SHARD_ALIGN, SHARD_ALIGN),
                                                    (SHARD_ALIGN + 1, 2 * SHARD_ALIGN)]
    _, groups = build_units(nn.Sequential(exact), SHARD_ALIGN, 2)  # two ranks: 1024 each
    assert groups[0].shard == SHARD_ALIGN and groups[0].padded == 2 * SHARD_ALIGN
    _, groups = build_units(nn.Sequential(nn.Linear(4 * SHARD_ALIGN - 1, 1)), 10**6, 4)
    assert groups[0].shard == SHARD_ALIGN and groups[0].split_sizes == [4 * SHARD_ALIGN - 1, 1]


class _Twins(nn.Module):
    """Two layers with the same weights and the same gradient, in two groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.load_state_dict(self.a.state_dict())

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_bf16_moments_round_by_each_elements_place_in_the_whole_model(engine_cfg):
    """[Note: stochastic rounding]: an element's rounding depends on its place in the
    model's weights (`Group.base`), not only in its group: two groups holding the same
    values and gradients round their bf16 moments apart, so the same rounding is not
    repeated in every layer."""
    import offload

    cfg = engine_cfg("host", "host", "host", group_size=64 * 65)
    cfg["optim"]["state_dtype"] = "bf16"
    with offload.initialize(_Twins(), cfg) as engine:
        assert len(engine.groups) == 2 and engine.groups[1].base == engine.groups[0].numel
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            engine.backward(engine(torch.randn(8, 64, generator=g)).square().mean())
            assert engine.step()
        w = engine.state_dict()
    assert not torch.equal(w["a.weight"], w["b.weight"])


def test_a_module_of_exactly_group_size_parameters_is_one_unit():
    """A module whose subtree holds at most `group_size` parameters is one unit: exactly
    that many keeps it whole."""
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 1))
    units, groups = build_units(model, 2 * 72, 1)
    assert [u.name for u in units] == ["0", "1"]
    assert [len(g.slots) for g in groups] == [4, 2]


def test_a_unit_returning_a_slotted_dataclass_trains_as_torch(engine_cfg):
    """A unit's output may be a dataclass with __slots__ (no __dict__): its tensors are
    found, so the unit's backward gathers its weights again, and the numbers are torch's."""
    import copy
    from dataclasses import dataclass

    import offload

    @dataclass(slots=True)
    class Out:
        h: torch.Tensor

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return Out(torch.tanh(self.lin(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            for b in self.blocks:
                x = b(x).h
            return self.out(x)
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-8)
    x = torch.randn(4, 16)
    with offload.initialize(model, engine_cfg("device", "host", "host", group_size=300)) as e:
        assert len(e.units) >= 3
        for _ in range(2):
            e.backward(e(x).pow(2).sum())
            e.step()
            opt.zero_grad()
            ref(x).pow(2).sum().backward()
            opt.step()
        got = e.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6, msg=name)
