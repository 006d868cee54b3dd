"""Which files of a directory `initialize(model, cfg, checkpoint=dir)` reads (those
transformers' `from_pretrained` reads), and the index entries and files it refuses,
naming them, before anything is read into the model."""

import json
import logging
import os
import re
import shutil
import traceback

import pytest
import torch

import offload

from .models import TiedTwice

safetensors_torch = pytest.importorskip("safetensors.torch")

INDEX = "model.safetensors.index.json"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """TiedTwice's weights as a file stores them (the tied head once)."""
    torch.manual_seed(seed)
    return {k: v for k, v in TiedTwice().state_dict().items() if k != "head.weight"}


def _sharded(d, sd: dict, shards=("a.safetensors", "b.safetensors")) -> dict[str, str]:
    """`sd` in two shards of `d` with transformers' index; returns its weight_map."""
    keys = list(sd)
    weight_map = {}
    for name, part in zip(shards, (keys[:3], keys[3:])):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        safetensors_torch.save_file({k: sd[k] for k in part}, str(d / name))
        weight_map.update({k: name for k in part})
    _index(d, weight_map)
    return weight_map


def _index(d, weight_map: dict) -> None:
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _refused(engine_cfg, d, error: type, match: str) -> None:
    """`initialize` refuses checkpoint `d` with `error` matching `match` as it opens it:
    the model it was given keeps its own weights."""
    torch.manual_seed(100)
    model = TiedTwice()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match) as err:
        offload.initialize(model, engine_cfg("host"), checkpoint=d)
    assert "_materialise" not in "".join(traceback.format_tb(err.value.__traceback__))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def _loaded(engine_cfg, d) -> dict[str, torch.Tensor]:
    with offload.initialize(lambda: TiedTwice(), engine_cfg("host"), checkpoint=d) as engine:
        return engine.state_dict()


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused(engine_cfg, tmp_path,
                                                                    where):
    """transformers refuses an index whose shard names leave the model directory (`..`
    or an absolute path); so does checkpoint=, naming the index, the tensor and the
    name, where it read the file there."""
    (tmp_path / "elsewhere").mkdir()
    safetensors_torch.save_file(_weights(1), str(tmp_path / "elsewhere" / "w.safetensors"))
    shard = ("../elsewhere/w.safetensors" if where == "relative"
             else str(tmp_path / "elsewhere" / "w.safetensors"))
    d = tmp_path / "ck"
    d.mkdir()
    _index(d, {k: shard for k in _weights(1)})
    first = next(iter(_weights(1)))
    _refused(engine_cfg, d, ValueError,
             rf"checkpoint index {re.escape(str(d / INDEX))} puts {first!r} in "
             rf"{re.escape(repr(shard))}, which is outside the checkpoint directory")


def test_shards_in_a_subdirectory_or_linked_from_elsewhere_load(engine_cfg, tmp_path):
    """The check is of the names, as transformers': a shard in a subdirectory, or a link
    to a file elsewhere (the Hub's cache links each shard), is read."""
    sd = _weights(2)
    d = tmp_path / "ck"
    weight_map = _sharded(d, sd, shards=("sub/a.safetensors", "b.safetensors"))
    shutil.move(d / "b.safetensors", tmp_path / "blob")
    os.symlink(tmp_path / "blob", d / "b.safetensors")
    assert set(weight_map.values()) == {"sub/a.safetensors", "b.safetensors"}
    got = _loaded(engine_cfg, d)
    assert all(torch.equal(got[k], v) for k, v in sd.items())


@pytest.mark.parametrize("value", [5, None, ["a.safetensors"], "", ".", "sub"])
def test_an_index_value_that_names_no_shard_file_is_refused(engine_cfg, tmp_path, value):
    """A weight_map value that is not a string, names no file ("", "."), or names a
    directory, is a ValueError naming the index, the tensor, the value and the fix
    (were a bare TypeError, or a shard that "does not exist")."""
    d = tmp_path / "ck"
    weight_map = _sharded(d, _weights(3))
    (d / "sub").mkdir()
    _index(d, {**weight_map, "l1.weight": value})
    index = re.escape(str(d / INDEX))
    if value == "sub":
        match = (rf"checkpoint index {index} puts 'l1.weight' in {re.escape(str(d / 'sub'))}, "
                 r"which is not a file: .*; fix or remove the index")
    else:
        match = (rf"checkpoint index {index} puts 'l1.weight' in {re.escape(repr(value))}, "
                 r"which is not a shard file name: .*; fix or remove the index")
    _refused(engine_cfg, d, ValueError, match)


@pytest.mark.parametrize("layout", ["plain", "indexed"])
def test_a_tensor_two_files_hold_is_refused(engine_cfg, tmp_path, layout):
    """Read together (a directory without model.safetensors or an index, or the shards of
    an index), no file's tensor silently replaces another's of the same name (the later
    file's did; with an index, the shard it names was said not to hold it): refused,
    naming both files and the tensor."""
    sd = _weights(4)
    keys = list(sd)
    d = tmp_path / "ck"
    _sharded(d, sd)
    if layout == "plain":
        (d / INDEX).unlink()
        got = _loaded(engine_cfg, d)  # apart, they load by their names
        assert all(torch.equal(got[k], v) for k, v in sd.items())
    safetensors_torch.save_file({keys[0]: torch.zeros_like(sd[keys[0]]),
                                 **{k: sd[k] for k in keys[3:]}}, str(d / "b.safetensors"))
    _refused(engine_cfg, d, ValueError,
             rf"checkpoint tensor {keys[0]!r} is in both "
             rf"{re.escape(str(d / 'a.safetensors'))} and {re.escape(str(d / 'b.safetensors'))}")


@pytest.mark.parametrize("beside", ["index", "file"])
def test_the_files_from_pretrained_reads_are_the_ones_loaded(engine_cfg, tmp_path, caplog,
                                                             beside):
    """A directory holding model.safetensors and, beside it, an index with its shards or
    another safetensors file with the same names: from_pretrained reads model.safetensors
    alone, and so does checkpoint=, with a warning naming what it did not read (it read
    the shards, or every file, the later file's tensors replacing the earlier's)."""
    transformers = pytest.importorskip("transformers")
    from .test_hf_flows import _llama
    torch.manual_seed(0)
    mine, other = _llama(), _llama()
    d = tmp_path / "hf"
    mine.save_pretrained(tmp_path / "mine")
    if beside == "index":
        other.save_pretrained(d, max_shard_size="4KB")
        shards = sorted(f.name for f in d.glob("*.safetensors"))
        unread = f"{INDEX}, {shards[0]}, {shards[1]} and {len(shards) - 2} more"
    else:
        other.save_pretrained(d)
        shutil.move(d / "model.safetensors", d / "optimizer.safetensors")
        unread = "optimizer.safetensors"
    shutil.copy(tmp_path / "mine" / "model.safetensors", d / "model.safetensors")
    want = transformers.LlamaForCausalLM.from_pretrained(d).state_dict()
    assert all(torch.equal(want[k], v) for k, v in mine.state_dict().items())
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(_llama, engine_cfg("host"), checkpoint=d) as engine:
        got = engine.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert (f"checkpoint {d}: only model.safetensors is read, as transformers' "
            f"from_pretrained reads it, not {unread} beside it") in caplog.text
