"""The groups the engine makes beside the user's (a background save's, the gather
thread's, the tensor-parallel mesh's) keep the timeout the user gave
`init_process_group`: torch gives a new group its own 30-minute default, and a
background save waited that long for a hung rank."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .ranks import spawn

pytestmark = pytest.mark.distributed

TIMEOUT_S = 3


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload
    import offload.engine.training_checkpoint as tc
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        torch.manual_seed(0)
        engine = offload.initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), cfg)
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
        gather = engine._gathers.comm.group._get_backend(torch.device("cpu")).options._timeout
        if rank == 1:  # its disk hangs: its partitions are written after the timeout
            write = tc._write_partitions

            def late(*args, **kwargs):
                time.sleep(TIMEOUT_S + 4)
                return write(*args, **kwargs)
            tc._write_partitions = late
        t0 = time.monotonic()
        try:
            engine.save_checkpoint(f"{out}.ck", blocking=False).wait()
            said = "saved"
        except Exception as e:  # noqa: BLE001 - reported to the test
            said = f"{type(e).__name__}: {e}"
        torch.save({"seconds": time.monotonic() - t0, "said": said,
                    "gather": gather.total_seconds()}, f"{out}.{rank}")
        engine.close()
    finally:
        dist.destroy_process_group()


def test_a_background_save_waits_for_a_hung_rank_no_longer_than_the_users_timeout(
        tmp_path, engine_cfg):
    cfg = engine_cfg("host", "host", "host", group_size=50)
    cfg["comm"] = {"gather_thread": True}
    out = str(tmp_path / "res")
    spawn(_worker, str(tmp_path / "init"), out, cfg, timeout_s=120)
    r0 = torch.load(f"{out}.0")
    assert r0["said"].startswith("CheckpointError"), r0
    assert r0["seconds"] < TIMEOUT_S + 2, r0  # not when rank 1 came (torch's 30 minutes)
    for rank in (0, 1):
        assert torch.load(f"{out}.{rank}")["gather"] == TIMEOUT_S
    assert not (tmp_path / "res.ck").exists()


def _mesh_worker(rank: int, world: int, init_file: str, out: str, swap: str) -> None:
    import offload
    from .test_domino import _config, _model
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        with offload.initialize(_model("gpt"), _config(swap, 2, "host")) as engine:
            mesh = engine.tp.mesh
            torch.save({name: c.group._get_backend(torch.device("cpu")).options._timeout
                        .total_seconds() for name, c in (("dp", mesh.dp), ("tp", mesh.tp))},
                       f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_tensor_parallel_groups_take_the_users_timeout(tmp_path):
    """A rank waited torch's 30-minute default in a TP all-reduce (or the DP group's
    collectives) for a hung rank, where the user's init_process_group said seconds."""
    out = str(tmp_path / "res")
    spawn(_mesh_worker, str(tmp_path / "init"), out, str(tmp_path / "swap"), timeout_s=120)
    for rank in (0, 1):
        assert torch.load(f"{out}.{rank}") == {"dp": TIMEOUT_S, "tp": TIMEOUT_S}
