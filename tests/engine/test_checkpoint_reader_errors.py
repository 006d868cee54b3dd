"""Reading a damaged or mismatched checkpoint: every problem is a CheckpointError that
names the file or what differs, raised before any state is read; never a raw
OSError or ZeroDivisionError, never one group's hyper-parameters given to another."""

import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import offload
from offload.engine import CheckpointReader

from ..conftest import run_together
from .models import TiedTwice, lm_batches, lm_loss

L1 = {"params": ["l1.*"], "lr": 1e-3}
L2 = {"params": ["l2.*"], "lr": 1e-5}
_swaps = itertools.count()


def _cfg(swap):
    return {"engine": {"params": "host", "grads": "host", "optimizer": "host", "dtype": "fp32",
                       "group_size": 3000},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
            "io": {"paths": [str(swap)], "buffer_budget": "32MiB", "grow_step": "4MiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}


def _train_and_save(engine, batches, names, root):
    for (x, y), name in zip(batches, names):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(root / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints `step-1` and `step-2` of one run, and `grouped` (one step) of a run
    with param_groups [L1, L2]; tests damage copies of them (`copy`)."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), _cfg(root / "swap-a")) as e:
        _train_and_save(e, lm_batches(2), ["step-1", "step-2"], root)
    with offload.initialize(TiedTwice(), _cfg(root / "swap-b"), param_groups=[L1, L2]) as e:
        _train_and_save(e, lm_batches(1), ["grouped"], root)
    return root


@pytest.fixture
def copy(saved, tmp_path):
    def make(name="step-1"):
        ck = tmp_path / f"{name}-{next(_swaps)}"
        shutil.copytree(saved / name, ck)
        return ck
    return make


def _resume(ck, tmp_path, **kw):
    return offload.initialize(TiedTwice, _cfg(tmp_path / f"swap-{next(_swaps)}"), resume=ck,
                              **kw)


def _damage_a_chunk(ck):
    """Flips a byte of a chunk: an error raised for something else proves that the
    check ran before this chunk was read."""
    shard = ck / "exp_avg_sq" / "l1.weight" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))


def test_param_groups_are_matched_by_their_parameters(copy, tmp_path):
    """The record lists each group's parameters: the save's groups listed in another
    order (with other values) get each its own saved hyper-parameters, as torch's
    `load_state_dict` restores them."""
    with _resume(copy("grouped"), tmp_path, param_groups=[{**L2, "lr": 0.5}, L1]) as e:
        assert [g["lr"] for g in e.optimizer.param_groups] == [1e-2, 1e-5, 1e-3]


@pytest.mark.parametrize("given, match", [
    (None, r"optimizer group 0 of this engine \(the default group, \d+ parameters\) holds "
           r"other parameters than every group of the save \(the nearest adds \['l1\.bias'"),
    ([{"params": ["l1.weight"], "lr": 1e-3}, L2], r"optimizer group 0 .* lacks \[\]"),
    ([L1], r"optimizer group 0 .*the nearest adds \['l2\.bias', 'l2\.weight'\]")])
def test_other_param_groups_are_refused_before_any_state_is_read(copy, tmp_path, given,
                                                                 match):
    """Groups that hold other parameters than the save's (none given, a group split or
    left out) would drop or invent hyper-parameters: refused, naming the difference,
    before a chunk is read (a damaged one would be reported otherwise)."""
    ck = copy("grouped")
    _damage_a_chunk(ck)
    with pytest.raises(offload.CheckpointError, match=match) as info:
        _resume(ck, tmp_path, **({} if given is None else {"param_groups": given}))
    assert not isinstance(info.value, offload.CheckpointCorruptError)


def _without_members(ck):
    """The commit record as a save that did not list each group's parameters wrote it."""
    from offload.engine.training_checkpoint import RECORD, _read_json, _write_json
    rec = _read_json(ck / RECORD)
    for g in rec["param_groups"]:
        del g["params"]
    del rec["sha256"]
    _write_json(ck / RECORD, rec)
    return ck


def test_param_groups_of_a_record_without_members_are_matched_by_place(copy, tmp_path):
    """Without the members, only values that agree can be matched: [L2, L1] where
    [L1, L2] were saved would give l2's lr to l1, and is refused; so is another number
    of groups. The save's order restores the save's values."""
    ck = _without_members(copy("grouped"))
    _damage_a_chunk(ck)
    with pytest.raises(offload.CheckpointError,
                       match=r"param_groups\[0\] \(optimizer group 1\): lr saved 0\.001, "
                             r"given 1e-05; param_groups\[1\] \(optimizer group 2\): lr saved "
                             r"1e-05, given 0\.001\..* in its order and with its values") as info:
        _resume(ck, tmp_path, param_groups=[L2, L1])
    assert not isinstance(info.value, offload.CheckpointCorruptError)
    with pytest.raises(offload.CheckpointError,
                       match=r"saved with 3 optimizer param groups \(group 0: lr=0\.01, "
                             r"weight_decay=0\.1; group 1: lr=0\.001.*this engine has 1 "):
        _resume(ck, tmp_path)
    with _resume(_without_members(copy("grouped")), tmp_path, param_groups=[L1, L2]) as e:
        assert [g["lr"] for g in e.optimizer.param_groups] == [1e-2, 1e-3, 1e-5]


@pytest.mark.parametrize("edit", ["chunk shape [0, 32]", "shard shape [-48, 32]"])
def test_damaged_array_metadata_is_a_corrupt_error_naming_the_file(copy, tmp_path, edit):
    """A zero or negative extent in an array's zarr.json (it carries no checksum) was
    a ZeroDivisionError or an OSError (EINVAL)."""
    def change(m):  # l1.weight: (48, 32)
        if edit.startswith("chunk"):
            m["codecs"][0]["configuration"]["chunk_shape"] = [0, 32]
        else:
            m["chunk_grid"]["configuration"]["chunk_shape"] = [-48, 32]
    shape = edit.split(" [")[0]
    _metadata_refused(copy(), tmp_path, change, rf"{shape} \[.*\] is not 2 positive integers\)")


def _metadata_refused(ck, tmp_path, change, why: str) -> None:
    """`change(meta)` edits exp_avg/l1.weight's zarr.json in checkpoint `ck`: the resume
    is a CheckpointCorruptError naming the file and `why` (a pattern), and verify()
    lists that file alone."""
    meta = ck / "exp_avg" / "l1.weight" / "zarr.json"
    m = json.loads(meta.read_text())
    change(m)
    meta.write_text(json.dumps(m))
    want = (rf"array exp_avg/l1\.weight: no readable shard and chunk shape in .*"
            rf"exp_avg/l1\.weight/zarr\.json \(its {why}")
    with pytest.raises(offload.CheckpointCorruptError, match=want):
        _resume(ck, tmp_path)
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and "exp_avg/l1.weight/zarr.json" in problems[0]


_LAYOUT_EDITS = {
    "data_type": lambda m, c: m.update(data_type="int32"),
    "chunk codecs": lambda m, c: c["codecs"][0]["configuration"].update(endian="big"),
    "index codecs": lambda m, c: c["index_codecs"].pop(),
    "chunk key encoding": lambda m, c: m.update(
        chunk_key_encoding={"name": "default", "configuration": {"separator": "."}}),
    # zarr readers follow these too; they passed every check
    "zarr_format": lambda m, c: m.update(zarr_format=2),
    "node_type": lambda m, c: m.update(node_type="group"),
    "chunk grid": lambda m, c: m["chunk_grid"].update(name="rectilinear"),
    "fill_value": lambda m, c: m.update(fill_value=1.0),
    "storage transformers": lambda m, c: m.update(storage_transformers=[{"name": "x"}]),
}


@pytest.mark.parametrize("what", list(_LAYOUT_EDITS))
def test_array_metadata_of_another_layout_is_a_corrupt_error(copy, tmp_path, what):
    """A zarr.json whose dtype, byte order, checksums or key encoding differ from the
    save's passed every check (offload reads its chunks by their known layout), while
    tensorstore, which the docs say can open any checkpoint, read other values."""
    _metadata_refused(copy(), tmp_path,
                      lambda m: _LAYOUT_EDITS[what](m, m["codecs"][0]["configuration"]),
                      f"{what} differ from what the save wrote")


_UNREADABLE = """
import json, sys
import offload
from offload.engine import CheckpointReader
from tests.engine.models import TiedTwice
from tests.engine.test_checkpoint_reader_errors import _cfg
ck, swap = sys.argv[1], sys.argv[2]
try:
    offload.initialize(TiedTwice, _cfg(swap), resume=ck).close()
    resumed = "resumed"
except offload.engine.CheckpointError as e:
    resumed = [type(e).__name__, str(e)]
try:
    reader = CheckpointReader(ck)
    print(json.dumps({"resume": resumed, "problems": reader.verify(),
                      "damaged": reader.damaged}))
except offload.engine.CheckpointError as e:  # the commit record itself
    print(json.dumps({"resume": resumed, "problems": [str(e)], "damaged": False}))
"""


@pytest.mark.parametrize("file", [  # a chunk and the record; the others' reads are alike
    "param/l1.weight/c/0/0", pytest.param("exp_avg/l1.weight/zarr.json", marks=pytest.mark.slow),
    pytest.param("ranks/0.json", marks=pytest.mark.slow),
    pytest.param("buffers.json", marks=pytest.mark.slow), "checkpoint.json"])
def test_a_file_this_process_may_not_read_is_not_called_damage(copy, tmp_path, file):
    """A checkpoint file without read permission was a CheckpointCorruptError, "the
    checkpoint is damaged: resume from another", and `info` said "damaged": the
    checkpoint is intact, and the fix is the file's mode."""
    ck = copy()
    (ck / file).chmod(0)
    run = [sys.executable, "-c", _UNREADABLE, str(ck), str(tmp_path / "swap")]
    info = [sys.executable, "-m", "offload.cli.main", "checkpoint", "info", str(ck), "--json"]
    if os.getuid() == 0:  # root reads any file: run without that capability
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's file-read capability")
        caps = "-dac_override,-dac_read_search"
        run, info = (["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"] + cmd
                     for cmd in (run, info))
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    cli, out = run_together([info, run], timeout=120, cwd=root)
    assert cli.returncode == 1, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["integrity"] == "unreadable (permissions)", cli.stdout
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    kind, message = got["resume"]
    assert kind == "CheckpointPermissionError" and "damaged" not in message, message
    assert f"{file} cannot be read (Permission denied)" in message and "chmod" in message
    assert got["damaged"] is False and got["problems"], got
    assert all("lacks permission" in p for p in got["problems"]), got["problems"]


def test_shard_file_replaced_by_a_directory_is_a_corrupt_error(copy, tmp_path):
    """Was an IsADirectoryError from reading the shard's index."""
    ck = copy()
    shard = ck / "exp_avg" / "l1.weight" / "c" / "0" / "0"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(offload.CheckpointCorruptError,
                       match=r"array exp_avg/l1\.weight, chunk \(0, 0\): cannot be read back "
                             r"intact \(is a directory, not a shard file; file .*exp_avg/"
                             r"l1\.weight/c/0/0\)"):
        _resume(ck, tmp_path)
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and "is a directory, not a shard file" in problems[0]


def test_missing_rank_file_is_found_before_any_state_is_read(copy, tmp_path):
    """Was a raw FileNotFoundError once the whole state had been read, and `verify`
    (`offload checkpoint info`) called the checkpoint intact."""
    ck = copy()
    (ck / "ranks" / "0.json").unlink()
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and "ranks/0.json is missing (rank 0 of 1" in problems[0]
    _damage_a_chunk(ck)
    with pytest.raises(offload.CheckpointCorruptError,
                       match=r"rank file .*ranks/0\.json is missing \(rank 0 of 1 wrote it\)"):
        _resume(ck, tmp_path)


@pytest.mark.parametrize("damage", ["edited", "another save's"])
def test_changed_rank_file_is_found_by_verify_and_before_any_state_is_read(copy, saved,
                                                                           tmp_path, damage):
    """An edited rank file fails its sha256; one copied from another save (its sha256
    intact) differs from the commit record's copy of it."""
    ck = copy()
    rank = ck / "ranks" / "0.json"
    if damage == "edited":
        rank.write_text(rank.read_text().replace('"rank": 0', '"rank": 1'))
        want = r"ranks/0\.json does not match its sha256"
    else:
        shutil.copyfile(saved / "step-2" / "ranks" / "0.json", rank)
        want = r"ranks/0\.json does not match the commit record \(.*steps.*\): it is another"
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and re.search(want, problems[0]), problems
    _damage_a_chunk(ck)
    with pytest.raises(offload.CheckpointCorruptError, match=want):
        _resume(ck, tmp_path)


@pytest.mark.parametrize("entry,damage", [
    ("torch", lambda rng: rng.pop("torch")), ("torch", lambda rng: rng.update(torch="AAAA")),
    ("python", lambda rng: rng.update(python=[3, [1, 2], None])),
    ("numpy", lambda rng: rng["numpy"].__setitem__(1, [1, 2]))])
def test_a_re_signed_rank_file_with_a_damaged_rng_is_refused_before_anything_changes(
        copy, tmp_path, entry, damage):
    """The rank file's RNG states have no copy in the commit record: a damaged one with
    a sha256 that matches passed `verify`, and resuming raised a raw KeyError or
    IndexError naming no file, after the process's torch RNG state had changed."""
    from offload.engine.checkpoint_files import _digest

    ck = copy()
    rank = ck / "ranks" / "0.json"
    obj = json.loads(rank.read_text())
    damage(obj["rng"])
    obj["sha256"] = _digest(obj)
    rank.write_text(json.dumps(obj))
    want = rf"ranks/0\.json has a damaged 'rng' entry '{entry}'"
    problems = CheckpointReader(ck).verify()
    assert len(problems) == 1 and re.search(want, problems[0]), problems
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(offload.CheckpointCorruptError, match=want):
        _resume(ck, tmp_path)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_takes_the_commit_record_for_its_directory(copy, tmp_path):
    """resume="ck/checkpoint.json" said "does not exist"; another file inside is
    refused as not a directory."""
    ck = copy()
    with _resume(ck / "checkpoint.json", tmp_path) as e:
        assert e.global_step == 1
    with pytest.raises(offload.CheckpointError,
                       match=r"ranks/0\.json is a file, not a checkpoint directory: pass the "
                             r"directory save_checkpoint wrote \(it holds checkpoint\.json\)"):
        _resume(ck / "ranks" / "0.json", tmp_path)


def test_a_checkpoint_removed_while_read_is_not_called_damaged(copy):
    """A save's keep_checkpoints pruning the checkpoint a reader has open (it renames it
    to a .partial name, then removes it): the next read says the checkpoint was
    removed, not that it is damaged."""
    ck = copy()
    reader = CheckpointReader(ck)
    try:
        name = next(iter(reader.tensors))
        reader.read_range("param", name, 0, 1)
        ck.rename(ck.with_name(f".{ck.name}.partial"))
        with pytest.raises(offload.engine.CheckpointError,
                           match=f"checkpoint {re.escape(str(ck))} was removed while it was "
                                 r"read .*keep_checkpoints") as got:
            reader.read_range("param", name, 0, 1)
        assert not isinstance(got.value, offload.engine.CheckpointCorruptError)
    finally:
        reader.close()


def _edit_record(ck, edit):
    """`edit(record)` changes the commit record of `ck`, which is written again with its
    sha256: a record whose checksum matches but whose fields are not what a save wrote."""
    from offload.engine.training_checkpoint import RECORD, _read_json, _write_json
    rec = _read_json(ck / RECORD)
    del rec["sha256"]
    edit(rec)
    _write_json(ck / RECORD, rec)
    return ck


_RECORD_EDITS = {  # name: (edit, the field the error names)
    "world a string": (lambda r: r.update(world="2"), r"world is '2', expected a positive"),
    "world of 10**12": (lambda r: r.update(world=10**12),
                        r"written by 1000000000000 ranks but holds the records of ranks \[0\]"),
    "world 0": (lambda r: r.update(world=0), r"world is 0, expected a positive integer"),
    "no global_step": (lambda r: r.pop("global_step"), r"global_step is missing"),
    "no world": (lambda r: r.pop("world"), r"world is missing"),
    "no dtype": (lambda r: r.pop("dtype"), r"dtype is missing"),
    "no tensors": (lambda r: r.pop("tensors"), r"tensors is missing"),
    "tensors a string": (lambda r: r.update(tensors="x"), r"tensors is 'x', expected a JSON "
                                                          r"object, each entry a tensor"),
    "tensors a list": (lambda r: r.update(tensors=[1]), r"tensors is \[1\], expected"),
    "tensors null": (lambda r: r.update(tensors=None), r"tensors is None, expected"),
    "a tensor without kinds": (lambda r: r["tensors"]["l1.weight"].pop("kinds"),
                               r"tensors\['l1\.weight'\] is \{.*, expected a tensor with"),
    "a kind's dtype a list": (lambda r: r["tensors"]["l1.weight"]["kinds"].update(param=[]),
                              r"tensors\['l1\.weight'\] is"),
    "no version": (lambda r: r.pop("version"), r"version is missing"),
    "no extra": (lambda r: r.pop("extra"), r"extra is missing"),
    "ranks a number": (lambda r: r.update(ranks=5), r"ranks is 5, expected a list"),
    "ranks a string": (lambda r: r.update(ranks="x"), r"ranks is 'x', expected a list"),
    "a rank without writes": (lambda r: r["ranks"][0].pop("writes"), r"ranks\[0\] is \{"),
    "global_step a float": (lambda r: r.update(global_step=1.5), r"global_step is 1\.5"),
    "loss_scale a string": (lambda r: r.update(loss_scale="1"), r"loss_scale is '1'"),
    "no param_groups": (lambda r: r.update(param_groups=[]), r"param_groups is \[\], expected "
                                                             r"a non-empty list"),
}


@pytest.mark.parametrize("what", list(_RECORD_EDITS))
def test_a_record_of_wrong_types_is_a_corrupt_error_naming_the_field(copy, what):
    """A commit record whose sha256 matches but whose fields have other types or ranges
    than a save writes was a TypeError or KeyError, or (a world of 10**12 ranks) a
    `verify` that never ended: refused on opening, naming the file and the field."""
    edit, field = _RECORD_EDITS[what]
    ck = _edit_record(copy(), edit)
    with pytest.raises(offload.CheckpointCorruptError,
                       match=rf"checkpoint\.json: damaged record: {field}.*the checkpoint is "
                             "damaged"):
        CheckpointReader(ck)


def test_a_record_whose_ranks_leave_a_gap_in_a_group_is_refused_before_placing(copy, tmp_path):
    """The ranks' ranges of a group must cover it whole: a record (its sha256 matching)
    whose only rank (and its own file) wrote half of a group is refused on opening,
    naming the group, before any group is placed."""
    from offload.engine.training_checkpoint import _read_json, _write_json

    def short(writes):
        writes["1"] = [writes["1"][0], writes["1"][1] // 2]  # group 1: not padded
    ck = _edit_record(copy(), lambda rec: short(rec["ranks"][0]["writes"]))
    mine = _read_json(ck / "ranks" / "0.json")  # the rank's own file says the same
    del mine["sha256"]
    short(mine["writes"])
    _write_json(ck / "ranks" / "0.json", mine)
    with pytest.raises(offload.CheckpointError, match=r"group 1 is covered only up to"):
        _resume(ck, tmp_path)


@pytest.mark.parametrize("what", [
    "world of 10**12",
    # the same refusal on the command line; the in-process test above covers every field
    *(pytest.param(w, marks=pytest.mark.slow)
      for w in ("world a string", "tensors a string", "ranks a number"))])
def test_offload_checkpoint_and_resume_refuse_a_record_of_wrong_types(copy, tmp_path, what):
    """`offload checkpoint info` and `export` print one line and exit with code 1 (as for
    any damage); `initialize(resume=...)` raises the same CheckpointCorruptError."""
    edit, field = _RECORD_EDITS[what]
    ck = _edit_record(copy(), edit)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    for args in (["info", str(ck)], ["export", str(ck), "--to", str(tmp_path / "out")]):
        out = subprocess.run([sys.executable, "-m", "offload.cli.main", "checkpoint", *args],
                             capture_output=True, text=True, timeout=60, cwd=root)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert re.search(rf"^offload checkpoint {args[0]}: checkpoint file .*checkpoint\.json: "
                         rf"damaged record: {field}", out.stderr), out.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(offload.CheckpointCorruptError, match=rf"damaged record: {field}"):
        _resume(ck, tmp_path)


_DEEP = "[" * 100_000  # JSON nested past Python's recursion limit


def _fifo(p):
    p.unlink()
    os.mkfifo(p)


@pytest.mark.parametrize("what,damage,want", [
    ("a nested record", lambda ck: (ck / "checkpoint.json").write_text(_DEEP),
     r"checkpoint file .*checkpoint\.json is not valid JSON: nested deeper"),
    ("a nested zarr.json", lambda ck: (ck / "param" / "l1.weight" / "zarr.json").write_text(
        _DEEP), r"no readable shard and chunk shape in .*l1\.weight/zarr\.json \(nested"),
    ("a FIFO zarr.json", lambda ck: _fifo(ck / "param" / "l1.weight" / "zarr.json"),
     r"no readable shard and chunk shape in .*l1\.weight/zarr\.json \(is not a regular"),
    ("a FIFO shard", lambda ck: _fifo(ck / "param" / "l1.weight" / "c" / "0" / "0"),
     r"array param/l1\.weight, chunk \(0, 0\): .*is not a regular file")])
def test_a_record_array_or_shard_a_reader_cannot_follow_is_damage(copy, tmp_path, what,
                                                                   damage, want):
    """JSON nested thousands deep raised a RecursionError (a traceback from `offload
    checkpoint info`); a FIFO in place of an array's zarr.json or shard blocked the
    reader for good, waiting for a writer. Each is damage named in one line."""
    ck = copy()
    damage(ck)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-m", "offload.cli.main", "checkpoint", "info",
                          str(ck)], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout, out
    assert re.search(want, out.stderr + out.stdout), out
    with pytest.raises(offload.CheckpointCorruptError, match=want):
        _resume(ck, tmp_path)
