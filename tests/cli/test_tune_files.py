"""`offload tune` and the user's files: the config it writes (never over a file it did
not write, never half-written, into a directory it may have to make), the swap
directory it makes (removed again when it fails or is interrupted) and the disk
probe's files (removed on a failing disk). The machine's probes are replaced by
fixed rates where the test is about files, so each run takes seconds."""

import dataclasses
import errno
import json
import os
import re
import stat
import subprocess
import sys

import pytest
from torch import nn

from offload.cli import tune as tune_cli
from offload.cli import tune_probe
from offload.cli.tune_probe import DiskRates, MachineProbe
from offload.config import load_config

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = f"{__name__}:tiny"
MiB = 1 << 20


def tiny():
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


def _fake_probe(args, spec, mm, device, progress) -> MachineProbe:
    disk = [DiskRates(bs, qd, 1e9, 1e9, 1e9, "fake") for bs, qd in tune_probe.IO_GRID]
    return MachineProbe(disk, 1 << 40, 0.0, 1e9, 1e10)


@pytest.fixture
def fast(monkeypatch):
    """The machine's probes as fixed rates (the files are what these tests are about)."""
    monkeypatch.setattr(tune_cli, "probe_machine", _fake_probe)


def _argv(swap, *extra):
    return ["tune", MODEL, "--dtype", "fp32", "--device", "cpu", "--swap", str(swap),
            "--host-budget", "64MiB", "--device-budget", "8MiB", "--calibrate", "0",
            "--finalists", "0", "--group-sizes", "8192", "--json", *extra]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_write_does_not_replace_a_file_tune_did_not_write(tmp_path, offload_cli, fast):
    mine = tmp_path / "offload.toml"
    mine.write_text("[engine]\nparams = \"host\"  # my hand-tuned config\n")
    rc, out, err = offload_cli(_argv(tmp_path / "swap", "--write", str(mine)))
    assert rc == 2 and out == ""
    assert _one_line(err).startswith("offload tune: --write: ") and "--force" in err
    assert mine.read_text() == "[engine]\nparams = \"host\"  # my hand-tuned config\n"
    assert not (tmp_path / "swap").exists()  # refused before any work
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(mine), "--force"))
    assert rc == 0, err
    assert mine.read_text().startswith("# written by offload tune")
    load_config(str(mine))


def test_write_replaces_its_own_file_and_makes_its_directory(tmp_path, offload_cli, fast):
    out = tmp_path / "new" / "dir" / "offload.toml"
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(out)))
    assert rc == 0, err
    first = out.read_text()
    assert first.startswith("# written by offload tune")
    out.write_text(first.replace("offload tune for", "offload tune (old run) for"))
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(out)))
    assert rc == 0, err  # a re-run refreshes tune's own file
    assert out.read_text() == first
    assert sorted(os.listdir(out.parent)) == ["offload.toml"]  # no temporary left
    assert load_config(str(out)).io.paths == [str(tmp_path / "swap")]


@pytest.mark.parametrize("name", ["offload.json", ".toml"])
def test_write_is_a_toml_file(tmp_path, offload_cli, fast, name):
    """'.toml' has no suffix for load_config: it was written after the whole tune, then
    refused, and left behind."""
    target = tmp_path / name
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(target)))
    assert rc == 2
    assert _one_line(err).startswith("offload tune: --write: ") and ".toml" in err
    assert not target.exists() and not (tmp_path / "swap").exists()


def test_write_takes_a_suffix_in_capitals_as_load_config_does(tmp_path):
    from offload.cli.tune import toml_file
    assert toml_file(str(tmp_path / "OFFLOAD.TOML")) == str(tmp_path / "OFFLOAD.TOML")


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, offload_cli, fast, monkeypatch):
    out = tmp_path / "offload.toml"
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(out)))
    assert rc == 0, err
    before = out.read_text()
    real_fsync = os.fsync

    def full(fd):  # the disk fills as the new file is flushed (a directory's fsync is fine)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", full)
    rc, _, err = offload_cli(_argv(tmp_path / "swap", "--write", str(out)))
    assert rc == 1
    line = _one_line(err)
    assert str(out) in line and "No space left on device" in line and "--write" in line
    assert out.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["offload.toml", "swap"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_tune_removes_the_swap_directory_it_made(tmp_path, offload_cli,
                                                                 monkeypatch, stop):
    def interrupted(*a, **k):
        raise stop(143) if stop is SystemExit else stop()
    monkeypatch.setattr(tune_cli, "probe_machine", interrupted)
    rc, _, _ = offload_cli(_argv(tmp_path / "a" / "swap", "--write",
                                 str(tmp_path / "offload.toml")))
    assert rc == (130 if stop is KeyboardInterrupt else 143)
    assert os.listdir(tmp_path) == []


def test_impossible_budgets_leave_no_swap_directory(tmp_path, offload_cli):
    rc, _, err = offload_cli(_argv(tmp_path / "a" / "swap", "--host-budget", "8KiB"))
    assert rc == 2 and "does not fit" in err
    assert os.listdir(tmp_path) == []


def test_a_disk_that_fails_the_probe_is_one_line_exit_1(tmp_path, offload_cli, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    rc, out, err = offload_cli(_argv(tmp_path / "swap"))
    assert rc == 1 and out == ""
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith("offload tune: --swap: ")
    assert "No space left on device" in line and "free" in line
    assert os.listdir(tmp_path) == []  # neither the probe's file nor the swap directory


def test_the_disk_probe_writes_at_most_its_share_of_the_free_space(tmp_path, monkeypatch):
    sizes = []
    real = tune_probe.DiskProbe

    def spy(cfg, directory, nbytes):
        sizes.append(nbytes)
        return real(cfg, directory, nbytes)
    monkeypatch.setattr(tune_probe, "DiskProbe", spy)
    free = 40 * MiB
    got = tune_probe.probe_disk(str(tmp_path / "p"), 8 * MiB, grid=((4 * MiB, 32),),
                                limit=free // 4)
    assert len(got) == 1 and sizes and max(sizes) <= free // 4
    assert os.listdir(tmp_path) == []


def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run(OFFLOAD + _argv(tmp_path / "swap", "--device", "cuda"),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2
    assert _one_line(out.stderr).startswith("offload tune: --device: ")
    assert not (tmp_path / "swap").exists()


def test_a_full_swap_disk_still_tunes_a_model_that_fits_in_memory(tmp_path, offload_cli,
                                                                   monkeypatch):
    free = 4096
    real = tune_cli.shutil.disk_usage

    def usage(path):
        return real(path)._replace(free=free)

    def probe(*a):
        return dataclasses.replace(_fake_probe(*a), disk_free=free)
    monkeypatch.setattr(tune_cli.shutil, "disk_usage", usage)
    monkeypatch.setattr(tune_cli, "probe_machine", probe)
    rc, out, err = offload_cli(_argv(tmp_path / "swap"))
    assert rc == 0, err
    best = json.loads(out)["best"]["engine"]
    assert "nvme" not in (best["params"], best["grads"], best["optimizer"])


def test_the_table_says_the_buffers_share_the_buffer_budget(tmp_path, offload_cli, fast,
                                                           monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    rc, out, err = offload_cli([a for a in _argv(tmp_path / "swap") if a != "--json"])
    assert rc == 0, err
    # optim.buffers chunk buffers within io.buffer_budget, not buffers of that size each
    assert re.search(r"\b\d in \d+\.\d MiB", out), out
    assert not re.search(r"\b\d x \d+\.\d MiB", out), out
