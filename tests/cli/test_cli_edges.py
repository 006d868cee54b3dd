"""Tests of the command line as a user runs it: real processes, real files, the exit
code and the one line on stderr (no traceback) for what a user gets wrong, and no
exit code 0 when the command's work failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import run_together
from .one_process import run_each

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(OFFLOAD + args, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=_env())


def _one_line(err: str) -> str:
    """stderr without transformers' own log lines: must be one line, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


def _gpt2_dir(tmp_path: Path, positions: int) -> Path:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64,
        "n_positions": positions, "bos_token_id": 0, "eos_token_id": 0}))
    return d


# -- estimate / tune: the batch shape against the model's context --------------------------------

def test_estimate_default_seq_fits_the_models_positions(tmp_path, monkeypatch, offload_cli):
    """A GPT-2 config with 64 positions: the default --seq (512) is more tokens than the
    model can take (a real step fails with an index error), so the figures were those of a
    batch that cannot run. The default must be the model's context when it is shorter.
    (In this process: test_estimate_refuses_seq_above_the_models_positions runs one.)"""
    _gpt2_dir(tmp_path, 64)
    monkeypatch.chdir(tmp_path)
    rc, out, err = offload_cli(["estimate", "gpt2", "--batch", "1", "--placement",
                                "nvme/host/nvme", "--json"])
    assert rc == 0, err
    assert json.loads(out)["tokens_per_batch"] == 64


def test_estimate_refuses_seq_above_the_models_positions(tmp_path):
    _gpt2_dir(tmp_path, 64)
    out = _run(["estimate", "gpt2", "--batch", "1", "--seq", "65", "--json"], tmp_path)
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert line.startswith("offload estimate: --seq: 65 is above") and "64" in line, line
    assert out.stdout == ""


# -- tune: real steps that all fail ----------------------------------------------------------------

BROKEN = textwrap.dedent("""
    import torch
    from torch import nn

    class Broken(nn.Module):
        # fine on the meta device (what tune records), fails on real tensors
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            if not x.is_meta:
                raise RuntimeError("this model cannot run for real")
            return self.b(self.a(x))

    def build():
        return Broken()
    """)


@pytest.mark.slow  # real steps of every candidate: the default suite's time
def test_tune_fails_when_every_real_step_fails(tmp_path):
    """Every calibration run raised: tune wrote an uncalibrated configuration of a model
    that cannot train, with exit code 0 and not a word about it."""
    (tmp_path / "brokenmodels.py").write_text(BROKEN)
    out = _run(["tune", "brokenmodels:build", "--swap", str(tmp_path / "swap"), "--device",
                "cpu", "--minutes", "0.5", "--calibrate", "1", "--finalists", "0",
                "--probe-size", "8MiB", "--host-budget", "1GiB", "--device-budget", "64MiB",
                "--write", str(tmp_path / "o.toml"), "--json"], tmp_path)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "this model cannot run for real" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "o.toml").exists()


def test_tune_write_directory_suggests_a_toml_name(tmp_path):
    """--write DIR: the fix offered must be one --write accepts (a .toml name), not
    'out.json', which --write refuses next."""
    (tmp_path / "d.toml").mkdir()
    for target in ("d.toml", "."):
        out = _run(["tune", "x:y", "--swap", str(tmp_path / "swap"), "--write", target],
                   tmp_path)
        assert out.returncode == 2
        line = _one_line(out.stderr)
        assert "--write" in line and "out.json" not in line and ".toml" in line, line


# -- bench step: exit code of a run whose every measurement failed -------------------------------

def test_bench_step_exit_code_when_every_run_failed(tmp_path):
    out = _run(["bench", "step", "--dim", "64", "--layers", "1", "--batch", "1", "--steps",
                "1", "--warmup", "0", "--rounds", "1", "--system", "offload", "--placement",
                "none", "--timeout", "0.01", "--path", str(tmp_path / "p"), "--json"],
               tmp_path)
    assert out.returncode == 1, out.stderr
    res = json.loads(out.stdout)  # the result is still printed
    assert res["results"][0]["median_step_s"] is None
    assert "offload bench step:" in out.stderr and "offload none" in out.stderr


# -- bench adam / checkpoint: sizes the machine cannot hold -----------------------------------------

def test_bench_adam_elements_beyond_memory_is_one_line(tmp_path):
    out = _run(["bench", "adam", "--elements", "1e15", "--rounds", "1"], tmp_path)
    assert out.returncode == 1
    line = _one_line(out.stderr)
    assert line.startswith("offload bench adam: --elements: '1e15' needs") and \
        "lower --elements" in line, line


def test_bench_checkpoint_params_beyond_the_disk_is_refused_at_once(tmp_path):
    """--params 1e13 (a 120 TB checkpoint): refused before minutes of building, not after."""
    out = _run(["bench", "checkpoint", "--params", "1e13", "--repeats", "1", "--path",
                str(tmp_path / "ck" / "sub")], tmp_path, timeout=60)
    assert out.returncode == 1
    line = _one_line(out.stderr)
    assert line.startswith("offload bench checkpoint: --params: '1e13' needs") and \
        "lower --params" in line, line
    assert not (tmp_path / "ck").exists()  # nothing made


@pytest.mark.slow  # 4 s; the directories a bench made are checked by default through bench store
def test_bench_checkpoint_leaves_no_directories_it_made(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    out = _run(["bench", "checkpoint", "--params", "100K", "--dim", "64", "--batch", "4",
                "--repeats", "1", "--path", str(keep), "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["layers"] == 24
    assert list(keep.iterdir()) == []  # no swap-a, swap-b0 left in the user's directory


# -- text the user gives, shown as given -----------------------------------------------------

def test_brackets_in_paths_are_shown_as_given(tmp_path):
    """rich read `[/x]` in a path as a closing tag (a traceback) and `[bold]` as a style
    (another path shown): paths in the demo's and estimate's output are literal text."""
    swap = tmp_path / "s[/x]w[bold]"
    (tmp_path / "m[").mkdir()
    model = _gpt2_dir(tmp_path, 64).rename(tmp_path / "m[" / "x]d")
    demo, est = run_together([
        OFFLOAD + ["demo", "--tiny", "--steps", "1", "--trace", "none", "--swap-dir", str(swap)],
        OFFLOAD + ["estimate", str(model), "--batch", "1", "--seq", "8"]],
        timeout=300, cwd=tmp_path, env=_env())
    assert demo.returncode == 0, demo.stderr
    assert f"{swap}/offload-demo-" in demo.stdout
    assert est.returncode == 0 and "m[/x]d" in est.stdout, est.stderr


def test_demo_errors_are_one_line_however_long(tmp_path):
    """The demo's own errors (here: too little disk for --size) went through a console
    that wraps at 80 columns when stderr is not a terminal: one line now."""
    r = _run(["demo", "--size", "100B", "--trace", "none", "--swap-dir", str(tmp_path)],
             tmp_path)
    assert r.returncode == 1 and "--size" in _one_line(r.stderr)


def test_demo_refuses_values_beyond_its_limits_at_once(tmp_path):
    cases = {"--batch": ["--tiny", "--batch", "1000000000000"], "--size": ["--size", "1e15"],
             "--trace": ["--tiny", "--trace", " "]}
    got = run_each([["demo", "--steps", "1", *args] for args in cases.values()], tmp_path,
                   _env(), timeout=60)
    for flag, (rc, err) in zip(cases, got):
        assert rc == 2 and _one_line(err).startswith(f"offload demo: {flag}:"), (flag, err)
    assert os.listdir(tmp_path) == []


def test_a_bad_native_isa_switch_is_one_line(tmp_path):
    env_isa = {"OFFLOAD_NATIVE_ISA": "AVX2"}
    r = subprocess.run(OFFLOAD + ["demo", "--tiny", "--steps", "1", "--trace", "none"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **env_isa})
    assert r.returncode == 2
    assert "OFFLOAD_NATIVE_ISA: 'AVX2' is not one of" in _one_line(r.stderr)


@pytest.mark.parametrize("swap, write, flag", [
    ("sw\udcff", "o.toml", "--swap"),
    ("sw", "o\x01.toml", "--write"),
])
def test_tune_refuses_names_toml_cannot_hold_before_it_runs(tmp_path, swap, write, flag):
    r = subprocess.run([*OFFLOAD, "tune", "mm:build", "--swap", swap, "--write", write],
                       capture_output=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and _one_line(err).startswith(f"offload tune: {flag}:"), err
    assert not (tmp_path / "o.toml").exists()


@pytest.mark.parametrize("device", ["cuda:00", "cuda:2147483648"])
def test_store_device_strings_torch_cannot_parse_are_config_errors(device):
    import offload
    with pytest.raises(offload.ConfigError, match="store.device"):
        offload.load_config({"store": {"device": device}})


def test_a_swap_kind_too_long_for_a_file_name_is_refused():
    import offload
    with pytest.raises(offload.ConfigError, match=r"store.swap_kinds\[0\].*1 to 64"):
        offload.load_config({"store": {"swap_kinds": ["k" * 300]}})
