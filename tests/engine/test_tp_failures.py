"""Tensor parallelism (tp.size = 2 on two gloo ranks, one DP rank) when one rank fails
alone: its model raising in the middle of a Domino block, or its step refused.

Before: the ranks' checks and a step's agreement ran over the DP group, which had one
rank, so nobody heard of the other's failure. A rank whose forward raised went on to
its next batch and paired its TP all-reduces with the other rank's from the failed
pass: it stepped twice on mixed-up sums, with no error, while the other waited for
good; a step refused on one rank committed on the other, leaving its shards a step
ahead."""

import os

import pytest
import torch

import offload
import offload.comm.mesh

from .models import lm_loss
from .ranks import process_group, run_cases, spawn_cases
from .test_domino import EPS, _batches, _config, _logits, _model

pytestmark = pytest.mark.distributed


def _case_one_rank_raises(d: str, rank: int, kind: type) -> dict:
    """Rank 0's model raises `kind` inside the second block's MLP at step 1; rank 1's
    does not. Rank 0 waits for its TP group's word (not for a Ctrl-C), then refuses
    every call; rank 1, waiting in the pass's all-reduce, is released with an error
    when rank 0's process ends."""
    offload.comm.mesh.FAILED_PASS_WAIT_S = 3.0  # read when the mesh is built
    model = _model("gpt")
    armed = [False]

    def hook(*_):
        if armed[0]:
            raise kind("raised by rank 0's model")

    out: dict = {"errors": [], "steps": []}
    engine = offload.initialize(model, _config(os.path.join(d, "one"), 2, "host"))
    if rank == 0:
        model.blocks[1].mlp.fc.register_forward_hook(hook)
    for step, (x, y) in enumerate(_batches()[:3]):
        armed[0] = step == 1
        try:
            engine.backward(lm_loss(_logits(engine(x)), y))
            engine.step()
        except (RuntimeError, KeyboardInterrupt) as e:
            out["errors"].append((type(e).__name__, str(e), repr(e.__cause__)))
        out["steps"].append(engine.global_step)
    if rank == 1:
        engine.close()
    return out  # rank 0 ends its process with the engine open, as a failed script does


def _case_one_rank_step_refused(d: str, rank: int, nan_rank: int = 0) -> dict:
    """Rank `nan_rank` writes a NaN lr between backward and step(): every rank's step
    fails and changes nothing (the agreement spans the job, not one TP or DP group),
    and the next step trains on all. Each DP rank (TP groups of 2) takes its share."""
    from offload.engine import full_state_dict
    dp = torch.distributed.get_world_size() // 2
    out: dict = {}
    with offload.initialize(_model("gpt"), _config(os.path.join(d, "step"), 2,
                                                   "host")) as engine:
        (x, y), (x2, y2) = ((t.chunk(dp)[rank // 2] for t in b) for b in _batches()[:2])
        before = full_state_dict(engine)
        engine.backward(lm_loss(_logits(engine(x)), y))
        if rank == nan_rank:
            engine.optimizer.param_groups[0]["lr"] = float("nan")
        try:
            engine.step()
            out["raised"] = None
        except Exception as e:  # noqa: BLE001
            out["raised"] = type(e).__name__
        out["steps"] = engine.global_step
        after = full_state_dict(engine)
        out["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
        engine.optimizer.param_groups[0]["lr"] = 1e-2
        engine.backward(lm_loss(_logits(engine(x2)), y2))
        out["next"] = engine.step()
    return out


def _worker(rank: int, world: int, init_file: str, out: str, kind: str) -> None:
    d = os.path.dirname(init_file)
    with process_group(rank, world, init_file):
        cases = {"raise": lambda: _case_one_rank_raises(
            d, rank, {"error": RuntimeError, "interrupt": KeyboardInterrupt}[kind])}
        if kind == "error":
            cases = {"step": lambda: _case_one_rank_step_refused(d, rank), **cases}
        run_cases(cases, f"{out}.{rank}")
        if rank == 0:
            os._exit(0)  # rank 1 is released by this process's end, not by a call


@pytest.fixture(scope="module", params=["error", "interrupt"])
def outcomes(request, tmp_path_factory) -> list:
    return spawn_cases(_worker, str(tmp_path_factory.mktemp("tp-failures")),
                       args=(request.param,))


def test_a_rank_whose_model_raised_alone_refuses_to_go_on(outcomes):
    """An error: raised as why, from the model's; a Ctrl-C: raised as itself, at once
    (the interrupt is obeyed, not turned into an error a loop may catch)."""
    mine, other = outcomes[0]["raise"], outcomes[1]["raise"]
    assert "crash" not in mine and "crash" not in other, (mine, other)
    assert mine["steps"] == [1, 1, 1], mine  # no step on the other rank's sums
    (kind, first, cause), *later = mine["errors"]
    if kind == "RuntimeError":
        assert "did not stop with it within 3 s" in first, first
        assert "raised by rank 0's model" in cause, cause
    else:
        assert kind == "KeyboardInterrupt" and first == "raised by rank 0's model", first
    assert len(later) == 1 and later[0][0] == "RuntimeError", later  # every call refused
    assert "stopped in the middle of a tensor-parallel pass" in later[0][1], later
    assert other["steps"] == [1, 1, 1] and len(other["errors"]) == 2, other
    assert "another rank of its TP group is gone" in other["errors"][0][1], other


def test_a_step_refused_on_one_rank_changes_neither(outcomes):
    if "step" not in outcomes[0]:
        pytest.skip("run with the first kind only")
    for rank, r in enumerate(outcomes):
        got = r["step"]
        assert "crash" not in got, got
        assert got["raised"] is not None and got["steps"] == 0, got
        assert got["unchanged"] is True, got
        assert got["next"] is True, got


def _train(engine, rank: int, batches: list, arm=lambda i: None,
           loss_raises_at: int | None = None) -> dict:
    """Trains on each of `batches` (this rank's DP share of it; `arm(i)` first), the
    loss code raising at batch `loss_raises_at`; each error as (batch, type, message)
    and the global step after each batch."""
    out: dict = {"errors": [], "steps": []}
    for i, batch in enumerate(batches):
        arm(i)
        x, y = (t.chunk(2)[rank // 2] for t in batch)
        try:
            logits = _logits(engine(x))
            if i == loss_raises_at:
                raise ValueError(f"rank {rank}'s loss code raised")
            engine.backward(lm_loss(logits, y))
            engine.step()
        except (RuntimeError, ValueError) as e:
            out["errors"].append((i, type(e).__name__, str(e)))
        out["steps"].append(engine.global_step)
    return out


def _case_one_tp_group_raises(d: str, rank: int, where: str) -> dict:
    """DP = 2 x TP = 2: both ranks of TP group {0, 1} raise alike inside the second
    block's MLP (run in pieces by the package's Domino block) at step 1, those of
    {2, 3} do not. Each TP group asks only its own ranks whether they raised
    together ([Note: mesh layout]): {0, 1} did, so they raise the model's error and
    tell the others, {2, 3} learn of it at their next check, every rank undoes its
    pass, and the next batch trains on all four. `where`: in the forward, or in the
    backward (a hook on the MLP's activations, run by autograd)."""
    offload.comm.mesh.FAILED_PASS_WAIT_S = 3.0  # read when the mesh is built
    from offload.engine import full_state_dict
    model = _model("gpt")
    armed = [False]

    def raises(*_):
        if armed[0]:
            raise RuntimeError(f"raised by rank {rank}'s model")

    def hook(_module, _args, output):
        if where == "forward":
            raises()
        elif output.requires_grad:
            output.register_hook(raises)

    with offload.initialize(model, _config(os.path.join(d, where), 2, "host")) as engine:
        if rank < 2:
            model.blocks[1].mlp.fc.register_forward_hook(hook)
        def arm(i: int) -> None:
            armed[0] = i == 1
        out = _train(engine, rank, _batches()[:3], arm=arm)
        out["errors"] = [msg for _, _, msg in out["errors"]]
        out["sd"] = full_state_dict(engine)
    return out


def _case_rows_apart(d: str, rank: int) -> dict:
    """DP = 2 x TP = 2: at step 1 rank 3 calls the model with another batch than rank 2,
    its TP partner ([Note: a TP group reads the same rows]): every rank raises at the
    forward's first check, and the next step, with the same rows again, trains."""
    from offload.engine import full_state_dict
    batches = _batches()
    if rank == 3:
        batches[1] = batches[4]
    with offload.initialize(_model("gpt"), _config(os.path.join(d, "rows"), 2,
                                                   "host")) as engine:
        out = _train(engine, rank, batches[:3])
        out["sd"] = full_state_dict(engine)
    return out


def _case_loss_code_raises_on_rank_2(d: str, rank: int) -> dict:
    """DP = 2 x TP = 2: rank 2's loss code raises after its forward of batch 1, and it goes
    on to its next forward while the others run their backward: every rank raises
    at that check (a RankOrderError, at one all-reduce: no TP collective is left
    waiting). The loop keeps rank 2 a batch behind its TP partner from then on, so
    every later forward stops at its first check on every rank ([Note: a TP group
    reads the same rows]): no step sums two batches."""
    offload.comm.mesh.FAILED_PASS_WAIT_S = 3.0  # read when the mesh is built
    with offload.initialize(_model("gpt"), _config(os.path.join(d, "loss"), 2,
                                                   "host")) as engine:
        return _train(engine, rank, _batches()[:4 + (rank == 2)],
                      loss_raises_at=1 if rank == 2 else None)


def _worker4(rank: int, world: int, init_file: str, out: str) -> None:
    d = os.path.dirname(init_file)
    with process_group(rank, world, init_file):
        run_cases({"forward": lambda: _case_one_tp_group_raises(d, rank, "forward"),
                   "backward": lambda: _case_one_tp_group_raises(d, rank, "backward"),
                   "refused": lambda: _case_one_rank_step_refused(d, rank, nan_rank=3),
                   "loss": lambda: _case_loss_code_raises_on_rank_2(d, rank),
                   "rows": lambda: _case_rows_apart(d, rank)}, f"{out}.{rank}")


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list:
    return spawn_cases(_worker4, str(tmp_path_factory.mktemp("tp-four")), world=4)


def test_a_step_refused_on_one_of_four_ranks_changes_none(four):
    for rank, r in enumerate(four):
        got = r["refused"]
        assert "crash" not in got, (rank, got)
        assert got == {"raised": "StepFailedError", "steps": 0, "unchanged": True,
                       "next": True}, (rank, got)


def test_ranks_that_met_at_different_checks_are_told_so_under_tensor_parallelism(four):
    """Before, rank 2 (its forward met the others' backward) asked its TP group whether
    they raised too; rank 3 had raised at its backward's check, outside a pass, and
    never answered: after 3 s every rank refused every later call. Now each call
    raises at a check saying why, and no step is taken on two batches' sums."""
    rows = "(one tensor-parallel group) called the model with different tensors"
    for rank, r in enumerate(four):
        got = r["loss"]
        assert "crash" not in got, (rank, got)
        kinds = [(i, kind, rows in msg) for i, kind, msg in got["errors"]]
        if rank == 2:
            assert kinds == [(1, "ValueError", False), (2, "RankOrderError", False),
                             (3, "RankOrderError", True), (4, "RankOrderError", True)], kinds
        else:
            assert kinds == [(1, "RankOrderError", False), (2, "RankOrderError", True),
                             (3, "RankOrderError", True)], kinds
        assert set(got["steps"]) == {1}, got


def test_a_tp_group_whose_ranks_read_different_rows_stops_before_summing_them(four):
    """Before, rank 3's batch and rank 2's were summed in every TP all-reduce of the
    step, and the step was taken, with no error."""
    for rank, r in enumerate(four):
        got = r["rows"]
        assert "crash" not in got, (rank, got)
        assert got["steps"] == [1, 1, 2], got
        (i, kind, msg), = got["errors"]
        assert (i, kind) == (1, "RankOrderError"), got["errors"]
        assert msg.startswith("ranks 2, 3 (one tensor-parallel group) called the model "
                              "with different tensors before the forward of unit"), msg
    _same_as_torch([r["rows"]["sd"] for r in four], [0, 2])


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_tp_group_that_raised_together_tells_the_other_and_both_go_on(four, where):
    """Before, the model's error inside the package's Domino block counted as the
    engine's own: nobody was told, the failed group went on a batch ahead of the
    other, and every later call met the other's at a different point."""
    got = [r[where] for r in four]
    for rank, r in enumerate(got):
        assert "crash" not in r, (rank, r)
        assert r["steps"] == [1, 1, 2] and len(r["errors"]) == 1, (rank, r)
    for rank in (0, 1):  # the model's own error, not a refusal to go on
        assert got[rank]["errors"] == [f"raised by rank {rank}'s model"], got[rank]
    for rank in (2, 3):
        assert got[rank]["errors"][0].startswith(
            "ranks 0, 1 raised in their models' forward or backward"), got[rank]
    _same_as_torch([r["sd"] for r in got], [0, 2])


def _same_as_torch(weights: list, batches: list) -> None:
    """Each rank's full weights are torch's trained on `batches`, whole, one process."""
    ref = _model("gpt")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    for i in batches:
        x, y = _batches()[i]
        opt.zero_grad()
        lm_loss(_logits(ref(x)), y).backward()
        opt.step()
    for sd in weights:
        assert set(sd) == set(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0, msg=k)
