"""Bad input is refused at `initialize`, before anything is made; nothing is left behind."""

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.config import ConfigError
from offload.io import SwapLockedError, SwapPathError

from .models import TiedTwice, lm_batches, lm_loss


def _step(engine):
    x, y = lm_batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()


@pytest.mark.parametrize("section, key", [("optim", "lr"), ("optim", "weight_decay"),
                                          ("optim", "max_grad_norm")])
def test_nan_hyper_parameters_are_refused_before_any_file(engine_cfg, tmp_path, section, key):
    cfg = engine_cfg("nvme", "nvme", "nvme")
    cfg[section][key] = math.nan
    model = TiedTwice()
    with pytest.raises(ConfigError, match=rf"{section}.{key}: nan is not a finite number"):
        offload.initialize(model, cfg)
    assert not (tmp_path / "swap").exists()
    assert len(list(model.parameters())) > 0  # the model is untouched


def test_a_changed_config_object_is_checked_at_initialize(engine_cfg, tmp_path):
    cfg = offload.load_config(engine_cfg("nvme", "nvme", "nvme"))
    cfg.optim.lr = math.inf
    with pytest.raises(ConfigError, match="optim.lr: inf"):
        offload.initialize(TiedTwice(), cfg)
    assert not (tmp_path / "swap").exists()


def test_swap_path_that_is_a_file_is_refused_at_initialize(engine_cfg, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    cfg = engine_cfg("nvme", "nvme", "nvme")
    cfg["io"]["paths"] = [str(f)]
    with pytest.raises(SwapPathError, match=r"io.paths\[0\]: .* exists and is not a directory"):
        offload.initialize(TiedTwice(), cfg)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_read_only_swap_path_is_refused_at_initialize(engine_cfg, readonly_dir):
    cfg = engine_cfg("nvme", "nvme", "nvme")
    cfg["io"]["paths"] = [str(readonly_dir)]
    with pytest.raises(SwapPathError, match="cannot create files in it") as e:
        offload.initialize(TiedTwice(), cfg)
    assert "O_DIRECT" not in str(e.value)


def test_initialize_refuses_a_wrapped_model_and_an_engine(engine_cfg):
    model = TiedTwice()
    engine = offload.initialize(model, engine_cfg())
    try:
        with pytest.raises(ConfigError, match="TiedTwice was already wrapped by an OffloadEngine"):
            offload.initialize(model, engine_cfg())
        with pytest.raises(ConfigError, match="module '0' gave its parameters"):
            offload.initialize(torch.nn.Sequential(model.l1), engine_cfg())
        with pytest.raises(ConfigError, match="got an OffloadEngine"):
            offload.initialize(engine, engine_cfg())
        _step(engine)  # the refusals changed nothing: the engine still trains
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="already wrapped"):  # also after close
        offload.initialize(model, engine_cfg())


def test_two_engines_on_one_swap_dir_in_one_process(engine_cfg, tmp_path):
    cfg = engine_cfg("nvme", "nvme", "nvme")
    first = offload.initialize(TiedTwice(), cfg)
    try:
        with pytest.raises(SwapLockedError, match=rf"already open in this process \(pid "
                                                  rf"{os.getpid()}\)"):
            offload.initialize(TiedTwice(), cfg)
        _step(first)
    finally:
        first.close()
    assert os.listdir(tmp_path / "swap") == []


def test_switch_interval_is_restored_by_the_last_engine_to_close(engine_cfg, tmp_path):
    before = sys.getswitchinterval()
    a_cfg, b_cfg = engine_cfg(), engine_cfg()
    a_cfg["io"]["switch_interval"] = 0.0007
    b_cfg["io"]["switch_interval"] = 0.0003
    b_cfg["io"]["paths"] = [str(tmp_path / "swap-b")]
    a = offload.initialize(TiedTwice(), a_cfg)
    b = None
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0007)
        b = offload.initialize(TiedTwice(), b_cfg)
        assert sys.getswitchinterval() == pytest.approx(0.0003)  # the shortest asked for
        a.close()
        assert sys.getswitchinterval() == pytest.approx(0.0003)  # b is still open
        a2 = offload.initialize(TiedTwice(), a_cfg)
        b.close()
        assert sys.getswitchinterval() == pytest.approx(0.0007)  # a2 is still open
        a2.close()
        assert sys.getswitchinterval() == before
    finally:
        a.close()
        if b is not None:
            b.close()
    assert sys.getswitchinterval() == before


_NO_CLOSE = textwrap.dedent("""
    import atexit, json, sys, threading
    # registered first, so run last: after offload's own exit work
    atexit.register(lambda: print(sorted(t.name for t in threading.enumerate()
                                         if t.name.startswith("offload-")), flush=True))
    import offload
    from tests.engine.models import TiedTwice, lm_batches, lm_loss
    cfg = json.loads(sys.argv[1])
    engine = offload.initialize(TiedTwice(), cfg)
    x, y = lm_batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    print(sys.getswitchinterval(), flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("the training loop failed")
""")


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_process_that_never_closes_leaves_no_swap_files(engine_cfg, tmp_path, how):
    """Nor threads at work: [Note: an engine open at interpreter exit]. They used to be
    while the interpreter shut down, and one inside a torch call aborted the process
    (exit code 134) one run in ten; now none is left when the last exit handlers run."""
    import json
    cfg = engine_cfg("nvme", "nvme", "nvme")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _NO_CLOSE, json.dumps(cfg), how],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [root, os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == (1 if how == "raise" else 0), out.stderr
    interval, threads = out.stdout.split("\n", 1)
    assert float(interval) == pytest.approx(0.0005)  # the engine was open and working
    assert threads.strip() == "[]", threads
    assert os.listdir(tmp_path / "swap") == []


def test_with_block_closes_the_engine_also_on_an_error(engine_cfg, tmp_path):
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="a failing loop"):
        with offload.initialize(TiedTwice(), engine_cfg("nvme", "nvme", "nvme")) as engine:
            _step(engine)
            assert os.listdir(tmp_path / "swap")
            raise RuntimeError("a failing loop")
    assert os.listdir(tmp_path / "swap") == []
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("group, match", [
    ({"lr": math.nan}, r"param_groups\[0\]\.lr: nan is not a finite number"),
    ({"lr": -1.0}, r"param_groups\[0\]\.lr: -1\.0 is negative"),
    ({"betas": (0.9, 1.5)}, r"param_groups\[0\]\.betas: \[0\.9, 1\.5\] must be two numbers"),
    ({"eps": 0.0}, r"param_groups\[0\]\.eps: 0\.0 must be positive"),
    ({"weight_decay": "0.1"}, r"param_groups\[0\]\.weight_decay: expected a number, got '0\.1'"),
    ({"lr_lambda": 3}, r"param_groups\[0\]\.lr_lambda: 3 is not callable")])
def test_bad_param_groups_given_to_initialize_are_refused_before_any_file(
        engine_cfg, tmp_path, group, match):
    """The hyper-parameters of `initialize(param_groups=...)` are checked as the config's
    `optim.param_groups` are, before anything is made: a NaN lr would otherwise train
    the weights to NaN, a beta of 1.5 fail only at the first step."""
    model = TiedTwice()
    with pytest.raises(ConfigError, match=match):
        offload.initialize(model, engine_cfg("nvme", "nvme", "nvme"),
                           param_groups=[{"params": ["*.bias"], **group}])
    assert not (tmp_path / "swap").exists()
    assert len(list(model.parameters())) > 0  # the model is untouched


def test_one_param_group_not_in_a_list_is_named_so(engine_cfg, tmp_path):
    """A dict given for param_groups (one group, unlisted) was "param_groups[0]:
    expected a dict with 'params'", though a dict was given."""
    with pytest.raises(ConfigError, match=r"param_groups: expected a list of dicts \(one per "
                       r"group\), got a dict"):
        offload.initialize(TiedTwice(), engine_cfg("nvme"), param_groups={"params": ["*.bias"]})
    assert not (tmp_path / "swap").exists()


@pytest.mark.parametrize("model, kwargs, match", [
    (5, {}, r"initialize\(model\): expected an nn\.Module .* got int"),
    (None, {"lr_lambda": 0.5}, r"initialize\(lr_lambda\): 0\.5 is not callable")])
def test_a_model_or_schedule_of_the_wrong_kind_is_named(engine_cfg, tmp_path, model, kwargs,
                                                        match):
    with pytest.raises(ConfigError, match=match):
        offload.initialize(TiedTwice() if model is None else model, engine_cfg("nvme"),
                           **kwargs)
    assert not (tmp_path / "swap").exists()


def test_chunk_buffers_larger_than_the_buffer_budget_are_refused_before_any_file(
        engine_cfg, tmp_path):
    cfg = engine_cfg("nvme", "nvme", "nvme")
    cfg["optim"]["chunk_elems"] = 1 << 22  # 6 buffers of 4M elements: 128+ MiB of 32 MiB
    with pytest.raises(ConfigError, match=r"optim\.chunk_elems=4194304 x optim\.buffers=6 .* "
                                          r"raise io\.buffer_budget"):
        offload.initialize(TiedTwice(), cfg)
    assert not (tmp_path / "swap").exists()


def test_a_closed_engine_says_it_is_closed(engine_cfg, tmp_path):
    """After close() (or its `with` block) every method that needs the state raises,
    saying so, instead of a KeyError about a partition or a forward that names a
    unit; closing again does nothing."""
    engine = offload.initialize(TiedTwice(), engine_cfg("nvme", "nvme", "nvme"))
    _step(engine)
    engine.close()
    x, y = lm_batches(1)[0]
    calls = {"forward": lambda: engine(x), "backward": lambda: engine.backward(torch.ones(())),
             "step": engine.step, "zero_grad": engine.zero_grad,
             "save_checkpoint": lambda: engine.save_checkpoint(tmp_path / "ck"),
             "state_dict": engine.state_dict,
             "load_state_dict": lambda: engine.load_state_dict({}),
             "save_pretrained": lambda: engine.save_pretrained(tmp_path / "hf"),
             "full_weights": lambda: engine.full_weights().__enter__(),
             "named_weights": lambda: next(engine.named_weights())}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="this OffloadEngine is closed"):
            call()
    assert not (tmp_path / "ck").exists() and not (tmp_path / "hf").exists()
    engine.close()


@pytest.mark.parametrize("key, value, match", [
    ("nvme_budget", "1MiB", r"store\.nvme_budget: 1\.0 MiB is below the .* raise it to at least"),
    ("max_swap_size", "1MiB", r"io\.max_swap_size: 1\.0 MiB is below the .* of \w+ state")])
def test_nvme_state_beyond_a_disk_limit_is_refused_before_any_file(engine_cfg, tmp_path, key,
                                                                    value, match):
    """What `initialize` places on NVMe (here 16 MiB of fp32 parameters, master and
    moments) is checked against `store.nvme_budget` and `io.max_swap_size` before a
    swap file is made, rather than failing at the first write of the step."""
    cfg = engine_cfg("nvme", "host", "nvme")
    cfg["store" if key == "nvme_budget" else "io"][key] = value
    with pytest.raises(ConfigError, match=match) as err:
        offload.initialize(torch.nn.Sequential(torch.nn.Linear(512, 512),
                                               torch.nn.Linear(512, 512)), cfg)
    assert not (tmp_path / "swap").exists()
    # the figure it asks for trains (it asked for the state placed, and the first
    # step's new optimizer state went over the limit)
    need = int(re.search(r"raise it to at least (\d+) bytes", str(err.value)).group(1))
    cfg["store" if key == "nvme_budget" else "io"][key] = need
    with offload.initialize(torch.nn.Sequential(torch.nn.Linear(512, 512),
                                                torch.nn.Linear(512, 512)), cfg) as engine:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 512)).square().mean())
            assert engine.step()


@pytest.mark.parametrize("mib", [8, 20])  # 20: more than half the state fits, not all
def test_a_swap_directory_too_small_for_the_state_is_refused_before_any_file(
        engine_cfg, small_fs, mib):
    """A file system with less free space than the state placed on NVMe (25 MiB) is named, with
    its free space and the fixes, before any swap file is made."""
    where = os.path.join(small_fs(mib), "swap")
    cfg = engine_cfg("nvme", "host", "nvme")
    cfg["io"]["paths"] = [where]
    with pytest.raises(SwapPathError, match=r"io\.paths\[0\]: .* free, and this model places "
                                            r"at least 2\d\.\d MiB.* free disk space"):
        offload.initialize(torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                               torch.nn.Linear(1024, 1024)), cfg)
    assert not os.path.exists(where)


def test_max_swap_size_counts_only_what_trains(engine_cfg):
    """A frozen group has no optimizer state, and fp32 training no master apart: a
    frozen 1.28M-element embedding beside a small Linear was refused at 2 MiB for
    14.7 MiB of state it never keeps; it trains within that limit."""
    cfg = engine_cfg("host", "host", "nvme")
    cfg["io"]["max_swap_size"] = 2 << 20
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20000, 64), torch.nn.Linear(64, 64))
    model[0].weight.requires_grad_(False)
    with offload.initialize(model, cfg) as engine:
        for _ in range(3):
            engine.backward(engine(torch.randint(0, 20000, (4,))).square().mean())
            assert engine.step()
