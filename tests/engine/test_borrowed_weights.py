"""One rank on a CPU device: a gathered group's weights are its pinned DEVICE record's
memory, not a copy ([Note: gathered weights borrow the record] in engine/warm.py)."""

import torch
from torch import nn

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
    cfg = engine_cfg("nvme", optimizer="nvme")
    engine = offload.initialize(TiedTwice(), cfg)
    seen = {"forward": [], "backward": []}

    lin = engine.module.l1

    def look(kind, weight):
        # (a view of the group's storage: its pointer is the storage's now)
        seen[kind].append(_inside(weight.data_ptr(), _record_spans(engine)))

    def forward(module, args):
        w = module.weight
        look("forward", w)
        # the weight's gradient is made inside l1's backward, while it is gathered again
        w.register_hook(lambda grad: look("backward", w))
    lin.register_forward_pre_hook(forward)
    try:
        for x, y in lm_batches(3, seed=1):
            logits = engine(x)
            engine.backward(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
            engine.step()
        assert seen["forward"] and all(seen["forward"]), seen
        assert seen["backward"] and all(seen["backward"]), seen
        # every pin was given back: each record can leave DEVICE again
        for g in engine.groups:
            engine.store.evict(("p", g.gid))
    finally:
        engine.close()


def test_a_device_budget_without_room_for_the_pins_copies_instead(engine_cfg):
    """Where the device budget holds little more than the minimum working set, pinned
    records could leave no room to make: the engine copies as before, and trains."""
    cfg = engine_cfg("nvme", optimizer="nvme")
    probe = offload.initialize(TiedTwice(), cfg)
    need = working_set(load_config(cfg), probe.groups, torch.float32).device
    largest = max(sum(footprint(probe.groups[g].shard * 4) for g in u.needs)
                  for u in probe.units)
    probe.close()
    cfg["store"]["device_budget"] = need + 2 * largest  # room for 2 pinned units, not 3
    engine = offload.initialize(TiedTwice(), cfg)
    try:
        assert not engine._borrow
        losses = []
        for x, y in lm_batches(4, seed=2):
            loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        engine.close()
