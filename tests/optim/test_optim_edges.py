"""`engine.optimizer` as a torch user reaches it: state_dict round trips, values
written into its param groups, and torch.optim idioms, against torch.optim.AdamW."""

import copy
import io

import pytest
import torch

import offload
from offload.config import OptimConfig
from offload.engine.step import StepFailedError
from offload.optim import CpuAdam

from ..engine.models import TiedTwice, lm_batches, lm_loss


def _cfg(tmp_path, optimizer="host", dtype="fp32", **optim):
    return {
        "engine": {"params": "host", "grads": "host", "optimizer": optimizer, "dtype": dtype,
                   "group_size": 3000},
        "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096, **optim},
        "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
               "grow_step": "4MiB"},
        "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
    }


def _one_cycle(opt, last_epoch=-1):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=8,
                                               last_epoch=last_epoch)


def test_state_dict_keeps_what_a_scheduler_wrote_so_a_resume_runs_as_torch(tmp_path):
    """torch's optimizer state dict keeps every key of a group, among them those a
    scheduler wrote ("initial_lr", OneCycleLR's "max_lr", "min_lr", momenta); a resume
    that makes the scheduler with `last_epoch` reads them back from the optimizer.
    offload's state dict dropped them: the resume raised KeyError where torch's ran."""
    torch.manual_seed(0)
    ref = TiedTwice()
    start = copy.deepcopy(ref.state_dict())
    batches = lm_batches(4)

    # torch: 2 steps, save, a fresh optimizer loads, the scheduler resumes at epoch 2
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = _one_cycle(opt)
    for x, y in batches[:2]:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
        sched.step()
    saved = opt.state_dict()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(saved)
    sched = _one_cycle(opt, last_epoch=1)  # its first step() makes it epoch 2
    for x, y in batches[2:]:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
        sched.step()

    model = TiedTwice()
    model.load_state_dict(start)
    with offload.initialize(model, _cfg(tmp_path / "a")) as engine:
        sched = _one_cycle(engine.optimizer)
        for x, y in batches[:2]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            sched.step()
        buf = io.BytesIO()
        torch.save(engine.optimizer.state_dict(), buf)
        weights = {k: v.clone() for k, v in engine.state_dict().items()}
    assert "initial_lr" in torch.load(io.BytesIO(buf.getvalue()))["param_groups"][0]
    model = TiedTwice()
    model.load_state_dict(weights)
    with offload.initialize(model, _cfg(tmp_path / "b")) as engine:
        buf.seek(0)
        engine.optimizer.load_state_dict(torch.load(buf))
        sched = _one_cycle(engine.optimizer, last_epoch=1)
        for x, y in batches[2:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            sched.step()
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-12)
        got = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("key,bad,good", [("amsgrad", True, False), ("maximize", True, False),
                                          ("decoupled_weight_decay", False, True)])
def test_amsgrad_or_maximize_written_into_param_groups_is_refused(tmp_path, key, bad, good):
    """initialize refuses amsgrad / maximize; written into engine.optimizer.param_groups
    afterwards (as torch.optim.AdamW reads them at every step) they were silently
    ignored: plain AdamW ran. So was decoupled_weight_decay=False (torch's Adam decay
    in an AdamW). The step must fail naming the key, weights unchanged."""
    torch.manual_seed(0)
    (x, y), = lm_batches(1)
    with offload.initialize(TiedTwice(), _cfg(tmp_path)) as engine:
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.optimizer.param_groups[0][key] = bad
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError) as err:
            engine.step()
        chain, e = [], err.value
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        assert any(key in s for s in chain), chain
        after = engine.state_dict()
        for k, v in before.items():
            assert torch.equal(after[k], v), k
        # torch's default for AdamW (as in a state dict of torch's) is accepted
        engine.optimizer.param_groups[0][key] = good
        engine.zero_grad()
        engine.backward(lm_loss(engine(x), y))
        assert engine.step()


def test_load_state_dict_refuses_amsgrad_before_loading():
    opt = CpuAdam(OptimConfig(lr=1e-2))
    opt.add_partition("x", torch.zeros(64))
    opt.step({"x": torch.randn(64)})
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["amsgrad"] = True
    sd["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and "amsgrad" not in opt.param_groups[0]


def test_optimizer_step_as_a_torch_loop_calls_it_says_to_call_engine_step(tmp_path):
    """`engine.optimizer.step()` (or `step(closure)`), as a torch loop calls it, raised
    "missing 1 required positional argument: 'grads'" or a TypeError from deep inside;
    it must say what to call instead."""
    with offload.initialize(TiedTwice(), _cfg(tmp_path)) as engine:
        with pytest.raises(TypeError, match=r"engine\.step\(\)"):
            engine.optimizer.step()
        with pytest.raises(TypeError, match=r"engine\.step\(\)"):
            engine.optimizer.step(lambda: torch.tensor(1.0))


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_bf16_optimizer_load_keeps_weights_and_forward_together(tmp_path, optimizer):
    """bf16 training: engine.optimizer.load_state_dict(sd) puts back the fp32 masters of
    sd (engine.state_dict() reports them), but the forward still ran the bf16 weights
    of before the load: the model reported one set of weights and computed with
    another, and the next step updated the old masters from gradients of the new
    weights. Now the compute-dtype weights are rebuilt from the loaded masters. (In
    fp32 training the masters are the weights, which the optimizer's state dict does
    not hold: the call leaves them alone, as torch's does.)"""
    torch.manual_seed(0)
    batches = lm_batches(3)
    with offload.initialize(TiedTwice(), _cfg(tmp_path, optimizer, "bf16")) as engine:
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        sd = copy.deepcopy(engine.optimizer.state_dict())
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.optimizer.load_state_dict(sd)
        reported = {k: v.clone() for k, v in engine.state_dict().items()}
        with torch.no_grad():
            out = engine(batches[2][0]).float()
        probe = TiedTwice()
        probe.load_state_dict(reported)
        probe.to(torch.bfloat16)
        with torch.no_grad():
            want = probe(batches[2][0]).float()
    torch.testing.assert_close(out, want, atol=1e-2, rtol=0)


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_optimizer_state_reads_as_torchs_keyed_as_its_param_groups(tmp_path, optimizer):
    """Code that reads `optimizer.state[p]` for each `p` of `param_groups` (logging the
    moments, a step count) raised AttributeError: the optimizer had no `state`. It
    reads the committed state of each partition, as torch's AdamW's holds it."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    with offload.initialize(model, _cfg(tmp_path, optimizer)) as engine:
        for x, y in batches:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        state = engine.optimizer.state
        keys = [p for g in engine.optimizer.param_groups for p in g["params"]]
        assert sorted(map(str, state)) == sorted(map(str, keys)) and len(state) == len(keys)
        got = {k: state[k] for k in keys}
        assert all(k in state for k in keys)
        assert all(float(s["step"]) == 3 for s in got.values())
        want = engine.optimizer.state_dict()["state"]
        for k in keys:
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[k][name], want[k][name])
        # the moments are torch's: the partitions hold every element once, padding zero
        for name in ("exp_avg", "exp_avg_sq"):
            ours = sum(float(s[name].double().abs().sum()) for s in got.values())
            theirs = sum(float(opt.state[p][name].double().abs().sum())
                         for p in ref.parameters())
            assert ours == pytest.approx(theirs, rel=1e-5)
        with pytest.raises(KeyError, match="keyed by partition ids"):
            state[next(model.parameters())]
        assert next(model.parameters()) not in state
        with pytest.raises(KeyError, match="unknown partition"):
            state["nope"]
        with pytest.raises(TypeError, match="load_state_dict"):
            state[keys[0]] = {}


def test_a_torch_optimizers_state_dict_is_refused_saying_what_to_load(tmp_path):
    """torch.optim.AdamW's state dict (its params: the model's parameter indices) loaded
    into engine.optimizer said only which partitions differ; it must say what to load."""
    model = TiedTwice()
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (x, y), = lm_batches(1)
    lm_loss(model(x), y).backward()
    theirs.step()
    with offload.initialize(TiedTwice(), _cfg(tmp_path)) as engine:
        before = copy.deepcopy(engine.optimizer.state_dict())
        with pytest.raises(ValueError, match="load what this optimizer's state_dict"):
            engine.optimizer.load_state_dict(theirs.state_dict())
        assert engine.optimizer.state_dict()["param_groups"] == before["param_groups"]
