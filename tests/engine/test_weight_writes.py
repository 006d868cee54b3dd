"""[Note: weights written in a forward] in offload/engine/weight_writes.py: a forward
that rewrites its own weights in place (an embedding's max_norm, a clamp_ under
no_grad) is refused naming the unit, its weights and the fix, on one rank as on
several, where the change was lost silently (two ranks) or refused in torch's words."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload

from .test_failed_step import assert_same, snapshot


class RenormEmbedding(nn.Module):
    """F.embedding with max_norm, which initialize's check of nn.Embedding cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(20, 8) * 2)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(x, self.w, max_norm=1.0).mean(1))


class Clamped(nn.Module):
    """A forward that clamps its own weight under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 1, generator=g)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_a_forward_that_renormalises_its_weight_is_refused_naming_it(engine_cfg, grad):
    """With autograd on torch refused the write in its own words (a view of a `split`
    modified in place), naming neither the weight nor max_norm; under no_grad one
    rank kept the change and two lost it. Both are refused now, naming the weight
    and the fix, and the engine trains on without the max_norm."""
    x, y = _batch()
    model = RenormEmbedding()
    with offload.initialize(model, engine_cfg("host", "host", "host")) as engine:
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as e:
            F.mse_loss(engine(x), y)
        assert "changed a weight in place (one of 'w'" in str(e.value)
        assert "max_norm=None" in str(e.value)
        model.forward = lambda x: model.head(F.embedding(x, model.w).mean(1))
        engine.backward(F.mse_loss(engine(x), y))
        assert engine.step() is True


def test_a_clamp_under_no_grad_in_forward_is_refused(engine_cfg):
    x = torch.randn(4, 8)
    with offload.initialize(Clamped(), engine_cfg("nvme", "host", "host")) as engine:
        with torch.no_grad(), pytest.raises(RuntimeError, match="changed a weight in place "
                                                                "\\(one of 'lin.weight'"):
            engine(x)


def test_a_max_norm_set_after_initialize_is_refused_before_anything_changes(engine_cfg):
    """initialize refuses an nn.Embedding with max_norm; one set afterwards is refused at
    the unit's forward, before its weights are gathered: nothing has changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(40, 1))
    x, y = _batch()
    with offload.initialize(model, engine_cfg("host", "host", "host")) as engine:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        before = snapshot(engine)
        model[0].max_norm = 1.0
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(
                    RuntimeError, match="0 is an Embedding whose max_norm was set to 1.0"):
                engine(x)
        assert_same(before, snapshot(engine))
        model[0].max_norm = None
        engine.backward(F.mse_loss(engine(x), y))
        assert engine.step() is True


def test_a_write_into_the_stored_weights_is_not_undone_by_a_later_read(engine_cfg):
    """One rank, fp32: the gathered buffer is the stored partition, so the refused
    forward's clamp is in the stored weights (as torch keeps it). Their clean NVMe
    copy was kept beside it: an eviction dropped the changed copy and the next read
    brought the old weights back. The changed copy is now the only one."""
    from offload.store import Tier
    x = torch.randn(4, 8)
    with offload.initialize(Clamped(), engine_cfg("nvme", "host", "host")) as engine:
        key = ("p", engine.groups[0].gid)
        engine.store.fetch(key, to=Tier.DEVICE).wait()
        assert Tier.NVME in engine.store.info(key).valid
        with torch.no_grad(), pytest.raises(RuntimeError, match="changed a weight"):
            engine(x)
        assert engine.store.info(key).valid == {Tier.DEVICE}
        engine.store.evict(key, Tier.NVME).wait()
        w = engine.state_dict()["lin.weight"]
        assert w.abs().max() <= 0.1 and w.abs().max() > 0
