"""Two ranks (gloo processes) in flows a DDP or FSDP user brings along: per-rank seeds
before the model is built, the model built on rank 0 only (meta elsewhere), weights
read on rank 0 only, micro-batches of uneven sizes with accumulation, parameter
groups, a scheduler and clipping, and a checkpoint resumed on two ranks and on one."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import offload

from .ranks import spawn

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10  # the process group's: a collective left unpaired fails the test quickly
SIZES = (3, 5)  # each rank's micro-batch size: uneven
ACCUM = 2


def _cfg(swap: str, place: str = "host", **optim) -> dict:
    return {"engine": {"params": place, "grads": place, "optimizer": place, "dtype": "fp32",
                       "group_size": 5000, "grad_accum_steps": ACCUM},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096, **optim},
            "io": {"paths": [swap], "buffer_budget": "8MiB", "grow_step": "256KiB",
                   "stripe_size": "256KiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}


def _model(seed: int = 0) -> nn.Module:
    """4160 elements in the middle layer: each rank holds part of its group."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def _steps(n: int, seed: int = 1) -> list:
    """steps[s][micro][rank] = (x, y), rank r's micro-batch holding SIZES[r] rows."""
    g = torch.Generator().manual_seed(seed)
    return [[[(torch.randn(k, 8, generator=g), torch.randn(k, 1, generator=g)) for k in SIZES]
             for _ in range(ACCUM)] for _ in range(n)]


def _groups(names: list[str]) -> list[dict]:
    return [{"params": [n for n in names if n.endswith("bias")], "weight_decay": 0.0},
            {"params": ["4.weight"], "lr": 3e-3}]


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _group(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _train(engine, steps, rank: int | None) -> list:
    """Each step's micro-batches (rank None: one process on every rank's rows, each
    row weighted so its loss is the mean over ranks of their mean losses, as DDP
    averages); returns engine.grad_norm after each step."""
    norms = []
    for micro in steps:
        for per_rank in micro:
            if rank is None:
                x, y = (torch.cat(t) for t in zip(*per_rank))
                w = torch.cat([torch.full((k, 1), 1.0 / (k * len(SIZES))) for k in SIZES])
                engine.backward(((engine(x) - y) ** 2 * w).sum())
            else:
                x, y = per_rank[rank]
                engine.backward(nn.functional.mse_loss(engine(x), y))
        assert engine.step()
        norms.append(engine.grad_norm)
    return norms


def _torch(steps, clip: float) -> tuple[dict, list]:
    """DDP's numbers: AdamW with the same groups and schedule, the gradient the mean over
    ranks and micro-batches, clip_grad_norm_ over the whole model."""
    m = _model()
    named = dict(m.named_parameters())
    groups = [{**g, "params": [named.pop(n) for n in g["params"]]} for g in _groups(list(named))]
    opt = torch.optim.AdamW(groups + [{"params": list(named.values())}], lr=1e-2,
                            weight_decay=0.1)
    sched, norms = _schedule(opt), []
    for micro in steps:
        opt.zero_grad()
        for per_rank in micro:
            for x, y in per_rank:
                (nn.functional.mse_loss(m(x), y) / (ACCUM * len(SIZES))).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        opt.step()
        sched.step()
    return m.state_dict(), norms


# -- different initial weights per rank ---------------------------------------------------
def _seeded_worker(rank: int, world: int, init_file: str, d: str, how: str) -> None:
    _group(rank, world, init_file)
    try:
        if how == "seeded":  # torch.manual_seed(seed + rank) before building the model
            model = _model(seed=rank)
        else:  # FSDP's sync_module_states habit: real weights on rank 0, meta elsewhere
            with torch.device("cpu" if rank == 0 else "meta"):
                model = _model(seed=7)  # meta: made from engine.seed (0), not these
        with offload.initialize(model, _cfg(os.path.join(d, f"swap{rank}"))) as e:
            first = e.state_dict(rank0_only=False)
            _train(e, _steps(1), rank)
            torch.save({"first": first, "after": e.state_dict(rank0_only=False)},
                       os.path.join(d, f"{how}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["seeded", "meta"])
def test_ranks_with_different_initial_weights_all_train_rank_zeros(tmp_path, how):
    """DDP broadcasts rank 0's parameters; each rank used to keep its slice of its own
    weights, so the model trained was a mix that no rank built ('2.weight' half one
    rank's, half the other's)."""
    spawn(_seeded_worker, str(tmp_path / "init"), str(tmp_path), how)
    r0, r1 = (torch.load(tmp_path / f"{how}{r}.pt") for r in range(2))
    for k, v in _model(seed=0 if how == "seeded" else 7).state_dict().items():
        assert torch.equal(r0["first"][k], v), k
        assert torch.equal(r1["first"][k], v), k
        assert torch.equal(r0["after"][k], r1["after"][k]), k


# -- whole weights read on rank 0 only ------------------------------------------------------
def _rank0_only_worker(rank: int, world: int, init_file: str, d: str, what: str) -> None:
    _group(rank, world, init_file)
    error = None
    try:
        with offload.initialize(_model(), _cfg(os.path.join(d, f"swap{rank}"))) as e:
            try:
                for step in _steps(2):
                    _train(e, [step], rank)
                    if rank == 0:  # as a DDP loop saves
                        if what == "state_dict":
                            torch.save(e.state_dict(), os.path.join(d, "sd.pt"))
                        elif what == "save_pretrained":
                            e.save_pretrained(os.path.join(d, "export"))
                        else:
                            with e.full_weights() as w:
                                w["0.weight"].sum()
            except RuntimeError as ex:
                error = str(ex)
    finally:
        torch.save(error, os.path.join(d, f"err{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.parametrize("what", ["state_dict", pytest.param("save_pretrained", marks=pytest.mark.slow),
                                  pytest.param("full_weights", marks=pytest.mark.slow)])
def test_weights_read_on_rank_zero_only_raise_on_both_ranks(tmp_path, what):
    """Under DDP `if rank == 0: torch.save(model.state_dict())` works; here the read is a
    collective. It used to pair rank 0's all-gathers with rank 1's next forward and
    wait for the process group's timeout (30 min by default) with gloo's 'Timed out
    waiting ... for send operation'; now both ranks raise at once, rank 0 saying to
    call it on every rank."""
    spawn(_rank0_only_worker, str(tmp_path / "init"), str(tmp_path), what)
    e0, e1 = (torch.load(tmp_path / f"err{r}.pt") for r in range(2))
    assert e0 is not None and "not under `if rank == 0`" in e0, e0
    assert e1 is not None and "another rank runs something else" in e1, e1


# -- parity with DDP: uneven micro-batches, accumulation, groups, schedule, clipping --------
def _parity_worker(rank: int, world: int, init_file: str, d: str, place: str, clip: float
                   ) -> None:
    _group(rank, world, init_file)
    try:
        model = _model()
        with offload.initialize(model, _cfg(os.path.join(d, "swap"), place, max_grad_norm=clip),
                                param_groups=_groups([n for n, _ in model.named_parameters()]),
                                lr_scheduler=_schedule) as e:
            norms = _train(e, _steps(3), rank)
            torch.save({"sd": e.state_dict(rank0_only=False), "norms": norms,
                        "lr": [g["lr"] for g in e.optimizer.param_groups]},
                       os.path.join(d, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("place", [pytest.param("host", marks=pytest.mark.slow), "nvme"])
def test_uneven_accumulated_micro_batches_with_groups_schedule_and_clipping_match_ddp(
        tmp_path, place):
    clip = 0.05  # below every step's norm: each step clips
    spawn(_parity_worker, str(tmp_path / "init"), str(tmp_path), place, clip)
    want, norms = _torch(_steps(3), clip)
    for r in range(2):
        got = torch.load(tmp_path / f"r{r}.pt")
        for k, v in want.items():
            torch.testing.assert_close(got["sd"][k], v, atol=1e-6, rtol=0, msg=k)
        assert got["norms"] == pytest.approx(norms, rel=1e-5)  # clip_grad_norm_'s return
        # optimizer group 0 is the optim section's (parameters no group names), then
        # the given groups in order; torch's last group here is that default group
        assert got["lr"] == pytest.approx([1e-2 / 4, 1e-2 / 4, 3e-3 / 4])


# -- a checkpoint of two ranks with their own data, resumed on two and on one -------------
def _checkpoint_worker(rank: int, world: int, init_file: str, d: str, mode: str) -> None:
    _group(rank, world, init_file)
    try:
        steps, cfg = _steps(4), _cfg(os.path.join(d, f"swap-{mode}"), max_grad_norm=0.05)
        resume = None if mode == "save" else os.path.join(d, "ck")
        with offload.initialize(_model(), cfg, resume=resume, lr_scheduler=_schedule) as e:
            if mode == "save":
                _train(e, steps[:2], rank)
                e.save_checkpoint(os.path.join(d, "ck"))
            _train(e, steps[2:], rank if world > 1 else None)
            torch.save(e.state_dict(rank0_only=False), os.path.join(d, f"{mode}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # the default suite's time: test_checkpoint_reshard covers 2 -> 1 ranks
def test_two_rank_checkpoint_continues_on_two_ranks_and_on_one(tmp_path):
    d = str(tmp_path)
    for mode, world in [("save", 2), ("two", 2), ("one", 1)]:
        spawn(_checkpoint_worker, str(tmp_path / f"init-{mode}"), d, mode, world=world)
    want = torch.load(tmp_path / "save0.pt")
    for name in ["save1", "two0", "two1"]:  # the same ranks on the same rows: bit for bit
        got = torch.load(tmp_path / f"{name}.pt")
        for k, v in want.items():
            assert torch.equal(got[k], v), (name, k)
    got = torch.load(tmp_path / "one0.pt")  # every row in one batch: sums in another order
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)


# -- buffers that differ between ranks -------------------------------------------------------
def _buffer_worker(rank: int, world: int, init_file: str, d: str) -> None:
    _group(rank, world, init_file)
    try:
        model = _model()
        model[1].register_buffer("shift", torch.full((64,), float(rank)))  # made per rank
        model[1].register_buffer("mask", torch.tensor([float("nan"), 1.0]))  # the same
        model[1].forward = lambda x, m=model[1]: torch.tanh(x + m.shift)
        mask = model[1].mask
        with offload.initialize(model, _cfg(os.path.join(d, f"swap{rank}"))) as e:
            out = _train(e, _steps(1), rank)
            torch.save({"shift": model[1].shift.clone(), "mask_kept": model[1].mask is mask,
                        "sd": e.state_dict(rank0_only=False), "out": out},
                       os.path.join(d, f"buf{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_buffers_that_differ_between_ranks_are_rank_zeros(tmp_path):
    """DDP broadcasts rank 0's buffers as it does its parameters; each rank kept its own,
    so ranks computed with different masks or statistics. A buffer already the same on
    every rank (NaN included) keeps its tensor."""
    spawn(_buffer_worker, str(tmp_path / "init"), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"buf{r}.pt") for r in range(2))
    assert torch.equal(r0["shift"], torch.zeros(64)) and torch.equal(r1["shift"], r0["shift"])
    assert r0["mask_kept"] and r1["mask_kept"]
    for k in r0["sd"]:
        torch.testing.assert_close(r0["sd"][k], r1["sd"][k], rtol=0, atol=0, equal_nan=True)


# -- freezing after initialize on two ranks ----------------------------------------------
def _freeze_worker(rank: int, world: int, init_file: str, d: str) -> None:
    _group(rank, world, init_file)
    try:
        with offload.initialize(_model(), _cfg(os.path.join(d, f"swap{rank}"))) as e:
            steps = _steps(3)
            _train(e, steps[:1], rank)
            before = e.state_dict(rank0_only=False)
            if rank == 0:  # an adapter added on one rank only: that rank refuses alone
                e.module.add_module("extra", nn.Linear(1, 1))
            added = None
            try:
                _train(e, steps[1:2], rank)
            except RuntimeError as ex:
                added = str(ex)
            if rank == 0:
                del e.module.extra
            e.module[4].requires_grad_(rank == 1)  # a whole group frozen on rank 0 only
            error = None
            try:
                _train(e, steps[1:2], rank)
            except RuntimeError as ex:
                error = str(ex)
            assert e.step() is False  # the failed step's micro-batches were dropped
            same = all(torch.equal(v, before[k]) for k, v in e.state_dict(rank0_only=False).items())
            e.module[4].requires_grad_(True)
            e.module[2].bias.requires_grad_(False)  # on every rank: trains as torch
            _train(e, steps[1:], rank)
            torch.save({"added": added, "error": error, "same": same,
                        "sd": e.state_dict(rank0_only=False)},
                       os.path.join(d, f"f{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_freezing_on_some_ranks_only_raises_on_all_and_on_all_trains_as_ddp(tmp_path):
    """[Note: freezing after initialize] An adapter added on one rank only is refused on
    that rank and, instead of a wait for it, on the other. A layer frozen on one rank
    only would have
    left the other rank's reduction of its group unpaired (a hang until the process
    group's timeout), and a parameter of a group train on one rank's gradient
    averaged with zeros: every rank raises before the backward, naming it, and the
    step changes nothing. Frozen on both, the steps match DDP's (torch's AdamW
    skipping the frozen bias)."""
    spawn(_freeze_worker, str(tmp_path / "init"), str(tmp_path))
    steps = _steps(3)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for s, micro in enumerate(steps):
        if s == 1:
            m[2].bias.requires_grad_(False)
        opt.zero_grad()
        for per_rank in micro:
            for x, y in per_rank:
                (nn.functional.mse_loss(m(x), y) / (ACCUM * len(SIZES))).backward()
        opt.step()
    for r in range(2):
        got = torch.load(tmp_path / f"f{r}.pt")
        assert got["error"] is not None and "'4.weight' is frozen" in got["error"], got["error"]
        # the other rank used to wait in the frozen flags' sum until the timeout
        assert ("'extra.weight' was added" if r == 0 else "1 other rank(s) refused") in \
            (got["added"] or ""), got["added"]
        assert got["same"]
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got["sd"][k], v, atol=1e-6, rtol=0, msg=k)
