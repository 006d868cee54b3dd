"""Two ranks under torch.distributed (gloo) train like one process on the whole batch."""

import os

import pytest
import torch

from .models import TiedTwice, lm_batches, lm_loss
from .ranks import gloo_group, spawn

pytestmark = pytest.mark.distributed

STEPS = 5


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = TiedTwice()
        engine = offload.initialize(model, cfg)
        for x, y in lm_batches(STEPS, batch=8):
            half = x.shape[0] // world
            xs, ys = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
            engine.backward(lm_loss(engine(xs), ys))
            engine.step()
        sd = engine.state_dict()
        # each rank kept only its share of every group
        mine = sum(engine.store.info(("p", g.gid)).numel for g in engine.groups)
        total = sum(g.padded for g in engine.groups)
        if rank == 0:
            torch.save({"sd": sd, "mine": mine, "total": total}, out)
        engine.close()


@pytest.mark.parametrize("params,optimizer", [  # device: 3.5 s, and nvme covers the partitions
    pytest.param("device", "host", marks=pytest.mark.slow), ("nvme", "nvme")])
def test_two_ranks_match_single_process(tmp_path, engine_cfg, params, optimizer):
    cfg = engine_cfg(params, "host", optimizer)
    out = str(tmp_path / "rank0.pt")
    spawn(_worker, str(tmp_path / "init"), out, cfg)
    res = torch.load(out)
    assert res["mine"] * 2 == res["total"]
    torch.manual_seed(0)
    ref = TiedTwice()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in lm_batches(STEPS, batch=8):
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    # Summing a split batch in another order moves fp32 gradients by an ulp or so;
    # Adam's normalisation can grow that for near-zero gradients: ~1e-6, not more.
    for k, v in ref.state_dict().items():
        diff = (res["sd"][k] - v).abs()
        assert diff.max() < 1e-5 and diff.mean() < 1e-6, (k, diff.max(), diff.mean())
    assert not [f for f in os.listdir(tmp_path / "swap") if f.endswith(".swap")]


def _sometimes_worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload

    from .test_numbers import Sometimes, _data
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        engine = offload.initialize(Sometimes(), cfg)
        for step, (x, y) in enumerate(_data(STEPS)):
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            use_b = rank == 0 and step % 2 == 1  # only rank 0 runs `b`, every other step
            engine.backward(torch.nn.functional.mse_loss(engine(xs, use_b), ys))
            engine.step()
        sd = engine.state_dict()
        if rank == 0:
            torch.save(sd, out)
        engine.close()


@pytest.mark.parametrize("params,optimizer", [
    pytest.param("device", "host", marks=pytest.mark.slow), ("nvme", "nvme")])
def test_two_ranks_parameters_used_by_one_rank_and_param_groups(tmp_path, engine_cfg, params,
                                                                optimizer):
    """One group holds every parameter; `b` runs on rank 0 only and `never` on no rank:
    `b` is updated (its mean gradient exists, as under DDP), `never` is untouched;
    biases and the norm train without weight decay (optim.param_groups)."""
    from .test_numbers import Sometimes, _data
    cfg = engine_cfg(params, "host", optimizer, group_size=100_000)
    cfg["optim"]["param_groups"] = [{"params": ["*.bias", "norm.*"], "weight_decay": 0.0}]
    out = str(tmp_path / "rank0.pt")
    spawn(_sometimes_worker, str(tmp_path / "init"), out, cfg)
    sd = torch.load(out)
    torch.manual_seed(0)
    ref = Sometimes()
    no_decay = [p for n, p in ref.named_parameters() if n.endswith("bias") or n.startswith("norm")]
    rest = [p for p in ref.parameters() if not any(p is q for q in no_decay)]
    opt = torch.optim.AdamW([{"params": rest}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.1, fused=True)
    for step, (x, y) in enumerate(_data(STEPS)):
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(ref(xs, r == 0 and step % 2 == 1), ys)
                  for r, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2)))]
        (sum(losses) / 2).backward()  # the engine averages the ranks' gradients
        opt.step()
    assert torch.equal(sd["never.weight"], ref.never.weight.detach())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def _diverging_worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload

    from .test_numbers import Sometimes, _data
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        engine = offload.initialize(Sometimes(), cfg)
        x, y = _data(1)[0]
        engine.backward(torch.nn.functional.mse_loss(engine(x, True), y))  # the same: fine
        engine.step()
        try:
            engine.backward(torch.nn.functional.mse_loss(engine(x, rank == 0), y))
            msg = "no error"
        except RuntimeError as e:
            msg = str(e)
        torch.save(msg, f"{out}.{rank}")
        engine.close()


@pytest.mark.parametrize("params,optimizer", [pytest.param("device", "host", marks=pytest.mark.slow),
                                              ("nvme", "nvme")])
def test_ranks_running_different_modules_raise_instead_of_hanging(tmp_path, engine_cfg, params,
                                                                  optimizer):
    """Rank 0 runs `b` (its own unit), rank 1 does not: both raise, naming the unit,
    before an all-gather of one pairs with another group's on the other rank."""
    cfg = engine_cfg(params, "host", optimizer, group_size=1200)
    out = str(tmp_path / "msg")
    spawn(_diverging_worker, str(tmp_path / "init"), out, cfg)
    msgs = [torch.load(f"{out}.{r}") for r in range(2)]
    assert "rank 0 runs the forward of unit 'b'" in msgs[0], msgs[0]
    assert "rank 1 runs the forward of unit 'norm'" in msgs[1], msgs[1]
    assert all("same modules in the same order" in m for m in msgs)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.main = torch.nn.Linear(32, 1)
        self.aux = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        return self.main(h), self.aux(h)


def _backward_diverging_worker(rank: int, world: int, init_file: str, out: str,
                               cfg: dict) -> None:
    import offload
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        engine = offload.initialize(_TwoHeads(), cfg)
        main, aux = engine(torch.randn(4, 8))
        try:  # the same forward; rank 1's loss leaves `aux` out of its backward
            engine.backward(main.sum() + (aux.sum() if rank == 0 else 0))
            msg = "no error"
        except RuntimeError as e:
            msg = str(e)
        torch.save(msg, f"{out}.{rank}")
        engine.close()


def _loss_code_raises_worker(rank: int, world: int, init_file: str, out: str, cfg: dict
                             ) -> None:
    import offload
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        nn = torch.nn
        engine = offload.initialize(nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
            nn.Tanh(), nn.Linear(16, 1)), cfg)
        g = torch.Generator().manual_seed(rank)
        errors = []
        # rank 1 loses one batch more (its next forward meets rank 0's backward)
        for i in range(4 + rank):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            try:
                out_ = engine(x)
                if i == 1 and rank == 1:
                    raise ValueError("the loss code raised on rank 1")
                engine.backward(torch.nn.functional.mse_loss(out_, y))
                engine.step()
            except (RuntimeError, ValueError) as e:
                errors.append((i, str(e)))
        torch.save({"errors": errors, "steps": engine.global_step,
                    "sd": engine.state_dict(rank0_only=False)}, f"{out}.{rank}")
        engine.close()


def test_a_rank_whose_loss_code_raised_meets_the_others_backward_at_a_check(tmp_path,
                                                                           engine_cfg):
    """Rank 1's loss code raises after its forward; it goes on to its next forward while
    rank 0 runs the backward. gloo aborted rank 1's process (a backward's first
    all-reduce has another size than a forward's check: "Received data size doesn't
    match expected size"); now both raise at a check naming what the other runs,
    drop what they had gathered, and train on together."""
    cfg = engine_cfg("nvme", "nvme", "nvme", group_size=300)
    out = str(tmp_path / "res")
    spawn(_loss_code_raises_worker, str(tmp_path / "init"), out, cfg, timeout_s=60)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    assert [i for i, _ in r0["errors"]] == [1], r0["errors"]
    assert "rank 0 runs a backward" in r0["errors"][0][1]
    assert "rank 1 runs the forward of unit" in r0["errors"][0][1]
    assert [i for i, _ in r1["errors"]] == [1, 2], r1["errors"]
    assert "rank 0 runs a backward" in r1["errors"][1][1]
    assert r0["steps"] == r1["steps"] == 3  # rank 0's batches 0, 2, 3; rank 1's 0, 3, 4
    assert len(r0["sd"]) == 8
    for k, v in r0["sd"].items():
        assert torch.equal(v, r1["sd"][k]), k


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("an autograd function raised on rank 1")


class _MayRaise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.raises: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.raises == "forward":
            raise ValueError("the model raised on rank 1")
        h = torch.tanh(self.b(h))
        if self.raises == "backward":
            h = _Raises.apply(h)
        out = self.c(h)
        if self.raises == "end":  # after the last unit: the others go on to backward
            raise ValueError("the model raised on rank 1")
        return out


def _model_raises_worker(rank: int, world: int, init_file: str, out: str, cfg: dict,
                         where: str, at: int, direct: bool, evaluation: bool) -> None:
    import copy

    import offload
    with gloo_group(rank, world, init_file):
        results = {}
        for run in ("raises", "skips"):
            c = copy.deepcopy(cfg)
            c["io"]["paths"] = [p + f"-{run}-{rank}" for p in cfg["io"]["paths"]]
            torch.manual_seed(0)
            engine = offload.initialize(_MayRaise(), c)
            g = torch.Generator().manual_seed(rank)
            errors = []
            window = c["engine"]["grad_accum_steps"]
            for i in range(6):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                model = engine.module if direct else engine
                if evaluation and run == "raises" and i == at:
                    engine.module.raises = where if rank == 1 else None
                    try:  # an evaluation raises, and the training goes on with this batch
                        with torch.no_grad():
                            model(x)
                    except (RuntimeError, ValueError) as e:
                        errors.append((i, type(e).__name__, str(e)))
                elif not evaluation and run == "skips" and at - at % window <= i <= at:
                    continue  # every rank skips the window so far: what the failure gives
                engine.module.raises = where if (i == at and rank == 1
                                                 and not evaluation) else None
                try:
                    engine.backward(torch.nn.functional.mse_loss(model(x), y))
                    engine.step()
                except (RuntimeError, ValueError) as e:
                    errors.append((i, type(e).__name__, str(e)))
            results[run] = {"errors": errors, "sd": engine.state_dict(rank0_only=False)}
            engine.close()
        torch.save(results, f"{out}.{rank}")


@pytest.mark.parametrize("where,window,direct,thread,evaluation", [
    ("forward", 1, False, False, False), ("backward", 1, False, False, False),
    ("end", 2, False, False, False), ("end", 2, True, False, False),
    ("forward", 1, False, True, False), ("backward", 1, False, True, False),
    ("end", 1, False, False, True), ("end", 2, True, False, True)])
def test_a_rank_whose_model_raised_stops_the_others_at_their_next_check(tmp_path, engine_cfg,
                                                                       where, window, direct,
                                                                       thread, evaluation):
    """Rank 1's model raises in its forward (or an autograd function in its backward).
    The others went on to their next check and met rank 1's next pass there, each
    blaming control flow, and rank 1 lost a second batch; now they learn at that
    check that rank 1 raised, undo their pass, and the ranks train on together: the
    same weights as a run in which every rank skipped that batch. With gradient
    accumulation, every rank drops the window's gradients so far (the others' steps
    once came a micro-batch early, and paired with rank 1's next forward: a hang).
    `direct`: the model called directly (`engine.module(x)`), not through the engine;
    `thread`: the all-gathers issued from the gather thread, over their own group (the
    rank that raised issued no more of them than the others). `evaluation`: rank 1's model
    raised after its last unit in a forward under torch.no_grad, which no backward's
    check follows: the others' next training forward failed in its place, and the ranks
    trained on a batch apart; now every rank's evaluation raises, and no batch is lost."""
    cfg = engine_cfg("nvme", "nvme", "nvme", group_size=300, grad_accum_steps=window)
    cfg["comm"] = {"gather_thread": thread}
    out = str(tmp_path / "res")
    at = 3 if window == 2 else 2  # the second micro-batch of a window
    spawn(_model_raises_worker, str(tmp_path / "init"), out, cfg, where, at, direct,
          evaluation, timeout_s=60)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    assert [e[:2] for e in r1["raises"]["errors"]] == [(at, "ValueError")], r1["raises"]
    (i, kind, msg), = r0["raises"]["errors"]
    assert (i, kind) == (at, "RankOrderError"), r0["raises"]
    assert msg.startswith("rank 1 raised in its model's forward or backward"), msg
    for r in (r0, r1):
        assert r["skips"]["errors"] == []
        for k, v in r["skips"]["sd"].items():
            assert torch.equal(r["raises"]["sd"][k], v), k


@pytest.mark.parametrize("group_size", [100, pytest.param(100_000, marks=pytest.mark.slow)],
                         ids=["unit-each", "one-unit"])
def test_ranks_whose_backward_differs_raise_instead_of_hanging(tmp_path, engine_cfg,
                                                               group_size):
    """The same forward on both ranks, but rank 1's loss does not use `aux`'s output.
    Where `aux` is a unit of its own, rank 1's backward skips it: both ranks raise,
    naming what they run. Inside one unit that is allowed: no error."""
    cfg = engine_cfg("device", "host", "host", group_size=group_size)
    out = str(tmp_path / "msg")
    spawn(_backward_diverging_worker, str(tmp_path / "init"), out, cfg)
    msgs = [torch.load(f"{out}.{r}") for r in range(2)]
    for r, m in enumerate(msgs):
        if group_size == 100:
            assert f"rank {r} runs the " in m and "same modules in the same order" in m, m
        else:
            assert m == "no error", m


class _Calls(torch.nn.Module):
    """A Linear that runs `hook` (once) inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.hook = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self.lin(h)


def _refused_worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import threading

    import offload
    nn = torch.nn
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), _Calls(), nn.Linear(16, 4))
        engine = offload.initialize(model, cfg)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        said = []

        def metrics() -> None:  # another thread's model call, during rank 0's forward
            try:
                model(x)
            except Exception as e:  # noqa: BLE001 - reported to the test
                said.append(type(e).__name__)
        if rank == 0:
            model[1].hook = lambda: [t := threading.Thread(target=metrics), t.start(), t.join()]
        steps = []
        for _ in range(2):
            try:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                steps.append(engine.step())
            except RuntimeError as e:
                steps.append(str(e))
        torch.save({"said": said, "steps": steps}, f"{out}.{rank}")
        engine.close()


def test_a_call_refused_on_another_thread_leaves_the_ranks_forward_alone(tmp_path, engine_cfg):
    """A metrics thread's model call on rank 0, refused during its training forward
    (EngineBusyError, which changes nothing): its root hook still marked rank 0's forward
    as one without autograd, which then ended with an evaluation's check the other rank
    never ran, and the step failed on both ranks."""
    out = str(tmp_path / "res")
    spawn(_refused_worker, str(tmp_path / "init"), out,
          engine_cfg("host", "host", "host", group_size=200), timeout_s=60)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    assert r0["said"] == ["EngineBusyError"]
    assert r0["steps"] == r1["steps"] == [True, True], (r0, r1)
