"""`engine.state_dict()` and `load_state_dict()` take torch's walk of the model: extra
states (`get_extra_state` / `set_extra_state`), state-dict hooks, and torch's
arguments (`prefix`, `destination`, `keep_vars`, positional ones too)."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

import offload


class WithExtra(nn.Linear):
    """A layer that keeps extra state beside its weights (a format version, say)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.extra = {"version": 3}

    def get_extra_state(self) -> dict:
        return dict(self.extra)

    def set_extra_state(self, state: dict) -> None:
        self.extra = dict(state)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = WithExtra()
        self.b = nn.Linear(4, 2)
        self.b.register_state_dict_post_hook(
            lambda m, sd, prefix, meta: sd.__setitem__(prefix + "hooked", torch.tensor(1.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@pytest.fixture
def pair(engine_cfg):
    torch.manual_seed(0)
    ref = Hooked()
    model = Hooked()
    model.load_state_dict(ref.state_dict(), strict=False)
    with offload.initialize(model, engine_cfg("nvme", "host", "nvme", group_size=20)) as e:
        yield e, ref


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_state_dict_holds_extra_states_and_hooks_entries_as_torch(pair):
    """The extra state and the hook's entry were left out (and load_state_dict of
    torch's own dict refused `a._extra_state` as unexpected)."""
    engine, ref = pair
    got = engine.state_dict()
    _same(got, ref.state_dict())
    assert got["a._extra_state"] == {"version": 3}
    assert got._metadata == ref.state_dict()._metadata


def test_state_dict_takes_torchs_arguments(pair):
    """prefix and destination were dropped silently (keys without the prefix, the
    destination left empty)."""
    engine, ref = pair
    _same(engine.state_dict(prefix="model."), ref.state_dict(prefix="model."))
    dest = OrderedDict(kept=1)
    assert engine.state_dict(destination=dest, prefix="m.") is dest
    _same(dest, OrderedDict(kept=1, **ref.state_dict(prefix="m.")))
    _same(engine.state_dict(None, "p."), ref.state_dict(prefix="p."))  # torch's old form
    assert not engine.state_dict(keep_vars=True)["a.weight"].requires_grad


def test_load_state_dict_sets_extra_states_as_torch(pair):
    """torch's dict loads (its hook's entry is unexpected, as torch's own load says);
    each module's set_extra_state gets its entry; a missing one is a missing key."""
    engine, ref = pair
    want = ref.state_dict()
    want["a._extra_state"] = {"version": 4}
    want["a.weight"] = want["a.weight"] + 1
    with pytest.raises(RuntimeError, match=r"unexpected keys \['b.hooked'\]"):
        engine.load_state_dict(want)
    del want["b.hooked"]
    assert engine.load_state_dict(want) == ([], [])
    assert engine.module.a.extra == {"version": 4}
    torch.testing.assert_close(engine.state_dict()["a.weight"], want["a.weight"])
    del want["a._extra_state"]
    with pytest.raises(RuntimeError, match=r"missing keys \['a._extra_state'\]"):
        engine.load_state_dict(want)
    assert engine.load_state_dict(want, strict=False).missing_keys == ["a._extra_state"]
    assert engine.module.a.extra == {"version": 4}
