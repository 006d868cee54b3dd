"""[Note: ranks agree at initialize]: ranks given different configs or models are refused
on every rank, naming what differs, before any swap file is made; a check that refuses
on one rank stops every rank; the free-space check counts every rank that swaps to a
file system, whatever launched them ([Note: ranks sharing a disk]). Two gloo processes
started by torch.multiprocessing (no LOCAL_WORLD_SIZE unless a test sets one)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .ranks import spawn

pytestmark = pytest.mark.distributed

HANG_S = 60  # a launch that takes longer has hung: the test fails instead of blocking


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "wide":
        return nn.Sequential(nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 1))
    if kind == "disk":  # 263k parameters: 1.6 MB per rank of NVMe state (fp32, 2 ranks)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _cfg(swap: str, **engine) -> dict:
    return {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme", "dtype": "fp32",
                       "group_size": 70000, **engine},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
            "io": {"paths": [swap], "buffer_budget": "8MiB", "grow_step": "256KiB",
                   "stripe_size": "256KiB"},
            "store": {"host_budget": "16MiB", "device_budget": "16MiB", "device": "cpu"}}


def _worker(rank: int, world: int, init_file: str, out: str, cfgs: list, models: list,
            local_world_size: str | None, steps: int, lrs: list | None = None) -> None:
    import offload
    if local_world_size is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = local_world_size
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_S // 2))
    result = {"error": None, "state": None}
    try:
        try:
            model = _model(models[rank])
            groups = None if lrs is None else [{"params": list(model.parameters()),
                                                "lr": lrs[rank]}]  # given in code
            engine = offload.initialize(model, cfgs[rank], param_groups=groups)
        except Exception as e:
            result["error"] = (type(e).__name__, str(e))
        else:
            g = torch.Generator().manual_seed(rank)
            for _ in range(steps):
                x = torch.randn(4, engine.module[0].in_features, generator=g)
                engine.backward(engine(x).square().mean())
                assert engine.step()
            result["state"] = engine.state_dict(rank0_only=False)
            engine.close()
        result["swap"] = sorted(f for p in cfgs[rank]["io"]["paths"] if os.path.isdir(p)
                                for f in os.listdir(p))
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _run(tmp_path, cfgs: list, models=("narrow", "narrow"), local_world_size=None,
         steps: int = 0, lrs: list | None = None) -> list[dict]:
    """Each rank's {"error": (type, message) or None, "swap": files left, "state"};
    `lrs`: each rank's learning rate, given in code (`param_groups=`)."""
    out = str(tmp_path / "result")
    spawn(_worker, str(tmp_path / "init"), out, cfgs, list(models), local_world_size, steps,
          lrs, timeout_s=HANG_S)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def _swap_dirs(tmp_path) -> list[str]:
    return [str(tmp_path / f"swap{r}") for r in range(2)]


@pytest.mark.parametrize("what", [pytest.param("engine.dtype", marks=pytest.mark.slow),
                                  "optim.lr", "param_groups"])
def test_a_setting_that_differs_is_refused_on_every_rank_before_any_swap_file(tmp_path, what):
    """The compute dtype, a learning rate in the config, or one given in code: each rank
    would train its own shard its own way."""
    a, b = _swap_dirs(tmp_path)
    cfgs, lrs = [_cfg(a), _cfg(b)], None
    if what == "engine.dtype":
        cfgs[1]["engine"]["dtype"] = "bf16"
        want = ("engine.dtype differs between ranks: rank 0 has 'fp32', rank 1 has 'bf16'; "
                "give every rank the same config")
    elif what == "optim.lr":
        cfgs[1]["optim"]["lr"] = 1e-4
        want = "optim.lr differs between ranks: rank 0 has 0.01, rank 1 has 0.0001"
    else:
        lrs = [1e-2, 1e-4]
        want = ("the model differs between ranks: parameter '0.weight' has optimizer settings "
                "lr=0.01 on rank 0 and lr=0.0001 on rank 1")
    for r in _run(tmp_path, cfgs, lrs=lrs):
        assert r["error"] == ("ConfigError", r["error"][1])
        assert r["error"][1].startswith(want), r["error"][1]
        assert r["swap"] == []
    assert not os.path.exists(a) and not os.path.exists(b)


def test_a_model_of_another_width_is_refused_on_every_rank_naming_the_parameter(tmp_path):
    a, b = _swap_dirs(tmp_path)
    results = _run(tmp_path, [_cfg(a), _cfg(b)], models=("narrow", "wide"))
    for r in results:
        assert r["error"] == (
            "ConfigError", "the model differs between ranks: parameter '0.weight' has shape "
            "(32, 8) on rank 0 and (40, 8) on rank 1; build the same model on every rank")
        assert r["swap"] == []


def test_a_check_that_refuses_on_one_rank_stops_every_rank(tmp_path):
    a, b = _swap_dirs(tmp_path)
    small = _cfg(b)
    small["store"]["host_budget"] = "4KiB"  # budgets may differ between ranks; too small here
    results = _run(tmp_path, [_cfg(a), small])
    assert results[1]["error"][0] == "ConfigError"
    assert results[1]["error"][1].startswith("store.host_budget: 4.0 KiB")
    assert results[0]["error"][0] == "ConfigError"
    assert results[0]["error"][1].startswith(
        "initialize: rank 1 refused, so every rank stops (what each made is removed): "
        "store.host_budget: 4.0 KiB")
    assert results[0]["swap"] == [] and results[1]["swap"] == []


def test_a_swap_path_refused_on_one_rank_stops_every_rank_without_waiting(tmp_path):
    """Swap files are opened after the free-space settle: a path (or another job's lock)
    refused on one rank left the other waiting in its first collective for the
    process group's timeout; now both raise at once and rank 0 removes its files."""
    a, _ = _swap_dirs(tmp_path)
    results = _run(tmp_path, [_cfg(a), _cfg("/proc/offload-swap")])
    assert results[1]["error"][0] == "SwapPathError", results[1]["error"]
    assert results[0]["error"][0] == "ConfigError", results[0]["error"]
    assert results[0]["error"][1].startswith("initialize: rank 1 refused, so every rank stops "
                                             "(what each made is removed): ")
    assert "/proc/offload-swap" in results[0]["error"][1]
    assert results[0]["swap"] == []


def test_the_free_space_check_counts_both_ranks_on_a_shared_disk_without_local_world_size(
        tmp_path, small_fs):
    swap = os.path.join(small_fs(4), "swap")  # 2.7 MB free: one rank's 1.6 MB fits, two not
    results = _run(tmp_path, [_cfg(swap), _cfg(swap)], models=("disk", "disk"))
    for r in results:
        assert r["error"][0] == "SwapPathError", r["error"]
        assert "2 rank(s) of this node write there" in r["error"][1]
        assert r["swap"] == []


def test_ranks_with_their_own_paths_and_disks_train_together(tmp_path, small_fs):
    # one disk per rank, as one NVMe drive per GPU: torchrun's LOCAL_WORLD_SIZE (8 on an
    # 8-GPU node) counts ranks of the node, not ranks sharing a disk
    a, b = os.path.join(small_fs(8), "swap"), os.path.join(small_fs(8), "swap")
    mine = _cfg(b)
    mine["io"].update(queue_depth=8, buffer_budget="16MiB")  # I/O tuning may differ
    mine["store"]["host_budget"] = "32MiB"
    results = _run(tmp_path, [_cfg(a), mine], models=("disk", "disk"), local_world_size="8",
                   steps=2)
    assert [r["error"] for r in results] == [None, None]
    s0, s1 = results[0]["state"], results[1]["state"]
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def _resume_worker(rank: int, world: int, init_file: str, d: str) -> None:
    import offload
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_S // 2))
    try:
        cfg = _cfg(os.path.join(d, f"swap{rank}"))
        with offload.initialize(_model("narrow"), cfg) as engine:
            for step in (1, 2):
                engine.backward(engine(torch.randn(4, 8)).square().mean())
                engine.step()
                engine.save_checkpoint(os.path.join(d, f"step-{step}"))
        errors = {}
        for case, path in (("other", f"step-{1 + rank}"),  # rank 1 resumes a later one
                           ("one", "step-2" if rank == 0 else None)):  # rank 1 none
            try:
                offload.initialize(_model("narrow"), cfg, resume=path and os.path.join(d, path))
            except offload.ConfigError as e:
                errors[case] = str(e)
        with offload.initialize(_model("narrow"), cfg, resume=os.path.join(d, "step-2")) as e:
            errors["steps"] = e.global_step  # the same checkpoint on both: resumed
        torch.save(errors, os.path.join(d, f"out.{rank}"))
    finally:
        dist.destroy_process_group()


def test_ranks_resuming_different_checkpoints_are_refused_on_every_rank(tmp_path):
    """Rank 0 resumed step-1 and rank 1 step-2: each trained its shard from another
    state, silently; with rank 1 resuming none, both waited in different collectives
    until the process group's timeout. Both are refused on every rank at once."""
    spawn(_resume_worker, str(tmp_path / "init"), str(tmp_path), timeout_s=HANG_S * 2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.{rank}")
        assert got["other"].startswith("resume differs between ranks: rank 0 has the "
                                       "checkpoint of step 1"), got
        assert "rank 1 has the checkpoint of step 2" in got["other"]
        assert "rank 1 has no resume" in got["one"] and got["steps"] == 2
