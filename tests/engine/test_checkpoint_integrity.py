"""Every chunk of a checkpoint carries a checksum, verified on load: damage is an error."""

import pytest
import torch

import offload
from offload.engine import CheckpointReader

from .models import TiedTwice, lm_batches, lm_loss


@pytest.fixture
def saved(tmp_path, engine_cfg):
    cfg = engine_cfg("host", "host", "nvme", dtype="bf16")
    cfg["io"]["paths"] = [str(tmp_path / "swap-a")]
    ck = tmp_path / "ck"
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), cfg) as engine:
        x, y = lm_batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(ck)
    cfg["io"]["paths"] = [str(tmp_path / "swap-b")]
    return ck, cfg


def test_intact_checkpoint_verifies(saved):
    ck, _cfg = saved
    assert CheckpointReader(ck).verify() == []


def test_flipped_byte_is_an_error_naming_array_and_chunk(saved):
    ck, cfg = saved
    chunk = ck / "exp_avg_sq" / "l1.weight" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and "exp_avg_sq/l1.weight, chunk (0, 0)" in problems[0]
    with pytest.raises(offload.CheckpointCorruptError,
                       match=r"array exp_avg_sq/l1\.weight, chunk \(0, 0\)"):
        offload.initialize(TiedTwice, cfg, resume=ck)


def test_missing_chunk_is_an_error_not_zeros(saved):
    ck, cfg = saved
    (ck / "master" / "l2.bias" / "c" / "0").unlink()
    with pytest.raises(offload.CheckpointCorruptError, match=r"array master/l2\.bias, chunk \(0\)"):
        offload.initialize(TiedTwice, cfg, resume=ck)


def test_changed_commit_record_is_an_error(saved):
    ck, cfg = saved
    rec = ck / "checkpoint.json"
    rec.write_text(rec.read_text().replace('"global_step": 1', '"global_step": 7'))
    with pytest.raises(offload.CheckpointCorruptError, match="checkpoint.json does not match"):
        offload.initialize(TiedTwice, cfg, resume=ck)


def test_checkpoint_of_the_previous_format_is_refused(saved):
    """A checkpoint of the layout before shard files (offload-checkpoint/1, a file per
    chunk) is refused by name before anything is read, not misread."""
    import json

    from offload.engine import training_checkpoint as tc
    ck, cfg = saved
    rec = json.loads((ck / "checkpoint.json").read_text())
    tc._write_json(ck / "checkpoint.json", {**rec, "format": "offload-checkpoint/1"})
    with pytest.raises(offload.CheckpointError,
                       match=r"format 'offload-checkpoint/1', this version reads "
                             r"'offload-checkpoint/2'"):
        offload.initialize(TiedTwice, cfg, resume=ck)


def test_damaged_shard_index_is_an_error_naming_array_and_chunk(saved):
    """The index at the end of a shard file carries its own crc32c: a flipped byte in
    it is an error naming the array, the chunk and the file."""
    ck, cfg = saved
    shard = ck / "exp_avg" / "l1.weight" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(offload.CheckpointCorruptError,
                       match=r"array exp_avg/l1\.weight, chunk \(0, 0\).*shard index that "
                             r"fails its checksum"):
        offload.initialize(TiedTwice, cfg, resume=ck)
