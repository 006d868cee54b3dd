"""The step's edges: fp16 loss scaling's floor and window, a forward that raises after
the window's last backward, no .grad shown after a step, optimizer state loaded after
zero_grad dropped early updates, a bad value refused before an in-place update, and
each group's full weights freed as its gradient is taken."""

import copy

import pytest
import torch

import offload

from .models import TiedTwice, assert_weights_as_torch, lm_batches, lm_loss
from .test_failed_step import assert_same, snapshot


def _ref_step(ref, opt, x, y):
    opt.zero_grad()
    lm_loss(ref(x), y).backward()
    opt.step()


def test_dynamic_loss_scale_never_drops_below_min_loss_scale(engine_cfg):
    """fp16 dynamic scaling halves the scale at each overflow, down to
    engine.min_loss_scale and no lower (GradScaler has no floor; DeepSpeed's
    min_loss_scale is one): three overflows from 4 with a floor of 2 leave 2, and
    every skipped step leaves the weights as they were."""
    torch.manual_seed(0)
    model = TiedTwice()
    cfg = engine_cfg("host", dtype="fp16", initial_loss_scale=4.0, min_loss_scale=2.0)
    with offload.initialize(model, cfg) as engine:
        before = engine.state_dict()
        x, y = lm_batches(1)[0]
        for want in (2.0, 2.0, 2.0):
            engine.backward(lm_loss(engine(x), y) * 1e6)  # fp16 gradients overflow
            assert engine.step() is False
            assert engine.loss_scale == want
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.backward(lm_loss(engine(x), y))  # a finite step commits at the floor
        assert engine.step() is True and engine.loss_scale == 2.0


@pytest.mark.parametrize("accum", [1, 2])
def test_a_forward_that_raises_after_the_windows_last_backward_keeps_its_gradients(
        engine_cfg, accum):
    """A forward under autograd that raises after the window's last backward (its
    gradients are whole) drops nothing: step() applies them, as torch would."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(accum)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt.zero_grad()
    for x, y in batches:
        (lm_loss(ref(x), y) / accum).backward()
    opt.step()
    bad = torch.full_like(batches[0][0], 10_000)  # a token outside the vocabulary
    with offload.initialize(model, engine_cfg("host", grad_accum_steps=accum)) as engine:
        for x, y in batches:
            engine.backward(lm_loss(engine(x), y))
        with pytest.raises(IndexError):
            engine(bad)
        assert engine.step() is True
        assert_weights_as_torch(engine, ref, atol=2e-6)


def test_step_leaves_no_grad_shown(engine_cfg):
    """After backward the trained parameters show a `.grad`; after the step that applied
    them every `.grad` is None again (the gradients are gone: nothing stale to read)."""
    torch.manual_seed(0)
    model = TiedTwice()
    with offload.initialize(model, engine_cfg("host")) as engine:
        x, y = lm_batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        assert any(p.grad is not None for p in model.parameters())
        assert engine.step() is True
        assert [n for n, p in model.named_parameters() if p.grad is not None] == []


def test_dynamic_loss_scale_counts_its_window_afresh_after_an_overflow(engine_cfg):
    """fp16 dynamic scaling as GradScaler (growth_interval = engine.loss_scale_window):
    an overflow halves the scale and restarts the count of good steps, so with a
    window of 2 a good step, an overflow and one good step leave the halved scale;
    a second good step doubles it back."""
    torch.manual_seed(0)
    model = TiedTwice()
    cfg = engine_cfg("host", dtype="fp16", initial_loss_scale=256.0, loss_scale_window=2)
    (x, y), = lm_batches(1)
    with offload.initialize(model, cfg) as engine:
        scales = []
        for blow_up in (False, True, False, False):
            loss = lm_loss(engine(x), y)
            engine.backward(loss * 1e6 if blow_up else loss)
            assert engine.step() is (not blow_up)
            scales.append(engine.loss_scale)
    assert scales == [256.0, 128.0, 128.0, 256.0]


def test_optimizer_state_loads_after_zero_grad_dropped_early_updates(engine_cfg):
    """NVMe optimizer state: updates run during the last backward; once zero_grad()
    dropped that step, `optimizer.load_state_dict` is allowed (the refusal inside a
    step names zero_grad() as the way out) and training goes on as torch."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    (x0, y0), (x1, y1), (x2, y2) = lm_batches(3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _ref_step(ref, opt, x0, y0)
    _ref_step(ref, opt, x2, y2)
    with offload.initialize(model, engine_cfg("nvme", "nvme", "nvme")) as engine:
        engine.backward(lm_loss(engine(x0), y0))
        assert engine.step() is True
        kept = copy.deepcopy(engine.optimizer.state_dict())
        engine.backward(lm_loss(engine(x1), y1))
        assert engine._early_updates_queued()  # handed to the update thread in backward
        engine.zero_grad()
        engine.optimizer.load_state_dict(kept)
        engine.backward(lm_loss(engine(x2), y2))
        assert engine.step() is True
        assert_weights_as_torch(engine, ref, atol=2e-6)


@pytest.mark.parametrize("bad", ["l1.*", "l2.*", "norm.*"])
def test_a_bad_value_refused_by_an_in_place_step_changes_nothing(engine_cfg, bad):
    """Host optimizer state, every partition in memory (the step updates in place, with
    no previous version): a parameter group given a value AdamW refuses (lr < 0) makes
    step() raise before any partition changes, and once fixed the step trains."""
    torch.manual_seed(0)
    model = TiedTwice()
    cfg = engine_cfg("device", "host", "host", group_size=600)
    with offload.initialize(model, cfg, param_groups=[{"params": [bad]}]) as engine:
        assert len(engine.groups) > 2
        (x, y), = lm_batches(1)
        engine.optimizer.param_groups[1]["lr"] = -1.0
        before = snapshot(engine)
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(Exception) as e:
            engine.step()
        assert_same(snapshot(engine), before)  # no group updated, half a step least of all
        assert "lr" in str(e.value), e.value
        engine.optimizer.param_groups[1]["lr"] = 1e-2
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is True


def test_each_groups_full_weights_are_freed_as_its_gradient_is_taken(engine_cfg):
    """Backward frees a group's gathered weights once its gradient is taken, not at the
    step's end: when the input's gradient is computed (the backward's last op), every
    group after the first holds no full weights any more (the peak memory of a backward
    is a few groups', not the model's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    with offload.initialize(model, engine_cfg("host", group_size=32 * 33)) as engine:
        assert len(engine.groups) == 4
        x = torch.randn(2, 32, requires_grad=True)
        out = engine(x)
        seen = []
        x.register_hook(lambda g: seen.append([st.gathered for st in engine._states]))
        engine.backward(out.square().sum())
        assert seen and not any(seen[0][1:]), seen
        assert engine.step()
