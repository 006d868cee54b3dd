"""The chunk files of a checkpoint ([Note: chunk files]): written and read with O_DIRECT
where the file system takes it, through the page cache where it does not, in the
zarr v3 format other readers open; every chunk stored, zeros included."""

import json
import os

import numpy as np
import pytest
import tensorstore as ts
import torch

import offload
import offload.engine.training_checkpoint as tc
from offload.engine.checkpoint_chunks import CRC_BYTES

from .models import TiedTwice, lm_batches, lm_loss
from .test_checkpoint import _assert_identical, _optim_state


def _cfg(engine_cfg, tmp_path, name, params="host", optimizer="host", dtype="fp32"):
    cfg = engine_cfg(params, "host", optimizer, dtype=dtype)
    cfg["io"]["paths"] = [str(tmp_path / name)]
    return cfg


def _train(engine, batches):
    for x, y in batches:
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _state(engine):
    return {"sd": engine.state_dict(), "opt": _optim_state(engine)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 elements: emb.weight (64 x 32) is 3 chunks of 31 rows, the last
    of them 2 rows of data and 29 of zeros."""
    monkeypatch.setattr(tc, "CHUNK_ELEMS", 1000)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunk_files_are_zarr3_chunks_of_exact_size(tmp_path, engine_cfg, small_chunks, dtype):
    """Every chunk is a file of its elements and a crc32c, the array's last chunk padded
    to the chunk shape; tensorstore reads back what the engine holds."""
    torch.manual_seed(0)
    ck = tmp_path / "ck"
    with offload.initialize(TiedTwice(), _cfg(engine_cfg, tmp_path, "a", dtype=dtype)) as e:
        _train(e, lm_batches(2))
        e.save_checkpoint(ck)
        sd = e.state_dict()
    meta = json.loads((ck / "exp_avg" / "emb.weight" / "zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [31, 32]
    for kind, itemsize in (("param", 2 if dtype == "bf16" else 4), ("exp_avg", 4)):
        files = sorted((ck / kind / "emb.weight" / "c").rglob("*"))
        files = [f for f in files if f.is_file()]
        assert len(files) == 3
        assert {os.path.getsize(f) for f in files} == {31 * 32 * itemsize + CRC_BYTES}
    master = ts.open({"driver": "zarr3", "kvstore": f"file://{ck}/{'master' if dtype == 'bf16' else 'param'}/emb.weight"}).result()
    assert np.array_equal(master.read().result(), sd["emb.weight"].float().numpy())


def test_checkpoint_of_zeros_loads(tmp_path, engine_cfg):
    """A state saved before the first step (moments all zero: chunks equal to the fill
    value) is whole on disk and resumes; a reader that took a missing chunk for zeros
    would hide damage, so none may be missing."""
    torch.manual_seed(0)
    ck = tmp_path / "ck"
    with offload.initialize(TiedTwice(), _cfg(engine_cfg, tmp_path, "a")) as a:
        a.save_checkpoint(ck)
        want = _state(a)
        _train(a, lm_batches(1))
        after = _state(a)
    assert all(f.stat().st_size > CRC_BYTES for f in (ck / "exp_avg_sq").rglob("c/*/*"))
    with offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "b"), resume=ck) as b:
        _assert_identical(_state(b), want)
        _train(b, lm_batches(1))
        _assert_identical(_state(b), after)


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_save_and_resume_without_o_direct(tmp_path, engine_cfg, no_direct_dir, small_chunks,
                                          optimizer):
    """On a file system that refuses O_DIRECT the same files go through the page cache;
    3 steps + save + resume + 3 steps equals 6 steps."""
    batches = lm_batches(6)
    torch.manual_seed(0)
    ck = os.path.join(no_direct_dir, "ck")
    with offload.initialize(TiedTwice(), _cfg(engine_cfg, tmp_path, "a", "host", optimizer)) as a:
        _train(a, batches[:3])
        a.save_checkpoint(ck)
        _train(a, batches[3:])
        want = _state(a)
    with offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "b", "host", optimizer),
                            resume=ck) as b:
        _train(b, batches[3:])
        _assert_identical(_state(b), want)
