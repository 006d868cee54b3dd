"""Safetensors exports onto a file system that fills up: `offload checkpoint export`
and `engine.save_pretrained`, through the shared writer, leave no file under its
final name and no directory they made, report the file, the space and the fix
(errno kept; the CLI prints one line and exits 1), and can simply be run again.
A real small ext4 is filled to each amount of free space in turn, block by block,
from too little for the shards up to enough for everything, so the disk fills
while a shard, the index or a copied config.json is being written."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import offload
from offload.cli.main import main

from .disks import fill


class LongNames(nn.Module):
    """Small layers under long names: an index of several file-system blocks, so some
    amounts of free space hold every shard but not the index."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({
            f"a_layer_with_a_name_long_enough_to_spread_the_index_over_blocks_{i:03d}":
            nn.Linear(16, 16) for i in range(40)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _blocks(files: list[Path], block: int) -> int:
    return sum(-(-f.stat().st_size // block) for f in files)


def _sweep(mnt: Path, need: int, attempt) -> list[str]:
    """Calls attempt() at each amount of free space from well below `need` blocks up
    to the first that succeeds (attempt returns None) and returns the errors seen."""
    errors = []
    for free in range(need // 2, need + 64):
        fill(mnt, free)
        error = attempt()
        if error is None:
            (mnt / "fill").unlink()
            return errors
        errors.append(error)
    raise AssertionError(f"no export fit in {need + 64} free blocks; errors: {errors[-3:]}")


def _engine(tmp_path, engine_cfg):
    torch.manual_seed(0)
    return offload.initialize(LongNames(), engine_cfg(params="host"))


def _assert_loads(out: Path, want: dict) -> None:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / shard))
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_cli_export_onto_a_full_disk(tmp_path, engine_cfg, small_fs, capsys):
    with _engine(tmp_path, engine_cfg) as e:
        e.save_checkpoint(tmp_path / "ck")
        want = e.state_dict()
    model_dir = tmp_path / "model"
    model_dir.mkdir()  # a config.json of several blocks: the copy can fail too
    (model_dir / "config.json").write_text(json.dumps({"padding": "x" * 6000}))
    mnt = Path(small_fs(16))
    out = mnt / "exports" / "run-1"  # both directories made by the export
    argv = ["checkpoint", "export", str(tmp_path / "ck"), "--to", str(out),
            "--shard-size", "4KB", "--config", str(model_dir)]
    assert main(argv[:4] + [str(tmp_path / "big")] + argv[5:]) == 0
    capsys.readouterr()
    files = sorted((tmp_path / "big").iterdir())
    need = _blocks(files, os.statvfs(mnt).f_frsize)

    def attempt():
        rc = main(argv)
        cap = capsys.readouterr()
        if rc == 0:
            return None
        assert rc == 1, cap.err
        assert not (mnt / "exports").exists(), sorted(p.name for p in out.rglob("*"))
        assert cap.out == ""
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
        line = lines[0]
        assert line.startswith("offload checkpoint export: [Errno 28] "), line
        assert f"cannot write {out}/" in line and "No space left on device" in line, line
        assert "free space on that file system or give another --to" in line, line
        return line
    errors = _sweep(mnt, need, attempt)
    failed = [line.split("cannot write ")[1].split(":")[0] for line in errors]
    assert any(f.endswith(".safetensors") for f in failed), errors
    assert str(out / "model.safetensors.index.json") in failed, errors
    assert str(out / "config.json") in failed, errors
    assert sorted(p.name for p in out.iterdir()) == [f.name for f in files]
    _assert_loads(out, want)
    assert (out / "config.json").read_text() == (model_dir / "config.json").read_text()


@pytest.mark.slow  # the default suite's time: test_cli_export_onto_a_full_disk runs the
# same command through main() at every size that fails, one line and exit code 1 each
def test_cli_export_full_disk_no_traceback(tmp_path, engine_cfg, small_fs):
    """As a user runs it: one line on stderr, exit code 1, and a re-run once there is
    space writes every file."""
    with _engine(tmp_path, engine_cfg) as e:
        e.save_checkpoint(tmp_path / "ck")
    mnt = Path(small_fs(16))
    fill(mnt, 8)
    out = mnt / "out"
    cmd = [sys.executable, "-m", "offload.cli.main", "checkpoint", "export",
           str(tmp_path / "ck"), "--to", str(out), "--shard-size", "4KB"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "[Errno 28]" in r.stderr and "give another --to" in r.stderr, r.stderr
    assert not out.exists()
    (mnt / "fill").unlink()
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors.index.json").is_file()


def test_save_pretrained_onto_a_full_disk(tmp_path, engine_cfg, small_fs):
    mnt = Path(small_fs(16))
    out = mnt / "exports" / "run-1"
    with _engine(tmp_path, engine_cfg) as e:
        want = e.state_dict()
        files = e.save_pretrained(tmp_path / "big", max_shard_size=4096)
        need = _blocks(files, os.statvfs(mnt).f_frsize)

        def attempt():
            try:
                e.save_pretrained(out, max_shard_size=4096)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                assert not (mnt / "exports").exists(), sorted(p.name for p in out.rglob("*"))
                text = str(err)
                assert f"cannot write {out}/" in text and "free space on that file system or " \
                    "write to another directory" in text, text
                return text
            return None
        errors = _sweep(mnt, need, attempt)
    failed = [t.split("cannot write ")[1].split(":")[0] for t in errors]
    assert any(f.endswith(".safetensors") for f in failed), errors
    assert str(out / "model.safetensors.index.json") in failed, errors
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)
    _assert_loads(out, want)


def test_save_pretrained_read_only_target_keeps_errno(tmp_path, engine_cfg, small_fs):
    """Any OSError of the writes, not only a full disk, names the file and the fix and
    keeps its errno (here EROFS)."""
    mnt = Path(small_fs(16))
    (mnt / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    with _engine(tmp_path, engine_cfg) as e:
        with pytest.raises(OSError) as info:
            e.save_pretrained(mnt / "out", max_shard_size=4096)
    assert info.value.errno == errno.EROFS
    # the first file the export makes there is its lock ([Note: all or nothing])
    assert f"cannot write {mnt / 'out'}: Read-only file system" in str(info.value)
    assert "write to another directory" in str(info.value)
    assert os.listdir(mnt / "out") == []
