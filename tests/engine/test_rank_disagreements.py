"""What the ranks must agree on beyond the config and the parameters: the model's
buffers at `initialize` ([Note: ranks agree at initialize] in rank_agreement.py) and
the optimizer's values at every `step()` ([Note: every rank steps with the same
values] in hyper_watch.py). A rank that differs is refused on every rank, naming what
differs, instead of hanging or training a mix; once the ranks agree again, they train
as a run in which they had agreed from the start. Two gloo processes; the model is
large enough that rank 1 owns real elements of a group (at group_size 200)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .ranks import spawn

pytestmark = pytest.mark.distributed

HANG_S = 30  # a case that takes longer has hung: the test fails instead of blocking


class _Masked(nn.Module):
    """An MLP behind an input mask buffer: a rank with another mask trains on other
    inputs. Its middle layer's group (4160 elements) is split over both ranks."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 4))
        for name, b in buffers.items():
            self.register_buffer(name, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self._buffers.get("mask")
        return self.net(x if mask is None or not mask.is_floating_point() else x * mask)


def _cfg(d: str, rank: int) -> dict:
    return {"engine": {"params": "host", "grads": "host", "optimizer": "nvme",
                       "group_size": 200},
            "optim": {"lr": 1e-2, "chunk_elems": 4096},
            "io": {"paths": [os.path.join(d, f"swap{rank}")], "buffer_budget": "32MiB",
                   "grow_step": "4MiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}


def _train(engine, rank: int, seed: int) -> bool:
    """One micro-batch of this rank's data (each rank its own), then step()."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    return engine.step()


def _state(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.state_dict(rank0_only=False).items()}


def _worker(rank: int, world: int, init_file: str, d: str, case: str, arg: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_S // 2))
    try:
        result = {"buffers": _buffers_case, "values": _values_case}[case](rank, d, *arg)
        torch.save(result, os.path.join(d, f"out.{rank}"))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, case: str, *arg: object) -> list[dict]:
    spawn(_worker, str(tmp_path / "init"), str(tmp_path), case, arg, timeout_s=HANG_S)
    return [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]


# each case: (rank 0's buffers, rank 1's refused ones, rank 1's accepted ones: the same
# names, shapes and dtypes as rank 0's, other values)
_BUFFERS = {
    "on one rank only": ({"mask": torch.ones(8)},
                         {"mask": torch.ones(8), "stats": torch.zeros(3)},
                         {"mask": torch.ones(8)}),
    "of another shape": ({"mask": torch.ones(8)}, {"mask": torch.ones(5)},
                         {"mask": torch.full((8,), 0.5)}),
    "of another dtype": ({"mask": torch.ones(8)}, {"mask": torch.ones(8, dtype=torch.int32)},
                         {"mask": torch.full((8,), 0.5)}),
}


def _buffers_case(rank: int, d: str, how: str) -> dict:
    import offload
    mine, refused, accepted = _BUFFERS[how]
    model = _Masked(mine if rank == 0 else refused)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    result: dict = {"error": None}
    try:
        offload.initialize(model, _cfg(d, rank))
    except Exception as e:  # noqa: BLE001
        result["error"] = (type(e).__name__, str(e))
    after = model.state_dict()  # the model as it was: its own tensors, values and dtypes
    result["kept"] = after.keys() == before.keys() and all(
        after[k].dtype == dt and torch.equal(after[k], v) for k, (dt, v) in before.items())
    swap = os.path.join(d, f"swap{rank}")
    result["swap"] = sorted(os.listdir(swap)) if os.path.isdir(swap) else []
    # the same model, its buffers made to match rank 0's, trains; and as a run in which
    # every rank had rank 0's buffers from the start
    for name in list(model._buffers):
        del model._buffers[name]
    for name, b in (mine if rank == 0 else accepted).items():
        model.register_buffer(name, b.clone())
    for run, m in (("trained", model), ("reference", _Masked(mine))):
        with offload.initialize(m, _cfg(d, rank)) as engine:
            result["mask"] = m.mask.clone()
            assert _train(engine, rank, 0) and _train(engine, rank, 1)
            result[run] = _state(engine)
    return result


@pytest.mark.parametrize("how", list(_BUFFERS))
def test_a_buffer_that_differs_is_refused_on_every_rank_without_hanging(tmp_path, how):
    """A buffer on rank 1 only left rank 1 waiting in its broadcast and rank 0 in its
    first forward; one of another dtype took rank 0's float bytes as int32 on rank 1,
    one of another shape kept its own values. Now initialize raises the same
    ConfigError on both, naming the buffer and each rank's shape or dtype, leaves the
    model as it was and no swap file; the model, fixed, trains on both."""
    want = {"on one rank only": "buffer 'stats' is on rank 1 and not on rank 0",
            "of another shape": "buffer 'mask' has shape (8,) on rank 0 and (5,) on rank 1",
            "of another dtype": "buffer 'mask' has dtype torch.float32 on rank 0 and "
                                "torch.int32 on rank 1"}[how]
    results = _run(tmp_path, "buffers", how)
    for r in results:
        assert r["error"] == ("ConfigError", "the model's buffers differ between ranks: "
                              f"{want}; build the same model on every rank (a buffer's "
                              "values may differ: every rank takes rank 0's)"), r["error"]
        assert r["kept"] and r["swap"] == []
        assert torch.equal(r["mask"], torch.ones(8))  # rank 0's on both
        for k, v in r["reference"].items():  # the same weights on every rank, as if the
            assert torch.equal(r["trained"][k], v), k  # ranks had agreed all along
            assert torch.equal(results[0]["trained"][k], v), k


# a value each key takes on some ranks only, as param_groups holds it and as compared
_VALUES = {"lr": (0.5, "0.5"), "betas": ((0.8, 0.99), "(0.8, 0.99)"), "eps": (1e-3, "0.001"),
           "weight_decay": (0.5, "0.5")}


def _values_case(rank: int, d: str, key: str, when: str) -> dict:
    """Rank 1 writes `key` `when` ("before" the step's backward, or "between" it and
    step()); its step fails on both, changing nothing; rank 0 writes it too and the
    step's micro-batch runs again. The reference: both write it before the backward."""
    import offload
    value = _VALUES[key][0]
    result: dict = {}
    with offload.initialize(_Masked({}), _cfg(d, rank)) as engine:
        assert _train(engine, rank, 0)
        group = engine.optimizer.param_groups[0]
        result["old"], before = group[key], _state(engine)
        if rank == 1 and when == "before":
            group[key] = value
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        if rank == 1 and when == "between":
            group[key] = value
        try:
            engine.step()
        except offload.StepFailedError as e:
            result["error"] = str(e.__cause__)
        after = _state(engine)
        result["kept"] = engine.global_step == 1 and all(
            torch.equal(after[k], v) for k, v in before.items())
        group[key] = value  # now on every rank: the step's micro-batch again
        result["stepped"] = _train(engine, rank, 1) and _train(engine, rank, 2)
        result["trained"] = _state(engine)
    with offload.initialize(_Masked({}), _cfg(d, rank)) as engine:
        assert _train(engine, rank, 0)
        engine.optimizer.param_groups[0][key] = value
        assert _train(engine, rank, 1) and _train(engine, rank, 2)
        result["reference"] = _state(engine)
    return result


@pytest.mark.parametrize("key,when", [
    ("lr", "before"), ("betas", "before"), ("lr", "between"),
    *(pytest.param(k, "before", marks=pytest.mark.slow) for k in ("eps", "weight_decay"))])
def test_a_hyper_parameter_written_on_one_rank_fails_the_step_on_every_rank(
        tmp_path, key, when):
    """An lr (betas, eps, weight_decay) written on rank 1 only trained rank 0's elements
    at one value and rank 1's at another, silently. Now the step fails on both, naming
    the group, the key and each rank's value, every partition as before it; with the
    value written on both, the step's micro-batch trains as if both had written it
    together (the same weights on every rank)."""
    results = _run(tmp_path, "values", key, when)
    old = results[0]["old"]
    shown = repr(tuple(map(float, old)) if key == "betas" else float(old))
    for r in results:
        assert r["error"].startswith(
            f"param_groups[0][{key!r}] differs between ranks: rank 0 has {shown}, rank 1 "
            f"has {_VALUES[key][1]}; each rank updates its own partitions with its own "
            "values, so every rank's step failed and is undone"), r["error"]
        assert r["kept"] and r["stepped"]
        for k, v in r["reference"].items():
            assert torch.equal(r["trained"][k], v), k
            assert torch.equal(results[0]["trained"][k], v), k


def test_values_equal_as_numbers_are_equal_between_ranks():
    """A weight decay of 0.0 on one rank and -0.0 on another updates alike; compared as
    text they failed every step."""
    from offload.engine.hyper_watch import _compared

    one, other = (0.01, 0.9, 0.999, 1e-8, 0.0, None), (0.01, 0.9, 0.999, 1e-8, -0.0, None)
    assert repr(_compared(one)) == repr(_compared(other))
