"""[Note: ranks agree]: with several ranks, a step or a checkpoint that fails on one
rank fails on every rank before any of them commits, and training goes on together
once the cause is removed. Two gloo processes; each failure is real (a flipped byte
in one rank's swap file)."""

import copy
import datetime

import torch
import torch.distributed as dist

from ..conftest import flip_byte
from .models import TiedTwice, lm_batches, lm_loss
from .ranks import spawn

VOCAB = 48


def _train(engine, batch, rank: int, world: int) -> bool:
    x, y = batch
    engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
    return engine.step()


def _state(engine) -> dict:
    out = {"step": engine.global_step, **engine.state_dict(rank0_only=False)}
    for g in engine.groups:
        for k, v in engine.optimizer.partition_state(g.gid).items():
            out[(k, g.gid)] = v.clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload
    from offload.comm import RankFailedError
    from offload.engine.step import StepFailedError
    from offload.io import CorruptionError
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = TiedTwice(vocab=VOCAB)
        batches = lm_batches(4, vocab=VOCAB, batch=8)
        engine = offload.initialize(copy.deepcopy(model), cfg)
        ref = offload.initialize(copy.deepcopy(model), {**cfg, "io": {
            **cfg["io"], "paths": [cfg["io"]["paths"][0] + "-ref"]}})
        assert _train(engine, batches[0], rank, world) and _train(ref, batches[0], rank, world)
        before = _state(engine)
        part = engine.optimizer.partition(0)  # updated last: the others ran first
        path = engine.optimizer._pipeline.swap.paths[0]
        where = part.extents[part.layout.n_chunks - 1].offset + 8
        if rank == 1:
            flip_byte(path, where)
        cause = None
        try:
            _train(engine, batches[1], rank, world)
        except StepFailedError as e:
            chain, c = [], e.__cause__
            while c is not None:
                chain.append(type(c))
                c = c.__cause__
            cause = (CorruptionError in chain) if rank == 1 else (RankFailedError in chain)
        if rank == 1:
            flip_byte(path, where)
        unchanged = _same(_state(engine), before)
        for b in batches[1:]:
            assert _train(engine, b, rank, world) and _train(ref, b, rank, world)
        torch.save({"cause": cause, "unchanged": unchanged,
                    "as_ref": _same(_state(engine), _state(ref))}, f"{out}.{rank}")
        engine.close()
        ref.close()
    finally:
        dist.destroy_process_group()


def test_a_step_that_fails_on_one_rank_fails_on_every_rank(tmp_path, engine_cfg):
    """Rank 1 reads a corrupted chunk of its optimizer state: both ranks' steps fail
    (rank 0's with RankFailedError), both are bit-identical to before it, and after
    the byte is restored both train on as a pair of engines that never failed."""
    cfg = engine_cfg("nvme", "host", "nvme", group_size=600)
    out = str(tmp_path / "res")
    spawn(_worker, str(tmp_path / "init"), out, cfg)
    for rank in (0, 1):
        res = torch.load(f"{out}.{rank}")
        assert res == {"cause": True, "unchanged": True, "as_ref": True}, (rank, res)


def _save_worker(rank: int, world: int, init_file: str, out: str, cfg: dict,
                 root: str) -> None:
    import os

    import offload
    from offload.comm import RankFailedError
    from offload.io import CorruptionError
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        batches = lm_batches(3, vocab=VOCAB, batch=8)
        engine = offload.initialize(TiedTwice(vocab=VOCAB), cfg)
        assert _train(engine, batches[0], rank, world)
        part = engine.optimizer.partition(0)
        path = engine.optimizer._pipeline.swap.paths[0]
        where = part.extents[part.layout.n_chunks - 1].offset + 8
        if rank == 1:
            flip_byte(path, where)
        causes = []
        for blocking in (True, False):
            try:
                engine.save_checkpoint(f"{root}/ck-{blocking}", blocking=blocking).wait()
            except offload.CheckpointError as e:
                causes.append(type(e.__cause__))
            dist.barrier()
        left = sorted(os.listdir(root)) if rank == 0 else []
        if rank == 1:
            flip_byte(path, where)
        assert _train(engine, batches[1], rank, world)
        engine.save_checkpoint(f"{root}/ck-after")
        assert _train(engine, batches[2], rank, world)
        want = CorruptionError if rank == 1 else RankFailedError
        torch.save({"causes": [c is want for c in causes], "left": left}, f"{out}.{rank}")
        engine.close()
    finally:
        dist.destroy_process_group()


def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path, engine_cfg):
    """Rank 1 cannot read its optimizer state for a checkpoint: the save fails on both
    ranks (blocking or in the background; rank 0's cause RankFailedError), nothing is
    left in the parent, and both go on training and saving."""
    cfg = engine_cfg("nvme", "host", "nvme", group_size=600)
    out, root = str(tmp_path / "res"), tmp_path / "ckpt"
    root.mkdir()
    spawn(_save_worker, str(tmp_path / "init"), out, cfg, str(root))
    for rank in (0, 1):
        res = torch.load(f"{out}.{rank}")
        assert res["causes"] == [True, True], (rank, res)
    assert torch.load(f"{out}.0")["left"] == []
    assert sorted(p.name for p in root.iterdir()) == ["ck-after"]
