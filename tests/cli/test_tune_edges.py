"""`offload tune` and `offload estimate` end to end as a user coming from DeepSpeed, FSDP
or Hugging Face runs them: the file tune writes given to `offload.initialize` and
trained against plain PyTorch AdamW within the budgets it chose, budgets the machine
cannot hold, a swap path TOML must escape, a Hugging Face model returned by a
function, and a Python file's path given as MODEL. Where a test is about the files
and the choice rather than the machine, the machine's probes are fixed rates (as in
test_tune_files.py), so each tune takes seconds."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.cli import tune as tune_cli
from offload.cli import tune_probe
from offload.cli.tune import to_toml
from offload.cli.tune_probe import DiskRates, MachineProbe
from offload.config import load_config, parse_bytes, toml_loads

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
MODELS = textwrap.dedent("""
    from torch import nn

    def mlp():
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])

    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                          n_positions=64, bos_token_id=0, eos_token_id=0))
    """)


def _fixed_probe(args, spec, mm, device, progress) -> MachineProbe:
    disk = [DiskRates(bs, qd, 1e9, 1e9, 1e9, "fixed") for bs, qd in tune_probe.IO_GRID]
    return MachineProbe(disk, 1 << 40, 0.0, 1e9, 1e10)


@pytest.fixture
def work(user_module):
    """A directory holding the models module (imported by name, as a user's would be),
    the current directory of the test."""
    return user_module("tunecase_models", MODELS)


@pytest.fixture
def fixed(monkeypatch):
    monkeypatch.setattr(tune_cli, "probe_machine", _fixed_probe)


def _tune_argv(swap, *extra):
    return ["tune", "tunecase_models:mlp", "--dtype", "fp32", "--device", "cpu", "--swap",
            str(swap), "--calibrate", "0", "--finalists", "0", "--group-sizes", "262656",
            "--json", *extra]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _train_against_adamw(path: str, steps: int = 3) -> dict[str, int]:
    """Trains the MLP under the config file `path` and plain torch AdamW with the file's
    hyperparameters side by side (the file's micro-batches a step, the mean of their
    gradients, clipped where it clips); checks losses and weights agree; the store's
    peaks."""
    from tunecase_models import mlp

    cfg = load_config(path)
    torch.manual_seed(0)
    ref = mlp()
    engine = offload.initialize(copy.deepcopy(ref), path)
    o = cfg.optim
    opt = torch.optim.AdamW(ref.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay)
    micro = cfg.engine.grad_accum_steps
    try:
        for i in range(steps):
            opt.zero_grad()
            for j in range(micro):
                x = torch.randn(8, 512, generator=torch.Generator().manual_seed(i * micro + j))
                loss = engine(x).square().mean()
                engine.backward(loss)
                want = ref(x).square().mean()
                (want / micro).backward()
                assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-9)
            assert engine.step()
            if o.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), o.max_grad_norm)
            opt.step()
        got = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k].float(), v, rtol=1e-5, atol=1e-6)
        return {t: s.peak for t, s in engine.store.stats().tiers.items()}
    finally:
        engine.close()


def test_written_config_trains_like_adamw_within_its_budgets(work, offload_cli, fixed):
    """tune -> file -> initialize -> steps: the state (16.8 MB) exceeds the budgets, so the
    optimizer streams from the swap directory; the numbers are AdamW's, and the store
    keeps within the budgets the file names, which keep within the flags."""
    rc, out, err = offload_cli(_tune_argv(work / "swap", "--host-budget", "12MiB",
                                          "--device-budget", "2MiB", "--write", "o.toml"))
    assert rc == 0, err
    res = json.loads(out)
    cfg = load_config(str(work / "o.toml"))
    assert cfg.engine.optimizer == "nvme" and res["best"]["engine"]["optimizer"] == "nvme"
    assert cfg.io.paths == [str(work / "swap")]
    assert cfg.store.device_budget <= 2 * MiB
    assert cfg.store.host_budget + cfg.io.buffer_budget <= 12 * MiB
    peaks = _train_against_adamw(str(work / "o.toml"))
    assert peaks["DEVICE"] <= cfg.store.device_budget
    assert peaks["HOST"] <= cfg.store.host_budget
    assert peaks["NVME"] > 0


def test_a_config_tuned_for_clipping_clips_and_trains_within_its_budgets(
        work, offload_cli, fixed, capsys, monkeypatch):
    """With clipping the gradients are stored until step() under NVMe optimizer
    state: tune's budgets count them, and the file it writes clips as asked (the
    first step's gradient norm is about 0.05, so 0.01 clips every step)."""
    rc, out, err = offload_cli(_tune_argv(work / "swap", "--host-budget", "12MiB",
                                          "--device-budget", "2MiB", "--max-grad-norm",
                                          "0.01", "--write", "o.toml"))
    assert rc == 0, err
    assert json.loads(out)["max_grad_norm"] == 0.01
    monkeypatch.setenv("COLUMNS", "300")
    capsys.readouterr()
    tune_cli.render(json.loads(out), 3)
    assert "fp32, batch 8, clipping at 0.01)" in capsys.readouterr().out
    cfg = load_config(str(work / "o.toml"))
    assert cfg.optim.max_grad_norm == 0.01 and cfg.engine.optimizer == "nvme"
    assert cfg.store.device_budget <= 2 * MiB
    assert cfg.store.host_budget + cfg.io.buffer_budget <= 12 * MiB
    peaks = _train_against_adamw(str(work / "o.toml"))
    assert peaks["DEVICE"] <= cfg.store.device_budget
    assert peaks["HOST"] <= cfg.store.host_budget
    # the modelled step stores the gradients until step(): where they are homed on
    # NVMe it writes and reads them back, so every such configuration predicts a longer
    # step, and none a shorter one
    rc, out_plain, err = offload_cli(_tune_argv(work / "swap", "--host-budget", "12MiB",
                                                "--device-budget", "2MiB"))
    assert rc == 0, err

    def steps(text):  # predicted step per configuration, clipping aside
        return {json.dumps({**r["config"], "optim": {k: v for k, v in r["config"]["optim"]
                                                     .items() if k != "max_grad_norm"}},
                           sort_keys=True): r["predicted_step_s"]
                for r in json.loads(text)["results"] if r["placement"].endswith("/nvme")}
    clip, plain = steps(out), steps(out_plain)
    assert clip.keys() == plain.keys() and clip, (clip, plain)
    assert all(clip[k] >= plain[k] * (1 - 1e-9) for k in clip), (clip, plain)
    on_nvme = [k for k in clip if json.loads(k)["engine"]["grads"] == "nvme"]
    assert on_nvme and all(clip[k] > 1.05 * plain[k] for k in on_nvme), (clip, plain)


def test_a_config_tuned_for_accumulation_accumulates_and_trains_within_its_budgets(
        work, offload_cli, fixed, capsys, monkeypatch):
    """With two micro-batches a step the gradients are stored until step(): the file tune
    writes sets engine.grad_accum_steps and trains as AdamW over the micro-batches'
    mean gradient within its budgets; every prediction is at least a quarter longer than
    one micro-batch's (with these fixed rates, 1.3-2.6x: the compute twice, the stored
    gradients), and the tokens a step are twice the batch's."""
    base = _tune_argv(work / "swap", "--host-budget", "12MiB", "--device-budget", "2MiB")
    rc, out, err = offload_cli(base + ["--grad-accum-steps", "2", "--write", "o.toml"])
    assert rc == 0, err
    res = json.loads(out)
    cfg = load_config(str(work / "o.toml"))
    assert res["grad_accum_steps"] == cfg.engine.grad_accum_steps == 2
    assert cfg.store.device_budget <= 2 * MiB
    assert cfg.store.host_budget + cfg.io.buffer_budget <= 12 * MiB
    peaks = _train_against_adamw(str(work / "o.toml"))
    assert peaks["DEVICE"] <= cfg.store.device_budget
    assert peaks["HOST"] <= cfg.store.host_budget
    rc, out_one, err = offload_cli(base)
    assert rc == 0, err
    one = json.loads(out_one)
    assert res["tokens_per_step"] == 2 * one["tokens_per_step"]

    def steps(r):  # predicted step per configuration, accumulation aside
        c = copy.deepcopy(r["config"])
        c["engine"].pop("grad_accum_steps", None)
        return json.dumps(c, sort_keys=True), r["predicted_step_s"]
    accum, plain = dict(map(steps, res["results"])), dict(map(steps, one["results"]))
    both = accum.keys() & plain.keys()
    assert both and all(accum[k] > 1.25 * plain[k] for k in both), (accum, plain)
    monkeypatch.setenv("COLUMNS", "300")
    capsys.readouterr()
    tune_cli.render(res, 3)
    assert "fp32, batch 8 x 2 micro-batches)" in capsys.readouterr().out


def test_tune_searches_clipping_with_its_minimum_budgets(work):
    """The step shapes tune searches for a clipping run carry the clipping, and each
    placement's minimum budgets are those of training that clips (higher host
    minimum under NVMe optimizer state, where the gradients are stored)."""
    from offload.cli.model_arg import ModelSpec

    spec = ModelSpec("function", "tunecase_models:mlp", 8, None, "fp32")
    plain, clipped = (tune_cli.record(spec, [262656], 1.0, "cpu", lambda: None, norm)[0]
                      for norm in (0.0, 1.0))
    assert (plain.clipping, clipped.clipping) == (False, True)
    assert clipped.minimum["nvme/nvme/nvme"][1] > plain.minimum["nvme/nvme/nvme"][1]
    assert clipped.minimum["host/host/host"] == plain.minimum["host/host/host"]
    summed = tune_cli.record(spec, [262656], 1.0, "cpu", lambda: None, 0.0, 2)[0]
    assert (summed.clipping, summed.accum) == (False, 2)
    assert summed.minimum["nvme/nvme/nvme"] == clipped.minimum["nvme/nvme/nvme"]


def test_a_swap_path_beyond_the_bmp_is_written_as_toml_that_loads(work, offload_cli, fixed):
    """JSON escapes a character beyond the BMP as a surrogate pair, which TOML refuses:
    a swap directory named with one made tune run to the end and then fail to write."""
    swap = work / "sw\U0001F600p"
    rc, out, err = offload_cli(_tune_argv(swap, "--host-budget", "64MiB", "--device-budget",
                                          "8MiB", "--write", "o.toml"))
    assert rc == 0, err
    assert load_config(str(work / "o.toml")).io.paths == [str(swap)]
    odd = {"io": {"paths": ['/a/"q"\\b\x7f\x01\tc \u00e9\U0001F600'], "queue_depth": 8,
                  "direct": True}}
    assert toml_loads(to_toml(odd, "header")) == odd


def test_host_budget_above_the_machines_memory_is_refused(work, offload_cli, fixed):
    """A budget the machine cannot hold made tune keep the state in memory that is not
    there (a config that runs out of memory instead of streaming from NVMe)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cases = [(["--host-budget", "4096TiB", "--device-budget", "64MiB"], "--host-budget: "),
             (["--host-budget", str(ram // 4096 * 3 // 4 * 4096), "--device-budget",
               str(ram // 4096 * 3 // 4 * 4096)], "--host-budget and --device-budget: ")]
    for flags, words in cases:
        rc, out, err = offload_cli(_tune_argv(work / "swap", *flags))
        assert rc == 2, out[-2000:]
        line = _one_line(err)
        assert line.startswith(f"offload tune: {words}") and "machine's memory" in line, line
        assert not (work / "swap").exists()


def test_the_budget_a_shortfall_asks_for_is_enough(work, offload_cli, fixed):
    """The fix named a budget rounded to the nearest tenth: 1 MiB + 8 KiB missing asked
    for "at least 1.0 MiB", the budget just refused; given what it asks, tune goes on."""
    argv = _tune_argv(work / "swap", "--host-budget", "64MiB", "--device-budget", "1MiB")
    rc, _, err = offload_cli(argv)
    assert rc == 2
    line = _one_line(err)
    m = re.search(r"raise --device-budget to at least ([0-9.]+) (KiB|MiB)", line)
    assert m and "device: " in line, line
    asked = m.group(1) + m.group(2)
    assert parse_bytes(asked) > MiB, line
    rc, out, err = offload_cli(argv[:-1] + [asked])
    assert rc == 0, err
    assert json.loads(out)["budgets"]["device"] == parse_bytes(asked)


def test_a_hugging_face_model_from_a_function_is_estimated_and_tuned(work, offload_cli,
                                                                      fixed):
    """`module:function` returning a transformers model: its forward takes input_ids and
    labels and returns an output object, which the estimate called with one tensor and
    squared (AttributeError); its context bounds the rows as a config's does."""
    rc, out, err = offload_cli(["estimate", "tunecase_models:gpt2", "--batch", "2",
                                "--placement", "host/host/host", "--json"])
    assert rc == 0, err
    est = json.loads(out)
    assert est["tokens_per_batch"] == 2 * 64 and est["activations"]["bytes"] > 0
    rc, _, err = offload_cli(["estimate", "tunecase_models:gpt2", "--seq", "65"])
    assert rc == 2 and "--seq: 65 is above the model's n_positions (64)" in err, err
    # one real calibration run: the batch and loss of the real steps are right too
    rc, out, err = offload_cli(["tune", "tunecase_models:gpt2", "--batch", "2", "--dtype",
                                "fp32", "--device", "cpu", "--swap", str(work / "swap"),
                                "--host-budget", "64MiB", "--device-budget", "8MiB",
                                "--calibrate", "1", "--finalists", "0", "--group-sizes",
                                "8192", "--minutes", "1", "--json"])
    assert rc == 0, err
    runs = json.loads(out)["calibration_runs"]
    assert len(runs) == 1 and runs[0]["measured_step_s"] > 0


@pytest.mark.parametrize("model,fix", [
    ("tunecase_models.py:mlp", "give tunecase_models:mlp ("),
    ("./tunecase_models.py:mlp", "give tunecase_models:mlp with PYTHONPATH=. ("),
])
def test_a_python_files_path_as_model_names_the_module_to_give(work, offload_cli, model, fix):
    rc, out, err = offload_cli(["estimate", model])
    assert rc == 2 and out == ""
    line = _one_line(err)
    assert line.startswith(f"offload estimate: MODEL: {model.split(':')[0]!r} is a file's "
                           "path") and fix in line, line


@pytest.mark.slow  # about 20 s: the real disk probe fills its queues at every grid point
def test_tune_with_the_real_probes_writes_a_config_that_trains_like_adamw(work):
    out = subprocess.run(OFFLOAD + _tune_argv(work / "swap", "--host-budget", "12MiB",
                                              "--device-budget", "2MiB", "--probe-size",
                                              "8MiB", "--write", "o.toml"),
                         capture_output=True, text=True, timeout=300, cwd=work,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{work}"})
    assert out.returncode == 0, out.stderr
    cfg = load_config(str(work / "o.toml"))
    peaks = _train_against_adamw(str(work / "o.toml"))
    assert peaks["DEVICE"] <= cfg.store.device_budget
    assert peaks["HOST"] <= cfg.store.host_budget
    assert not [p for p in os.listdir(work / "swap") if p.startswith(".offload")]


def test_default_budgets_fit_a_smaller_machine(monkeypatch):
    """Left out, the budgets are 16 GiB and 4 GiB where the machine has the memory; on a
    smaller one the defaults were refused as more than it holds, so they are half and
    an eighth of its memory there (the device's only on a CPU device)."""
    big, small = 64 << 30, 8 << 30
    monkeypatch.setattr(tune_cli, "physical_memory", lambda: big)
    assert tune_cli.default_budgets(None, None, "cpu") == tune_cli.Budgets(16 << 30, 4 << 30)
    monkeypatch.setattr(tune_cli, "physical_memory", lambda: small)
    got = tune_cli.default_budgets(None, None, "cpu")
    assert got == tune_cli.Budgets(4 << 30, 1 << 30)
    tune_cli.check_memory_budgets(got, "cpu")  # what the defaults give is accepted
    assert tune_cli.default_budgets(None, None, "cuda").device == 4 << 30
    assert tune_cli.default_budgets(3 << 30, 5 << 30, "cpu") == tune_cli.Budgets(3 << 30, 5 << 30)
