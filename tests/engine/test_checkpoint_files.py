"""The shard files of a checkpoint ([Note: shard files]): written and read with O_DIRECT
where the file system takes it, through the page cache where it does not, in the
zarr v3 format other readers open; every chunk stored, zeros included."""

import json
import os
import struct
from pathlib import Path

import crc32c

import numpy as np
import pytest
import tensorstore as ts
import torch

import offload
import offload.engine.checkpoint_layout as layout
from offload.engine.checkpoint_chunks import CRC_BYTES

from .models import TiedTwice, lm_batches, lm_train
from .test_checkpoint import _assert_identical, _optim_state


def _cfg(engine_cfg, tmp_path, name, params="host", optimizer="host", dtype="fp32"):
    cfg = engine_cfg(params, "host", optimizer, dtype=dtype)
    cfg["io"]["paths"] = [str(tmp_path / name)]
    return cfg


def _state(engine):
    return {"sd": engine.state_dict(), "opt": _optim_state(engine)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 elements: emb.weight (64 x 32) is 3 chunks of 31 rows, the last
    of them 2 rows of data and 29 of zeros."""
    monkeypatch.setattr(layout, "CHUNK_ELEMS", 1000)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_shard_files_are_zarr3_shards_of_exact_size(tmp_path, engine_cfg, small_chunks, dtype):
    """An array's chunks share one shard file: each chunk's elements and crc32c at a
    block boundary, the array's last chunk padded to the chunk shape, the index of
    (offset, length) pairs and its crc32c at the end; tensorstore reads back what
    the engine holds."""
    torch.manual_seed(0)
    ck = tmp_path / "ck"
    with offload.initialize(TiedTwice(), _cfg(engine_cfg, tmp_path, "a", dtype=dtype)) as e:
        lm_train(e, lm_batches(2))
        e.save_checkpoint(ck)
        sd = e.state_dict()
    meta = json.loads((ck / "exp_avg" / "emb.weight" / "zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [93, 32]  # one shard
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["codecs"][0]["configuration"]["chunk_shape"] == [31, 32]
    for kind, itemsize in (("param", 2 if dtype == "bf16" else 4), ("exp_avg", 4)):
        files = [f for f in (ck / kind / "emb.weight" / "c").rglob("*") if f.is_file()]
        assert [f.relative_to(ck / kind / "emb.weight") for f in files] == [Path("c/0/0")]
        raw = files[0].read_bytes()
        n = 31 * 32 * itemsize + CRC_BYTES
        stride = -(-n // 4096) * 4096
        assert len(raw) == 3 * stride + 3 * 16 + CRC_BYTES
        index = raw[3 * stride:]
        assert struct.unpack("<6Q", index[:48]) == (0, n, stride, n, 2 * stride, n)
        assert int.from_bytes(index[48:], "little") == crc32c.crc32c(index[:48])
        for j in range(3):
            chunk = raw[j * stride:j * stride + n]
            assert int.from_bytes(chunk[-CRC_BYTES:], "little") == crc32c.crc32c(chunk[:-4])
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
        lm_train(a, lm_batches(1))
        after = _state(a)
    assert all(f.stat().st_size > CRC_BYTES for f in (ck / "exp_avg_sq").rglob("c/*/*"))
    with offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "b"), resume=ck) as b:
        _assert_identical(_state(b), want)
        lm_train(b, lm_batches(1))
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
        lm_train(a, batches[:3])
        a.save_checkpoint(ck)
        lm_train(a, batches[3:])
        want = _state(a)
    with offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "b", "host", optimizer),
                            resume=ck) as b:
        lm_train(b, batches[3:])
        _assert_identical(_state(b), want)


def _write_chunks(directory, sizes, seed=0):
    """Shard files of one chunk each, of random bytes of `sizes`, written by ChunkFiles
    (the aligned ones from their own memory, the others through a buffer); their data."""
    from offload.engine.checkpoint_chunks import ChunkFiles, Shard
    from offload.io.buffers import mapped_empty
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    with ChunkFiles(directory, max(sizes)) as files:
        for i, d in enumerate(data):
            shard = Shard(str(directory / f"c{i}"), 1, 1, d.numel())
            src = mapped_empty(d.numel(), torch.uint8)  # page-aligned
            src.copy_(d)
            if files.in_place(src):
                files.write_in_place(shard, 0, src).wait()
            else:
                buf = files.buffer()
                buf.tensor[:d.numel()].copy_(d)
                files.write(shard, 0, buf, d.numel())
        files.finish()
    return data


@pytest.mark.parametrize("flip", [None, 5, 3 * 4096 + 7, "crc"])
def test_chunks_read_into_place_are_checked(tmp_path, flip):
    """With `into`, aligned chunks land straight in their destination (the whole blocks
    by O_DIRECT, the last partial block through a small buffer) and are checked there:
    a flipped byte in either part, or in the checksum, is an error naming the file;
    a misaligned destination goes through `consume`."""
    from offload.engine.checkpoint_chunks import ChunkFileError, ChunkFiles, read_index
    from offload.io.buffers import mapped_empty
    sizes = [4 * 4096 + 100, 5 * 4096, 4096 + 3]
    data = _write_chunks(tmp_path, sizes)
    assert [read_index(str(tmp_path / f"c{i}"), 1) for i in range(3)] == [
        [(0, n + CRC_BYTES)] for n in sizes]
    if flip is not None:
        at = sizes[1] if flip == "crc" else flip
        with open(tmp_path / "c1", "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
    dest = mapped_empty(24 * 4096, torch.uint8)
    at = [0, 8 * 4096, 16 * 4096 + 1]  # page-aligned but the last, off by a byte
    into = [dest[a:a + n] for a, n in zip(at, sizes)]
    consumed = {}
    with ChunkFiles(tmp_path, max(sizes), existing=tmp_path / "c0") as files:
        assert files.direct  # the test's disk takes O_DIRECT: the direct path runs
        chunks = [(str(tmp_path / f"c{i}"), 0, n) for i, n in enumerate(sizes)]
        if flip is not None:
            with pytest.raises(ChunkFileError, match="c1: fails its checksum"):
                files.read(chunks, lambda i, t: consumed.update({i: t.clone()}), into)
            return
        files.read(chunks, lambda i, t: consumed.update({i: t.clone()}), into)
    assert sorted(consumed) == [2]
    assert torch.equal(into[0], data[0]) and torch.equal(into[1], data[1])
    assert torch.equal(consumed[2], data[2])


def test_shards_tensorstore_wrote_are_read(tmp_path):
    """tensorstore packs a shard's chunks back to back (off the block boundaries) and
    its index says where: ChunkFiles reads each from the block it begins in, checked."""
    from offload.engine.checkpoint_chunks import ChunkFiles, chunk_key, read_index
    spec = layout._spec(tmp_path, "exp_avg", "w", (70, 32), "float32")
    spec["metadata"]["codecs"][0]["configuration"]["chunk_shape"] = [10, 32]
    spec["metadata"]["chunk_grid"]["configuration"]["chunk_shape"] = [40, 32]
    want = np.arange(70 * 32, dtype=np.float32).reshape(70, 32)
    ts.open(spec, create=True).result().write(want).result()
    got = np.zeros((80, 32), dtype=np.float32)
    meta = tmp_path / "exp_avg" / "w" / "zarr.json"
    with ChunkFiles(tmp_path, 10 * 32 * 4, existing=meta) as files:
        chunks = []
        for k in range(7):
            path = str(tmp_path / "exp_avg" / "w" / chunk_key(2, k // 4))
            off, n = read_index(path, 4)[k % 4]
            chunks.append((path, off, n - CRC_BYTES))
        assert any(off % 4096 for _p, off, _n in chunks)
        files.read(chunks, lambda i, t: got[10 * i:10 * i + 10].__setitem__(
            slice(None), t.view(torch.float32).numpy().reshape(10, 32)))
    assert np.array_equal(got[:70], want)
