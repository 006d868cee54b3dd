"""A `.grad` the program dropped between a backward and the step ([Note: a .grad the
program dropped] in offload/engine/params_view.py): torch's ways of dropping
gradients (`model.zero_grad()`, `p.grad = None`) reach the engine's partitions, or
are refused before anything changes, with torch's numbers against AdamW."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.engine import StepFailedError

from .ranks import process_group, run_cases, spawn_cases

# (params, grads, optimizer); the last runs its updates early, in backward
PLACEMENTS = [("device", "host", "host"), ("host", "host", "nvme"), ("nvme", "nvme", "nvme")]
IDS = ["none", "host", "nvme"]


def _pair(engine_cfg, placement, **engine):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    cfg = engine_cfg(*placement, group_size=200, **engine)  # a group per layer
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    return offload.initialize(model, cfg), ref, opt


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _loss(model, seed):
    x, y = _batch(seed)
    return nn.functional.mse_loss(model(x), y)


def _assert_same(engine, ref):
    with engine.full_weights() as w:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(w[name], p.detach(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_model_zero_grad_before_step_drops_the_update(engine_cfg, placement):
    """backward; model.zero_grad(); step(): torch's AdamW updates nothing, and the
    engine's step returns False and leaves every weight and moment; the next step
    is torch's."""
    engine, ref, opt = _pair(engine_cfg, placement)
    with engine:
        engine.backward(_loss(engine, 0))
        _loss(ref, 0).backward()
        engine.module.zero_grad()
        ref.zero_grad()
        assert engine.step() is False
        opt.step()
        _assert_same(engine, ref)
        for seed in (1, 2):
            engine.backward(_loss(engine, seed))
            assert engine.step()
            opt.zero_grad()
            _loss(ref, seed).backward()
            opt.step()
        _assert_same(engine, ref)
        assert engine.global_step == 2


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_a_skipped_batch_leaves_nothing_in_the_next_step(engine_cfg, placement, accum):
    """The skip-a-batch loop: backward(b0); model.zero_grad(); then a whole step of
    other micro-batches: the step uses theirs only, as torch's."""
    engine, ref, opt = _pair(engine_cfg, placement, grad_accum_steps=accum)
    with engine:
        engine.backward(_loss(engine, 0))
        engine.module.zero_grad()  # the batch is skipped, step() never called for it
        for seed in range(1, 1 + accum):
            engine.backward(_loss(engine, seed))
            (_loss(ref, seed) / accum).backward()
        assert engine.step()
        opt.step()
        _assert_same(engine, ref)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_dropping_one_grad_is_refused_and_changes_nothing(engine_cfg, placement):
    """p.grad = None on one parameter: the step raises, naming it and the fixes; every
    weight is as before, and the engine goes on with torch's numbers."""
    engine, ref, opt = _pair(engine_cfg, placement)
    with engine:
        engine.backward(_loss(engine, 0))
        engine.module[0].weight.grad = None
        with pytest.raises(StepFailedError, match=r"'0\.weight' was set to None.*"
                           r"model\.zero_grad\(\).*requires_grad to False"):
            engine.step()
        _assert_same(engine, ref)  # nothing was updated
        assert engine.module[2].weight.grad is None  # the step's gradients went with it
        engine.backward(_loss(engine, 1))
        assert engine.step()
        _loss(ref, 1).backward()
        opt.step()
        _assert_same(engine, ref)


def test_dropping_one_grad_within_the_window_refuses_the_backward(engine_cfg):
    """With micro-batches still to come, the next backward refuses, changing
    nothing; dropping them all lets it start the step over."""
    engine, ref, opt = _pair(engine_cfg, PLACEMENTS[2], grad_accum_steps=2)
    with engine:
        engine.backward(_loss(engine, 0))
        assert engine.step() is False  # waits for the second micro-batch
        engine.module[2].bias.grad = None
        with pytest.raises(RuntimeError, match=r"'2\.bias' was set to None"):
            engine.backward(_loss(engine, 1))
        assert engine.module[0].weight.grad is not None  # still the first micro-batch's
        engine.module.zero_grad()
        for seed in (1, 2):
            engine.backward(_loss(engine, seed))
            (_loss(ref, seed) / 2).backward()
        assert engine.step()
        opt.step()
        _assert_same(engine, ref)


def test_model_zero_grad_after_a_waiting_step_says_the_loop_never_updates(engine_cfg,
                                                                         caplog):
    """A loop that calls model.zero_grad() after every step() under grad_accum_steps > 1
    drops each window's first micro-batch, as in torch, and never updates: said once."""
    engine, _ref, _opt = _pair(engine_cfg, PLACEMENTS[0], grad_accum_steps=2)
    with engine:
        for seed in range(3):
            engine.backward(_loss(engine, seed))
            assert engine.step() is False
            engine.module.zero_grad()
        said = [r for r in caplog.records if "never updates" in r.getMessage()]
        assert len(said) == 1 and said[0].getMessage().startswith("model.zero_grad() after")
        assert engine.global_step == 0


def test_a_grad_set_to_a_tensor_is_refused(engine_cfg):
    engine, ref, _opt = _pair(engine_cfg, PLACEMENTS[0])
    with engine:
        engine.backward(_loss(engine, 0))
        engine.module[0].bias.grad = torch.zeros(16)
        with pytest.raises(StepFailedError, match=r"'0\.bias' was set to a tensor"):
            engine.step()
        _assert_same(engine, ref)


def _uneven(rank, world, init_file, out, cfg, accum_cfg):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def at_step(drop):
        got = {}
        with offload.initialize(model(), cfg) as engine:
            before = engine.state_dict(rank0_only=False)
            engine.backward(_loss(engine, rank))
            drop(engine)
            try:
                engine.step()
            except StepFailedError as e:
                got["error"] = str(e)
            after = engine.state_dict(rank0_only=False)
            got["same"] = all(torch.equal(before[k], after[k]) for k in before)
            engine.backward(_loss(engine, rank))  # the ranks go on together
            got["next"] = engine.step()
        return got

    def at_backward(drop):  # the next micro-batch's backward after `drop(engine)`
        got = {}
        with offload.initialize(model(), accum_cfg) as engine:
            engine.backward(_loss(engine, rank))
            drop(engine)
            try:
                engine.backward(_loss(engine, rank))
            except RuntimeError as e:
                got["error"] = str(e)
            engine.zero_grad()
            for _ in range(2):
                engine.backward(_loss(engine, rank))
            got["next"] = engine.step()
        return got

    def on_rank_0(engine):
        if rank == 0:
            engine.module.zero_grad()

    def engine_on_rank_0(engine):  # [Note: engine.zero_grad on some ranks]
        if rank == 0:
            engine.zero_grad()

    def one_or_all(engine):  # rank 0 drops one .grad, rank 1 every one
        if rank == 0:
            engine.module[0].weight.grad = None
        else:
            engine.module.zero_grad()
    with process_group(rank, world, init_file):
        run_cases({"at_step": lambda: at_step(on_rank_0),
                   "at_backward": lambda: at_backward(on_rank_0),
                   "engine_at_step": lambda: at_step(engine_on_rank_0),
                   "mixed": lambda: at_backward(one_or_all)}, f"{out}.{rank}")


def test_a_zero_grad_on_some_ranks_only_raises_on_every_rank(engine_cfg, tmp_path):
    """model.zero_grad() or engine.zero_grad() on rank 0 only: both ranks' step (or next
    backward) raises, so no rank waits for the other's update, nothing changes, and
    both train on. Before, after engine.zero_grad() rank 0's step() returned False
    alone and the ranks ran an iteration apart from then on."""
    cfg = engine_cfg(*PLACEMENTS[2], group_size=200)
    accum_cfg = engine_cfg(*PLACEMENTS[2], group_size=200, grad_accum_steps=2)
    got = spawn_cases(_uneven, str(tmp_path), world=2, args=(cfg, accum_cfg))
    for r in got:
        for case in ("at_step", "at_backward", "engine_at_step"):
            assert "crash" not in r[case], r
            assert "on 1 of 2 ranks" in r[case]["error"], r
            assert r[case]["next"] is True
        assert r["at_step"]["same"] and r["engine_at_step"]["same"]
    # rank 0's own error names the parameter
    assert "'0.weight' was set to None" in got[0]["mixed"]["error"]
    assert "other rank(s) refused this backward" in got[1]["mixed"]["error"]
    assert all(r["mixed"]["next"] is True for r in got)
