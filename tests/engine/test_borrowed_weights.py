"""One rank on a CPU device: a gathered group's weights are its pinned DEVICE record's
memory, not a copy ([Note: gathered weights borrow the record] in engine/warm.py)."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.config import load_config
from offload.engine.working_set import working_set
from offload.store import Tier, footprint

from .models import TiedTwice, lm_batches


def _record_spans(engine) -> list[tuple[int, int]]:
    """The memory of every parameter record with a valid DEVICE copy."""
    spans = []
    for g in engine.groups:
        try:
            view = engine.store.get(("p", g.gid), Tier.DEVICE)
        except RuntimeError:  # not in DEVICE now
            continue
        spans.append((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
    return spans


def _inside(ptr: int, spans) -> bool:
    return any(lo <= ptr < hi for lo, hi in spans)


def test_weights_in_forward_and_backward_are_the_records_memory(engine_cfg):
    """A stack of layers (one unit each, one or two gathered at a time): every use of a
    layer's weight, forward and backward, reads its record's memory."""
    cfg = engine_cfg("nvme", optimizer="nvme")
    engine = offload.initialize(_Stack("train"), cfg)
    seen = {"forward": [], "backward": []}
    lin = engine.module.layers[3].lin

    def look(kind, storage):
        # (the group's storage: its pointer is the memory it holds now)
        seen[kind].append(_inside(storage.data_ptr(), _record_spans(engine)))

    def forward(module, args):
        w = module.weight
        look("forward", w.untyped_storage())
        # the weight's gradient is made inside the layer's backward, while it is gathered;
        # the hook holds the storage, not `w`: a view kept past the unit would keep a
        # copy of the weights ([Note: kept weights] in the engine)
        storage = w.untyped_storage()
        w.register_hook(lambda grad: look("backward", storage))
    lin.register_forward_pre_hook(forward)
    try:
        for step in range(3):
            x = torch.randn(4, 48, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        assert len(seen["forward"]) == 3 and all(seen["forward"]), seen
        assert len(seen["backward"]) == 3 and all(seen["backward"]), seen
        # every pin was given back: each record can leave DEVICE again
        for g in engine.groups:
            engine.store.evict(("p", g.gid))
    finally:
        engine.close()


def _at_the_threshold(cfg, build, units: float = 1):
    """`cfg` with the device budget at the minimum working set plus `units` of the
    largest unit's partitions (1: the smallest at which the engine borrows, one unit's
    bytes at once; 3 or more: three units' bytes)."""
    probe = offload.initialize(build(), cfg)
    need = working_set(load_config(cfg), probe.groups, torch.float32).device
    largest = max(sum(footprint(probe.groups[g].shard * 4) for g in u.needs)
                  for u in probe.units)
    probe.close()
    cfg["store"]["device_budget"] = need + int(units * largest)
    return cfg


class _Layer(nn.Module):
    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class _Stack(nn.Module):
    """Eight layers after a trainable input layer: frozen, or each in a checkpoint that
    torch's recomputation stops early (the unit's post-hook never runs), so in backward
    many groups stay gathered at once."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(48, 48)
        self.layers = nn.ModuleList(_Layer() for _ in range(8))
        if how == "frozen":
            self.layers.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.how == "checkpoint" \
                else layer(h)
        return h


@pytest.mark.parametrize("units", [1, 2, 3])
@pytest.mark.parametrize("how", ["frozen", "checkpoint"])
def test_groups_gathered_beyond_the_allowance_are_copied(engine_cfg, how, units):
    """Borrowing stops at the units' bytes the device budget holds beyond the working
    set (at most three): the groups gathered beyond them are copies, so pinned records
    never take the room the working set needs."""
    cfg = _at_the_threshold(engine_cfg("nvme", optimizer="nvme"), lambda: _Stack(how), units)
    engine = offload.initialize(_Stack(how), cfg)
    try:
        assert engine._borrowing.room == units * max(
            sum(footprint(engine.groups[g].shard * 4) for g in u.needs) for u in engine.units)
        for step in range(2):
            x = torch.randn(4, 48, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        for g in engine.groups:  # every pin was given back
            engine.store.evict(("p", g.gid))
    finally:
        engine.close()


def test_a_device_budget_without_room_for_the_pins_copies_instead(engine_cfg):
    """Where the device budget holds less than one unit beyond the minimum working set,
    pinned records could leave no room to make: the engine copies, and trains."""
    cfg = _at_the_threshold(engine_cfg("nvme", optimizer="nvme"), TiedTwice, units=0.9)
    engine = offload.initialize(TiedTwice(), cfg)
    try:
        assert engine._borrowing.room == 0
        losses = []
        for x, y in lm_batches(4, seed=2):
            loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        engine.close()
