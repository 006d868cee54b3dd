"""Full weights, state dicts and export on two ranks (gloo): the shards are gathered, only
rank 0 keeps a state dict or writes files, and writes reach each rank's own shard."""

import pytest
import torch

from .models import TiedTwice, lm_batches, lm_loss
from .ranks import gloo_group, spawn

pytestmark = pytest.mark.distributed

VOCAB = 256  # emb.weight has 8192 elements: each rank's shard holds half of it


def _pattern() -> torch.Tensor:
    return torch.arange(VOCAB * 32, dtype=torch.float32).view(VOCAB, 32)


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        engine = offload.initialize(TiedTwice(vocab=VOCAB), cfg)
        for x, y in lm_batches(2, vocab=VOCAB, batch=8):
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            engine.backward(lm_loss(engine(xs), ys))
            engine.step()
        sd = engine.state_dict()
        sd_all = engine.state_dict(rank0_only=False)
        with engine.full_weights() as w:
            seen = {k: v.detach().clone() for k, v in w.items()}
        with engine.full_weights("emb", writable=True):  # both ranks' shards of a group
            engine.module.emb.weight.data.copy_(_pattern())
        after = engine.state_dict(rank0_only=False)
        engine.save_pretrained(out + ".dir", max_shard_size="8KB")
        again = "written"
        try:  # rank 0 refuses a directory with shards; rank 1 is not left waiting
            engine.save_pretrained(out + ".dir")
        except FileExistsError:
            again = "refused"
        with engine.full_weights("emb", writable=True):
            engine.module.emb.weight.data.mul_(10)  # up to 81,910: beyond fp16's range
        fp16 = "written"
        try:  # rank 0 refuses the first group; rank 1 is not left in its all-gathers
            engine.save_pretrained(out + ".fp16", dtype="fp16")
        except ValueError as e:
            fp16 = str(e)
        refused = ""
        try:  # rank 1 gives nothing: every rank raises, none waits in a collective
            engine.load_state_dict(sd_all if rank == 0 else {})
        except RuntimeError as e:
            refused = str(e)
        differ, held = "", engine.state_dict(rank0_only=False)
        try:  # rank 1 gives other values: each rank would write its slices from its own
            engine.load_state_dict({k: v + rank for k, v in sd_all.items()})
        except RuntimeError as e:
            differ = str(e)
        one_sided = ""
        try:  # an edit under `if rank == 0`: rank 1's shards would keep the old weights
            with engine.full_weights("emb", writable=True):
                if rank == 0:
                    engine.module.emb.weight.data.zero_()
        except RuntimeError as e:
            one_sided = str(e)
        raised = ""
        try:  # rank 1's block raises: rank 0 writes nothing either
            with engine.full_weights("emb", writable=True):
                engine.module.emb.weight.data.fill_(3.0)
                if rank == 1:
                    raise ValueError("rank 1's edit failed")
        except (RuntimeError, ValueError) as e:
            raised = f"{type(e).__name__}: {e}"
        now = engine.state_dict(rank0_only=False)
        kept = all(torch.equal(v, held[k]) for k, v in now.items())
        engine.load_state_dict(sd_all)  # the weights before the write, on both ranks
        back = engine.state_dict(rank0_only=False)
        torch.save({"sd": sd, "seen": seen, "after": after, "refused": refused, "back": back,
                    "again": again, "fp16": fp16, "differ": differ, "kept": kept,
                    "one_sided": one_sided, "raised": raised},
                   f"{out}.{rank}")
        engine.close()


def test_two_ranks_gather_keep_on_rank_zero_and_write_their_shards(tmp_path, engine_cfg):
    cfg = engine_cfg("nvme", "host", "nvme", group_size=1200)
    out = str(tmp_path / "res")
    spawn(_worker, str(tmp_path / "init"), out, cfg)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert r1["sd"] == {} and set(r0["sd"]) == set(TiedTwice(vocab=VOCAB).state_dict())
    for k, v in r0["sd"].items():
        assert torch.equal(r0["seen"][k], v) and torch.equal(r1["seen"][k], v), k
        want = _pattern() if k in ("emb.weight", "head.weight") else v
        assert torch.equal(r0["after"][k], want) and torch.equal(r1["after"][k], want), k
    assert "another rank refused" in r0["refused"] and "missing keys" in r1["refused"]
    for r in (r0, r1):  # refused on both, nothing loaded (the weights as after the write)
        assert "rank 1 was given other values than rank 0 (nothing was loaded)" in r["differ"]
        assert r["kept"]
        assert "rank 1's block left other weights than rank 0's (nothing" in r["one_sided"]
    assert "rank 1's block raised, so no rank writes" in r0["raised"]
    assert r1["raised"] == "ValueError: rank 1's edit failed"
    assert (r0["again"], r1["again"]) == ("refused", "written")
    assert "'emb.weight' holds values beyond the range of float16" in r0["fp16"]
    assert r1["fp16"] == "written" and not (tmp_path / "res.fp16").exists()
    for k, v in r0["sd"].items():
        assert torch.equal(r0["back"][k], v) and torch.equal(r1["back"][k], v), k
    from safetensors import safe_open
    names = {}
    for f in (tmp_path / "res.dir").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names.update({k: h.get_tensor(k) for k in h.keys()})
    assert set(names) == set(r0["sd"]) - {"head.weight"}  # tied: written once
    for k, v in names.items():
        assert torch.equal(v, r0["after"][k]), k


def _buffers_worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload
    from torch import nn
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        engine = offload.initialize(model, cfg)
        g = torch.Generator().manual_seed(100 + rank)  # each rank's own batches
        engine.backward(engine(torch.randn(4, 8, generator=g)).pow(2).mean())
        engine.step()
        own = model[1].running_mean.clone()
        sd = engine.state_dict(rank0_only=False)
        loaded = "loaded"
        try:
            engine.load_state_dict(sd)
        except RuntimeError as e:
            loaded = str(e)
        torch.save({"own": own, "sd": sd, "loaded": loaded,
                    "after": model[1].running_mean.clone()}, f"{out}.{rank}")
        engine.close()


def test_every_ranks_full_state_dict_is_the_same_and_loads_back(tmp_path, engine_cfg):
    """BatchNorm statistics differ per rank (each rank's own batches, as under DDP):
    `state_dict(rank0_only=False)` gave rank 0's weights with each rank's own buffers,
    and loading it back, the round trip of the engine's own dict, was refused as
    'rank 1 was given other values than rank 0'. Every rank's dict now holds rank 0's
    buffers, as a checkpoint does, and loads back on both."""
    out = str(tmp_path / "res")
    spawn(_buffers_worker, str(tmp_path / "init"), out, engine_cfg("host", "host", "host"))
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert not torch.equal(r0["own"], r1["own"])
    assert set(r0["sd"]) == set(r1["sd"])
    for k, v in r0["sd"].items():
        assert torch.equal(v, r1["sd"][k]), k
    assert torch.equal(r0["sd"]["1.running_mean"], r0["own"])
    assert r0["loaded"] == r1["loaded"] == "loaded"
    assert torch.equal(r1["after"], r0["own"])
