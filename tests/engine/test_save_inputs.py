"""Bad arguments to the writers (`save_pretrained`, `save_checkpoint`, `write_chrome_trace`)
and a bad `initialize(checkpoint=...)` file raise an error naming the argument or
file, before anything is created."""

import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import offload
from offload.trace import TraceRecorder
from offload.trace.chrome import write_chrome_trace


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 4))


@pytest.fixture
def engine(tmp_path):
    with offload.initialize(_model(), {"io": {"paths": [str(tmp_path / "swap")]}}) as e:
        yield e


def test_save_pretrained_takes_the_configs_dtype_names(engine, tmp_path):
    engine.save_pretrained(tmp_path / "out", dtype="bf16")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    want = _model().state_dict()
    assert {k: v.dtype for k, v in saved.items()} == {k: torch.bfloat16 for k in want}
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v.to(torch.bfloat16))


@pytest.mark.parametrize("dtype, match", [
    (torch.int8, r"dtype=torch.int8 cannot be written"),
    ("int8", r"dtype='int8' cannot be written"),
    ("float16", r"dtype='float16' cannot be written.*'fp16'"),
])
def test_save_pretrained_refuses_other_dtypes_before_writing(engine, tmp_path, dtype, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"save_pretrained: " + match):
        engine.save_pretrained(out, dtype=dtype)
    assert not out.exists()


@pytest.mark.parametrize("dtype", [torch.float16, "fp16"])
def test_save_pretrained_refuses_a_weight_fp16_would_make_inf(tmp_path, dtype):
    """A weight of 1e6 was written to fp16 as inf, silently (`offload checkpoint export`
    refused it): refused, naming the tensor, nothing written; bf16 keeps it."""
    model = _model()
    with torch.no_grad():
        model[0].weight[1, 2] = 1e6
    with offload.initialize(model, {"io": {"paths": [str(tmp_path / "swap")]}}) as e:
        with pytest.raises(ValueError, match=r"save_pretrained: dtype=torch.float16: tensor "
                                             r"'0.weight' holds values beyond the range of "
                                             r"float16 \(up to 1e\+06\).*nothing was written"):
            e.save_pretrained(tmp_path / "out", dtype=dtype)
        assert not (tmp_path / "out").exists()
        e.save_pretrained(tmp_path / "out", dtype="bf16")
    assert load_file(tmp_path / "out" / "model.safetensors")["0.weight"][1, 2] == 1e6


@pytest.mark.parametrize("size, match", [
    (-1, r"max_shard_size=-1 is not a positive size"),
    (0, r"max_shard_size=0 is not a positive size"),
    ("0.1B", r"max_shard_size='0.1B' is not a positive size"),
    ("5 parsecs", r"max_shard_size: cannot read '5 parsecs' as a byte size"),
])
def test_save_pretrained_refuses_bad_shard_sizes_before_writing(engine, tmp_path, size, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        engine.save_pretrained(out, max_shard_size=size)
    assert not out.exists()


def test_save_pretrained_reads_shard_sizes_as_the_config_does(engine, tmp_path):
    files = engine.save_pretrained(tmp_path / "out", max_shard_size="100B")  # weight: 256 B
    assert sorted(f.name for f in files) == ["model-00001-of-00002.safetensors",
                                             "model-00002-of-00002.safetensors",
                                             "model.safetensors.index.json"]


@pytest.mark.parametrize("in_directory", [False, True])
def test_a_garbage_checkpoint_file_is_named(tmp_path, in_directory):
    bad = tmp_path / "shards" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"not a safetensors file at all")
    swap = tmp_path / "swap"
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {bad} is not a valid "
                                                   "safetensors file")):
        offload.initialize(_model(), {"io": {"paths": [str(swap)]}},
                           checkpoint=bad.parent if in_directory else bad)
    assert not swap.exists()


def test_a_checkpoint_buffer_of_another_shape_is_named(tmp_path):
    """A persistent buffer in `checkpoint=` of another shape than the model's (another
    model's checkpoint) was copied by broadcasting: refused, naming the buffer."""
    from safetensors.torch import save_file

    model = _model()
    model.register_buffer("stats", torch.zeros(3, 4))
    saved = {**{k: v.clone() for k, v in model.state_dict().items()},
             "stats": torch.arange(4.0).reshape(1, 4)}
    (tmp_path / "ck").mkdir()
    save_file(saved, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"buffer stats has shape \(1, 4\), the model's is "
                                         r"\(3, 4\)"):
        offload.initialize(model, {"io": {"paths": [str(tmp_path / "swap")]}},
                           checkpoint=tmp_path / "ck")


def test_a_bf16_model_gives_and_exports_bf16_weights(tmp_path):
    """A model built in bf16 (from_pretrained's torch_dtype) trains from fp32 masters;
    state_dict, named_weights and full_weights give its weights in bf16 as torch's
    state_dict does, and save_pretrained writes them so, each shard's data 8-byte
    aligned for readers that map it in place."""
    import struct

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"engine": {"params": "host", "dtype": "bf16"},
           "io": {"paths": [str(tmp_path / "swap")]}}
    with offload.initialize(model, cfg) as engine:
        for got in (engine.state_dict(), dict(engine.named_weights())):
            assert {k: v.dtype for k, v in got.items()} == {k: torch.bfloat16 for k in want}
            assert all(torch.equal(got[k], want[k]) for k in want)
        with engine.full_weights() as w:
            assert {t.dtype for t in w.values()} == {torch.bfloat16}
        engine.save_pretrained(tmp_path / "out")
    path = tmp_path / "out" / "model.safetensors"
    assert {k: v.dtype for k, v in load_file(path).items()} == {k: torch.bfloat16 for k in want}
    head = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + head) % 8 == 0


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000])  # nested: a RecursionError
def test_a_garbage_checkpoint_index_is_named(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=r"checkpoint index \S+model.safetensors.index.json "
                                         r"is not a transformers safetensors index"):
        offload.initialize(_model(), {"io": {"paths": [str(tmp_path / "swap")]}},
                           checkpoint=tmp_path)


@pytest.mark.parametrize("under", ["", "deeper/"])
def test_save_checkpoint_under_a_file_names_the_file(engine, tmp_path, under):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(FileExistsError, match=re.escape(f"save_checkpoint: {f} is a file, "
                                                        "not a directory")):
        engine.save_checkpoint(tmp_path / "a_file" / under / "ck")
    assert f.read_text() == "x"


def test_save_pretrained_under_a_file_names_the_file(engine, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    for out in (f, f / "out"):
        with pytest.raises(FileExistsError, match=re.escape(f"{f} is a file, not a directory")):
            engine.save_pretrained(out)
    assert f.read_text() == "x"


def test_chrome_trace_under_a_file_names_the_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    for target in (f / "trace.json", f / "deeper" / "trace.json"):
        with pytest.raises(FileExistsError, match=re.escape(f"write_chrome_trace: {f} is a "
                                                            "file, not a directory")):
            write_chrome_trace(target, TraceRecorder(enabled=True))
    assert f.read_text() == "x"


def test_save_pretrained_removes_what_a_killed_export_left(engine, tmp_path):
    """A killed export's `.partial` files (another shard count than this one's, the
    index, a copy) are removed; a user's own `.partial` file is not ours to remove."""
    out = tmp_path / "out"
    out.mkdir()
    left = ["model-00002-of-00003.safetensors.partial", "model.safetensors.partial",
            "model.safetensors.index.json.partial"]
    for name in left:
        (out / name).write_bytes(b"\0" * 4096)
    (out / "notes.txt.partial").write_text("mine")
    (out / ".safetensors.partial.lock").touch()  # the lock file a killed export left
    engine.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt.partial"]
    saved = load_file(out / "model.safetensors")
    for k, v in _model().state_dict().items():
        torch.testing.assert_close(saved[k], v)


def test_save_pretrained_refuses_a_directory_another_export_is_writing(engine, tmp_path):
    """Another process holds the directory's lock (an export in progress): the call is
    refused, naming the directory, and touches none of the other export's files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.partial").write_bytes(b"x" * 100)  # the other export's
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT "
         "| os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
         "sys.stdin.read()", str(out / ".safetensors.partial.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FileExistsError, match=re.escape(f"another export is writing "
                                                            f"into {out}")):
            engine.save_pretrained(out)
        assert (out / "model.safetensors.partial").read_bytes() == b"x" * 100
        assert not (out / "model.safetensors").exists()
    finally:
        holder.communicate("")
    engine.save_pretrained(out)  # its lock given back: the directory is free again
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_the_safetensors_writer_refuses_a_name_given_twice(tmp_path):
    """Two tensors under one name: the header holds one, and the file's offsets did not
    hold (it could not be loaded); refused before anything is made."""
    from offload.engine.safetensors_writer import TensorSpec, write_shards
    t = torch.zeros(4)
    specs = [TensorSpec("w", (4,), torch.float32)] * 2
    with pytest.raises(ValueError, match="tensor name 'w' given twice"):
        write_shards(tmp_path / "out", specs, [("w", t), ("w", t)], 1 << 20)
    assert not (tmp_path / "out").exists()


def _two_shards(out, copies=None):
    from offload.engine.safetensors_writer import TensorSpec, write_shards
    specs = [TensorSpec(n, (256,), torch.float32) for n in ("a", "b")]
    tensors = [(n, torch.full((256,), float(i))) for i, n in enumerate("ab")]
    return write_shards(out, specs, tensors, 1024, copies=copies)


def test_a_rename_that_fails_at_the_commit_leaves_no_final_file(tmp_path):
    """The shards and the index are made final before the copies: a copy whose final
    name cannot be taken (a directory stands there) fails the commit after them, and
    the shards already renamed go too, or they would look like a whole export."""
    src = tmp_path / "config.json"
    src.write_text("{}")
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)
    (out / "config.json" / "keep").write_text("x")
    with pytest.raises(OSError, match=r"config\.json"):
        _two_shards(out, {"config.json": src})
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_an_export_into_a_directory_with_shards_is_refused_and_leaves_them(tmp_path):
    """A second export (here of one shard) beside another's shards and index would leave
    a mix that loads stale weights: refused, the first export's files as they were."""
    from offload.engine.safetensors_writer import TensorSpec, write_shards
    out = tmp_path / "out"
    first = sorted(p.name for p in _two_shards(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert first == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    with pytest.raises(FileExistsError, match="already holds safetensors files"):
        write_shards(out, [TensorSpec("a", (4,), torch.float32)], [("a", torch.ones(4))],
                     1 << 20)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()
            and not p.name.startswith(".")} == before


def test_save_checkpoint_refuses_a_link_to_nothing_before_writing(engine, tmp_path):
    """A name that is a symbolic link to a missing target exists (the publish's rename
    onto it would fail after every tensor was written): refused at the call."""
    link = tmp_path / "ck"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(offload.engine.CheckpointError, match=f"{link} exists"):
        engine.save_checkpoint(link)
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "swap"]


def test_a_background_save_keeps_extra_as_it_was_at_the_call(engine, tmp_path):
    """The loop changes `extra` while a background save writes: the checkpoint holds
    the values of the call, as every other non-tensor part of it."""
    extra = {"batch": 2, "nested": {"pos": [1, 2]}}
    saving = engine.save_checkpoint(tmp_path / "ck", extra=extra, blocking=False)
    extra["batch"] = 999
    extra["nested"]["pos"].append(3)
    saving.wait()
    with offload.initialize(_model(), {"io": {"paths": [str(tmp_path / "swap2")]}},
                            resume=tmp_path / "ck") as again:
        assert again.resumed_extra == {"batch": 2, "nested": {"pos": [1, 2]}}


@pytest.mark.parametrize("name", ["a\\b", "ABS"])
def test_save_checkpoint_refuses_a_parameter_name_that_is_no_directory_name(tmp_path, name):
    """A parameter's name names its arrays' directories. With a backslash, the checkpoint
    was published but tensorstore wrote its metadata under another directory than the
    chunks (a resume found it damaged); a name starting with '/' wrote outside the
    checkpoint. Refused, naming the parameter, nothing written."""
    outside = tmp_path / "outside"  # torch takes any name without a '.'
    name = str(outside) if name == "ABS" else name
    model = nn.Sequential()
    model.add_module(name, nn.Linear(4, 2))
    with offload.initialize(model, {"io": {"paths": [str(tmp_path / "swap")]}}) as e:
        with pytest.raises(offload.CheckpointError, match=re.escape(
                f"parameter {name + '.weight'!r} has a '/' or '\\' in its name")):
            e.save_checkpoint(tmp_path / "ck")
        e.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "ck").exists() and not os.path.exists(f"{outside}.weight")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {f"{name}.weight",
                                                                    f"{name}.bias"}
