"""Collectives whose pairing the ranks must keep (two gloo ranks, spawned once): a
pending collective completes once however often it is waited on, and under tensor
parallelism (tp.size = 2) ranks that raised in the same pass after different numbers
of TP all-reduces refuse to go on (going on would pair one rank's leftover sum with
the other's next one)."""

import os

import pytest
import torch

import offload
import offload.comm.mesh

from .models import lm_loss
from .ranks import process_group, run_cases, spawn_cases
from .test_domino import _batches, _config, _logits, _model

pytestmark = pytest.mark.distributed


def _case_pending_once(rank: int) -> dict:
    """An async reduce-scatter waited on twice: its completion (which divides by the
    world and, in the engine, hands the gradient on) runs once."""
    from offload.comm import Collectives
    comm = Collectives()
    full = torch.arange(8, dtype=torch.float32) * (rank + 1)
    ran = []
    pending, mine = comm.reduce_scatter_mean(full, async_op=True)
    inner = pending.finish
    pending.finish = lambda: (inner(), ran.append(1))
    pending.wait()
    pending.wait()
    return {"slice": mine.clone(), "ran": len(ran)}


def _case_unpaired(d: str, rank: int) -> dict:
    """Rank 0 raises in the first piece's MLP of the second block, rank 1 in the second
    piece's, after it started the first piece's all-reduce: nobody waits, yet one TP
    all-reduce is unpaired."""
    offload.comm.mesh.FAILED_PASS_WAIT_S = 10.0  # read when the mesh is built
    model = _model("gpt")
    armed, calls = [False], [0]

    def hook(*_):
        if armed[0]:
            calls[0] += 1
            if calls[0] == 1 + rank:
                raise RuntimeError(f"raised by rank {rank}'s model")

    out: dict = {"errors": []}
    engine = offload.initialize(model, _config(os.path.join(d, "unpaired"), 2, "host",
                                               pieces=2))
    model.blocks[1].mlp.fc.register_forward_hook(hook)
    (x, y), (x2, y2) = _batches()[:2]
    engine.backward(lm_loss(_logits(engine(x)), y))
    engine.step()
    armed[0] = True
    try:
        engine.backward(lm_loss(_logits(engine(x2)), y2))
        engine.step()
    except RuntimeError as e:
        out["errors"].append(str(e))
    armed[0] = False
    out["steps"] = engine.global_step
    if out["errors"] and "different numbers" in out["errors"][0]:
        try:  # refused before it issues anything (else it could hang here)
            engine(x)
        except RuntimeError as e:
            out["errors"].append(str(e))
    return out


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    d = os.path.dirname(init_file)
    with process_group(rank, world, init_file):
        run_cases({"pending": lambda: _case_pending_once(rank),
                   "unpaired": lambda: _case_unpaired(d, rank)}, f"{out}.{rank}")
        os._exit(0)  # a TP all-reduce is left unpaired: no clean close


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list:
    return spawn_cases(_worker, str(tmp_path_factory.mktemp("tp-unpaired")))


def test_a_pending_collective_completes_once(outcomes):
    mean = torch.arange(8, dtype=torch.float32) * 1.5  # (1 + 2) / 2
    for rank, r in enumerate(outcomes):
        got = r["pending"]
        assert "crash" not in got and got["ran"] == 1, got
        torch.testing.assert_close(got["slice"], mean.chunk(2)[rank], rtol=0, atol=0)


def test_ranks_that_raised_after_different_tp_collectives_refuse_to_go_on(outcomes):
    for r in outcomes:
        got = r["unpaired"]
        assert "crash" not in got, got
        assert got["steps"] == 1, got
        assert len(got["errors"]) == 2, got
        assert "different numbers of tensor-parallel collectives" in got["errors"][0], got
        assert "stopped in the middle of a tensor-parallel pass" in got["errors"][1], got
