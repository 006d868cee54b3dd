"""Exports: a second export onto a single-file one refused, the index's total_size, shards
filled exactly to max_shard_size, a tensor stream out of order refused, and the
generation config written beside the shards."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import offload


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def test_a_second_export_onto_a_single_file_export_is_refused(engine_cfg, tmp_path):
    """save_pretrained into a directory holding a single-file export (model.safetensors,
    no index) is refused and leaves that file as it was."""
    ref = _model()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg())
    try:
        files = engine.save_pretrained(tmp_path / "out")
        assert [f.name for f in files] == ["model.safetensors"]
        before = (tmp_path / "out" / "model.safetensors").read_bytes()
        with engine.full_weights(writable=True) as w:
            w["0.weight"].data.fill_(3.0)  # other weights: a stale file would be overwritten
        with pytest.raises(FileExistsError, match="already holds safetensors files"):
            engine.save_pretrained(tmp_path / "out")
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
        got = load_file(tmp_path / "out" / "model.safetensors")
        assert torch.equal(got["0.weight"], ref[0].weight.detach())
    finally:
        engine.close()


def test_the_index_states_the_total_bytes_of_the_tensors(engine_cfg, tmp_path):
    """The index of a sharded export states the bytes of the tensors, as transformers
    writes it."""
    ref = _model()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg())
    try:
        engine.save_pretrained(tmp_path / "out", max_shard_size=1200)
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        want = ref.state_dict()
        assert set(index["weight_map"]) == set(want)
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                      for v in want.values())
        got = {}
        for f in set(index["weight_map"].values()):
            got.update(load_file(tmp_path / "out" / f))
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        engine.close()


def test_tensors_that_exactly_fill_max_shard_size_share_one_shard(tmp_path):
    """As huggingface_hub splits a state dict: a shard may hold exactly
    max_shard_size bytes; the next tensor starts a new one."""
    from offload.engine.safetensors_writer import TensorSpec, write_shards
    want = {"a": torch.arange(8.0), "b": torch.arange(8.0) + 8, "c": torch.ones(4)}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in want.items()]
    files = write_shards(tmp_path / "out", specs, list(want.items()), 64)  # a + b: 64 bytes
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors",
                                   "b": "model-00001-of-00002.safetensors",
                                   "c": "model-00002-of-00002.safetensors"}
    got = {}
    for f in files:
        if f.suffix == ".safetensors":
            got.update(load_file(f))
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_tensor_stream_out_of_order_is_refused_and_writes_nothing(tmp_path):
    """Two tensors of one shape and dtype given in another order than the specs: the
    writer refuses (it would store each under the other's name) and leaves nothing."""
    from offload.engine.safetensors_writer import TensorSpec, write_shards
    specs = [TensorSpec("a", (4,), torch.float32), TensorSpec("b", (4,), torch.float32)]
    with pytest.raises(ValueError, match="expected tensor 'a'"):
        write_shards(tmp_path / "out", specs, [("b", torch.ones(4)), ("a", torch.zeros(4))],
                     1 << 20)
    assert not (tmp_path / "out").exists() or not any(
        p for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))


def test_save_pretrained_writes_the_generation_config(engine_cfg, tmp_path):
    """save_pretrained writes the model's generation config beside the shards, so
    transformers' from_pretrained generates as the saved model did."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=None, eos_token_id=None))
    ref.generation_config.max_new_tokens = 7  # what the user set for generation
    ref.generation_config.do_sample = True
    ref.generation_config.top_k = 3
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg())
    try:
        files = engine.save_pretrained(tmp_path / "out")
        assert (tmp_path / "out" / "generation_config.json") in files
        saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
        assert saved["max_new_tokens"] == 7 and saved["top_k"] == 3 and saved["do_sample"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        assert loaded.generation_config.max_new_tokens == 7
        assert loaded.generation_config.top_k == 3
    finally:
        engine.close()


def test_initialize_from_a_directory_reads_its_generation_config(engine_cfg, tmp_path):
    """initialize(checkpoint=dir) sets the directory's generation_config.json on a model
    that can generate, as from_pretrained does; one transformers cannot read is refused,
    naming it, and leaves the model's own; a file checkpoint reads none."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1,
                                  n_head=2, bos_token_id=None, eos_token_id=None)
    ref = transformers.GPT2LMHeadModel(cfg)
    ref.generation_config.max_new_tokens = 7
    ref.generation_config.do_sample = True
    ref.generation_config.top_k = 3
    ref.save_pretrained(tmp_path / "pre")
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.generation_config.max_new_tokens is None
    with offload.initialize(model, engine_cfg(), checkpoint=tmp_path / "pre") as engine:
        assert model.generation_config.max_new_tokens == 7
        assert engine.generation_config.top_k == 3
    model = transformers.GPT2LMHeadModel(cfg)
    with offload.initialize(model, engine_cfg(),
                            checkpoint=tmp_path / "pre" / "model.safetensors"):
        assert model.generation_config.max_new_tokens is None
    (tmp_path / "pre" / "generation_config.json").write_text("{not json")
    model = transformers.GPT2LMHeadModel(cfg)
    own = model.generation_config
    with pytest.raises(ValueError, match="generation_config.json"):
        offload.initialize(model, engine_cfg(), checkpoint=tmp_path / "pre")
    assert model.generation_config is own
    with offload.initialize(model, engine_cfg()):  # the model is untouched
        pass
