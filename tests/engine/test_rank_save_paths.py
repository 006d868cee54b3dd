"""[Note: one directory for every rank] in offload/engine/training_checkpoint.py: ranks
that give one checkpoint name under different directories (a per-node local
directory) are refused on every rank, naming the ranks' paths, with nothing left
behind; the same directory on every rank saves. Two gloo processes on one machine;
for ranks on two machines, rank 1 reports another boot id."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .ranks import spawn

pytestmark = pytest.mark.distributed


def _model() -> nn.Module:
    """Wide enough that rank 1's partitions hold parameters, not padding only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def _train(engine, rank: int, seed: int) -> bool:
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    return engine.step()


def _entries(root: str) -> list[str]:
    """Every directory and file under `root`."""
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, dirs, files in os.walk(root) for f in dirs + files)


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict, root: str) -> None:
    import offload
    import offload.engine.training_checkpoint as saving
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    got: dict = {}

    def save(case: str, path: str, blocking: bool = True) -> None:
        try:
            engine.save_checkpoint(path, blocking=blocking).wait()
            got[case] = "saved"
        except offload.CheckpointError as e:
            got[case] = str(e)
        dist.barrier()
        got[case + " left"] = _entries(root)

    try:
        cfg = {**cfg, "io": {**cfg["io"], "paths": [cfg["io"]["paths"][0] + str(rank)]}}
        with offload.initialize(_model(), cfg) as engine:
            assert _train(engine, rank, 0)
            save("one machine", f"{root}/node{rank}/ck")
            if rank == 1:  # as if on another machine: paths there may differ
                saving.this_host = lambda: "boot:another-machine"
            save("two machines", f"{root}/node{rank}/ck")
            save("two machines, in the background", f"{root}/node{rank}/ck-bg", False)
            save("one directory", f"{root}/same/ck")
            got["trains"] = _train(engine, rank, 1)
            got["step"] = engine.global_step
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_saving_into_directories_of_their_own_are_refused_on_every_rank(tmp_path,
                                                                               engine_cfg):
    """One name under node0/ and node1/: rank 1 wrote its chunks into a node1/.ck.partial
    nobody published or removed and failed at its rank file (FileNotFoundError), naming
    neither directory, and rank 0 said only that another rank failed. On one machine it
    is refused before anything is written; across machines (where paths may differ,
    since nodes mount a shared file system at their own places) once rank 0 made the
    partial directory that rank 1 does not see, which rank 0 removes."""
    root = tmp_path / "ckpts"
    root.mkdir()
    cfg = engine_cfg("host", "host", "nvme", group_size=200)
    cfg["io"]["paths"] = [str(tmp_path / "swap")]
    out = str(tmp_path / "res")
    spawn(_worker, str(tmp_path / "init"), out, cfg, str(root), timeout_s=120)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in (0, 1):
        assert got[r]["one machine"] == (
            f"save_checkpoint: ranks 0 and 1, on one machine, gave paths of different "
            f"directories (rank 0: {root}/node0/ck, rank 1: {root}/node1/ck); every rank "
            "writes its part into one checkpoint directory: give every rank the path of the "
            "same directory, on a file system every machine of the job mounts (its mount "
            "point may differ between machines); nothing was written"), got[r]
        assert got[r]["one machine left"] == []
        for case, name in (("two machines", "ck"), ("two machines, in the background",
                                                    "ck-bg")):
            assert got[r][case].startswith(
                f"save_checkpoint: rank 1 does not see the directory rank 0 is writing the "
                f"checkpoint into (rank 0: {root}/node0/{name}, rank 1: {root}/node1/{name}): "
                "each machine saved to a directory of its own; every rank writes its part "
                "into one checkpoint directory"), (case, got[r])
            # the parent rank 0 made stays, empty
            assert got[r][case + " left"] == ["node0"], (case, got[r])
        assert got[r]["one directory"] == "saved" and got[r]["trains"] and got[r]["step"] == 2
    assert (root / "same" / "ck" / "checkpoint.json").is_file()
