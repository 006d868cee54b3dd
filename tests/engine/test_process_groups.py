"""Process groups an engine makes for itself (the gather thread's, background saves',
tensor parallelism's mesh) are freed when it closes: a job that makes engines, or saves, again and again does
not pile up communicators (sockets and threads with gloo, GPU memory with NCCL)."""

import os

import pytest
import torch
import torch.distributed as dist

from .ranks import process_group, spawn

pytestmark = pytest.mark.distributed


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _worker(rank: int, world: int, init_file: str, d: str) -> None:
    import offload
    with process_group(rank, world, init_file):
        before = _groups()
        counts = []
        for run in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
            cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "host",
                              "group_size": 300},
                   "comm": {"gather_thread": True},
                   "io": {"paths": [os.path.join(d, f"swap-{rank}")], "buffer_budget": "8MiB",
                          "grow_step": "4MiB"},
                   "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
            with offload.initialize(model, cfg) as engine:
                for i in range(3):
                    engine.backward(engine(torch.randn(4, 16)).sum())
                    engine.step()
                    engine.save_checkpoint(os.path.join(d, f"run{run}-{i}"), blocking=False)
                engine.wait_for_checkpoint()
            counts.append(_groups())
        from offload.cli.gpt import GPT, GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab=64, max_seq=16))
        cfg["tp"] = {"size": 2}  # the mesh's DP and TP groups
        del cfg["comm"]
        with offload.initialize(model, cfg) as engine:
            x = torch.randint(0, 64, (2, 8))
            engine.backward(engine(x).float().square().mean())
            engine.step()
        counts.append(_groups())
        assert counts == [before] * 3, (before, counts)


def test_an_engines_own_groups_are_freed_when_it_closes(tmp_path):
    spawn(_worker, str(tmp_path / "init"), str(tmp_path))


def _destroy_worker(rank: int, world: int, init_file: str) -> None:
    from offload.comm.collectives import Collectives
    from offload.comm.mesh import _destroy_each
    with process_group(rank, world, init_file):
        before = _groups()
        groups = [Collectives(dist.new_group([0])) for _ in range(3)]
        dist.destroy_process_group(groups[1].group)  # destroying it again raises
        assert _groups() == before + 2
        with pytest.raises(ValueError, match="Invalid process group"):
            _destroy_each(*groups)
        # the group after the one that failed is freed too
        assert _groups() == before and all(g.group is None for g in groups)


def test_a_mesh_frees_every_group_when_one_fails_to_be_destroyed(tmp_path):
    spawn(_destroy_worker, str(tmp_path / "init"), world=1)
