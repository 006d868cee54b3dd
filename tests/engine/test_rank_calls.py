"""[Note: ranks run the same units]: a call every rank must make together (step(),
save_checkpoint(), load_state_dict()) made by some ranks only raises on every rank
at once, naming the call, instead of pairing its agreement's sum with another
rank's check (wrong errors, then a hang until the process group's timeout); the
ranks then go on together from the same state."""

import pytest
import torch
from torch import nn

import offload
from offload.engine import RankOrderError, StepFailedError

from .ranks import process_group, run_cases, spawn_cases


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _loss(engine, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    return nn.functional.mse_loss(engine(x), y)


def _errors(call):
    try:
        call()
    except (RankOrderError, StepFailedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _worker(rank, world, init_file, out, cfg, save_to):
    def skipped_step(then):  # rank 1 skips a step() and goes on with `then(engine)`
        got = {}
        with offload.initialize(_model(), cfg) as engine:
            engine.backward(_loss(engine, rank))
            assert engine.step()
            engine.backward(_loss(engine, 10 + rank))
            got["error"] = _errors(engine.step if rank == 0 else lambda: then(engine))
            got["pending"] = engine._backwards  # backward calls of the step left
            for seed in (30, 40):  # both go on, together
                engine.backward(_loss(engine, seed + rank))
                got.setdefault("next", []).append(engine.step())
            got["steps"] = engine.global_step
        return got

    def save_on_rank_0():
        got = {}
        with offload.initialize(_model(), cfg) as engine:
            engine.backward(_loss(engine, rank))
            assert engine.step()
            if rank == 0:
                got["error"] = _errors(lambda: engine.save_checkpoint(save_to))
            else:
                got["error"] = _errors(lambda: engine.backward(_loss(engine, 10 + rank)))
            engine.backward(_loss(engine, 20 + rank))
            got["next"] = [engine.step()]
        return got

    def load_on_rank_0():
        got = {}
        with offload.initialize(_model(), cfg) as engine:
            if rank == 0:
                got["error"] = _errors(lambda: engine.load_state_dict(_model().state_dict()))
            else:
                got["error"] = _errors(lambda: engine.backward(_loss(engine, rank)))
            engine.backward(_loss(engine, 20 + rank))
            got["next"] = [engine.step()]
        return got
    def eval_on_rank_0():  # `if rank == 0: evaluate()` beside rank 1's training forward
        got = {}
        with offload.initialize(_model(), cfg) as engine:
            engine.backward(_loss(engine, rank))
            assert engine.step()
            if rank == 0:
                with torch.no_grad():
                    got["error"] = _errors(lambda: engine(torch.randn(8, 8)))
            else:
                got["error"] = _errors(lambda: engine.backward(_loss(engine, 10 + rank)))
            engine.backward(_loss(engine, 20 + rank))
            got["next"] = [engine.step()]
        return got
    with process_group(rank, world, init_file):
        run_cases({"skipped_step": lambda: skipped_step(lambda e: _loss(e, 20 + rank)),
                   "skipped_then_saved": lambda: skipped_step(
                       lambda e: e.save_checkpoint(f"{save_to}-{rank}")),
                   "skipped_then_loaded": lambda: skipped_step(
                       lambda e: e.load_state_dict(_model().state_dict())),
                   "save_on_rank_0": save_on_rank_0, "load_on_rank_0": load_on_rank_0,
                   "eval_on_rank_0": eval_on_rank_0},
                  f"{out}.{rank}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    d = tmp_path_factory.mktemp("rank-calls")
    cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "nvme",
                      "group_size": 200},
           "optim": {"lr": 1e-2, "chunk_elems": 4096},
           "io": {"paths": [str(d / "swap")], "buffer_budget": "32MiB", "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    return spawn_cases(_worker, str(d), world=2, args=(cfg, str(d / "ckpt")))


@pytest.mark.parametrize("case, then", [("skipped_step", "the forward"),
                                        ("skipped_then_saved", "save_checkpoint()"),
                                        ("skipped_then_loaded", "the all-gather of group 0")])
def test_a_step_one_rank_skips_raises_on_both_and_they_go_on(outcomes, case, then):
    """Rank 1 skips a step() and runs a forward (or saves, or loads): both raise there,
    rank 1 drops the step's gradients as rank 0's failed step did, and both go on."""
    r0, r1 = (o[case] for o in outcomes)
    assert "crash" not in r0 and "crash" not in r1, (r0, r1)
    assert r0["error"].startswith("StepFailedError") and f"rank 1 runs {then}" in r0["error"]
    assert "rank 0 runs engine.step()" in r1["error"]
    for e in (r0["error"], r1["error"]):
        assert "every rank calls engine.step() after the same backward calls" in e
    assert r0["pending"] == r1["pending"] == 0
    assert r0["next"] == r1["next"] == [True, True] and r0["steps"] == r1["steps"] == 3


@pytest.mark.parametrize("case, call", [("save_on_rank_0", "save_checkpoint()"),
                                        ("load_on_rank_0", "whole weights")])
def test_a_save_or_load_on_one_rank_raises_on_both_naming_it(outcomes, case, call):
    r0, r1 = (o[case] for o in outcomes)
    assert "crash" not in r0 and "crash" not in r1, (r0, r1)
    assert r0["error"] is not None and r1["error"] is not None
    assert call in r1["error"] and "not under `if rank == 0`" in r0["error"]
    assert r0["next"] == r1["next"] == [True]


def test_an_evaluation_on_one_rank_raises_on_both_and_they_go_on(outcomes):
    """A forward under torch.no_grad on rank 0 beside rank 1's training forward passed
    the check (the same unit) and then paired rank 1's prefetching all-gather with
    nothing: both waited for the process group's timeout."""
    r0, r1 = (o["eval_on_rank_0"] for o in outcomes)
    assert "crash" not in r0 and "crash" not in r1, (r0, r1)
    assert "rank 1 runs the forward of unit '0'" in r0["error"]
    assert "rank 0 runs the forward of unit '0' without autograd" in r1["error"]
    for e in (r0["error"], r1["error"]):
        assert "run it on every rank" in e
    assert r0["next"] == r1["next"] == [True]
