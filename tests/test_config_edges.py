"""Tests of the configuration layer: inputs a user can give that used to raise a
traceback from deep inside, name no key, or be accepted and misbehave later."""

import json
import os
import threading
import types
import typing

import pytest

import offload
from offload.config import (ConfigError, IoConfig, OffloadConfig,
                            config_reference, load_config, parse_bytes)


# -- byte sizes --------------------------------------------------------------------------

def test_a_huge_size_string_is_a_config_error_not_an_overflow():
    # float("9" * 400) is inf: int(inf * unit) raised OverflowError
    with pytest.raises(ConfigError, match=r"^io\.max_swap_size: "):
        load_config({"io": {"max_swap_size": "9" * 400 + "TiB"}})


def test_size_strings_are_read_exactly():
    # through float, 2**53 + 1 became 2**53
    assert parse_bytes(str((1 << 53) + 1)) == (1 << 53) + 1
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("0.5KiB") == 512
    assert parse_bytes("1.1GiB") == int(11 * (1 << 30) / 10)  # rounded down to a byte


@pytest.mark.parametrize("text", ["0.5", "4096.5", "0.5B", "0.0001k"])
def test_a_size_string_of_a_fraction_of_a_byte_is_refused(text):
    # "0.5" used to become 0 bytes: for io.max_swap_size that is "no limit"
    with pytest.raises(ConfigError, match=r"^io\.max_swap_size: .*whole number of bytes"):
        load_config({"io": {"max_swap_size": text}})


@pytest.mark.parametrize("section, key", [("io", "grow_step"), ("io", "max_swap_size"),
                                          ("store", "nvme_budget"), ("store", "host_budget")])
def test_a_byte_size_beyond_a_file_offset_is_refused(section, key):
    # io.grow_step = 2**80 reached os.posix_fallocate at initialize: OverflowError
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: .* larger than"):
        load_config({section: {key: 1 << 80}})
    assert getattr(getattr(load_config({section: {key: 1 << 62}}), section), key) == 1 << 62


# -- numbers -----------------------------------------------------------------------------

def test_a_wait_timeout_beyond_what_a_lock_can_wait_is_refused():
    # 1e10 s passed the check and raised OverflowError in Condition.wait at initialize,
    # and again in the store's close, leaving its swap files open and locked
    with pytest.raises(ConfigError, match=r"^store\.wait_timeout: .* at most"):
        load_config({"store": {"wait_timeout": threading.TIMEOUT_MAX * 2}})
    assert load_config({"store": {"wait_timeout": 86400 * 365}}).store.wait_timeout > 0


def test_a_float_key_given_a_huge_integer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^optim\.lr: .* not a finite number"):
        load_config({"optim": {"lr": 10 ** 400}})
    f = tmp_path / "c.json"
    f.write_text('{"optim": {"weight_decay": 1' + "0" * 400 + "}}")  # JSON ints are unbounded
    with pytest.raises(ConfigError, match=r"^\S*c\.json: optim\.weight_decay: "):
        load_config(f)


# -- files -------------------------------------------------------------------------------

def test_a_key_given_twice_in_a_json_file_is_refused(tmp_path):
    # json.loads keeps the last: the first "io" section was dropped without a word
    f = tmp_path / "c.json"
    f.write_text('{"io": {"queue_depth": 8}, "io": {"threads": 2}}')
    with pytest.raises(ConfigError, match=r"c\.json: .*'io' is given twice"):
        load_config(f)
    f.write_text('{"io": {"threads": 8, "threads": 2}}')
    with pytest.raises(ConfigError, match=r"'threads' is given twice"):
        load_config(f)


@pytest.mark.parametrize("name, text", [("c.json", '{"io": {"queue_depth": 8}}'),
                                        ("c.toml", "[io]\nqueue_depth = 8\n")])
def test_a_file_saved_with_a_utf8_bom_loads(tmp_path, name, text):
    # Windows editors write one; it was "not valid JSON: Unexpected UTF-8 BOM"
    f = tmp_path / name
    f.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(f).io.queue_depth == 8


def test_a_suffix_in_capitals_is_read(tmp_path):
    f = tmp_path / "C.TOML"
    f.write_text("[io]\nqueue_depth = 8\n")
    assert load_config(f).io.queue_depth == 8


def test_a_path_that_is_not_a_regular_file_says_so(tmp_path):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"c\.toml is not a regular file"):
        load_config(fifo)


def test_a_path_too_long_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot be read"):
        load_config(str(tmp_path / ("x" * 5000 + ".toml")))


# -- what load_config and initialize take ------------------------------------------------

@pytest.mark.parametrize("source", [[("io", {})], 5, b"c.toml", IoConfig(), OffloadConfig])
def test_a_config_of_the_wrong_kind_is_a_config_error(source):
    with pytest.raises(ConfigError, match=r"^config: expected an OffloadConfig, a dict"):
        load_config(source)


def test_a_mapping_that_is_not_a_dict_loads():
    src = types.MappingProxyType({"io": types.MappingProxyType({"queue_depth": 8})})
    assert load_config(src).io.queue_depth == 8


def test_param_group_errors_name_the_group():
    groups = [{"params": ["a"]}, {"params": ["b"], "lr": -1}]
    with pytest.raises(ConfigError, match=r"^optim\.param_groups\[1\]\.lr: -1\.0 is negative"):
        load_config({"optim": {"param_groups": groups}})
    with pytest.raises(ConfigError, match=r"^optim\.param_groups\[0\]: params is empty"):
        load_config({"optim": {"param_groups": [{"params": []}]}})
    for key, value, why in [("eps", 0.0, "must be positive"),  # as optim.eps
                            ("betas", [0.9, 1.0], r"must be two numbers in \[0, 1\)")]:
        with pytest.raises(ConfigError, match=rf"^optim\.param_groups\[0\]\.{key}: .* {why}"):
            load_config({"optim": {"param_groups": [{"params": ["a"], key: value}]}})


def test_a_config_changed_after_initialize_does_not_change_the_engine(tmp_path):
    cfg = load_config({"engine": {"group_size": 3000},
                       "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                              "grow_step": "4MiB"},
                       "store": {"host_budget": "64MiB", "device_budget": "64MiB",
                                 "device": "cpu"}})
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with offload.initialize(model, cfg) as engine:
        cfg.engine.grad_accum_steps = 3  # e.g. reused for the next run
        engine.backward(engine(torch.ones(2, 8)).sum())
        assert engine.step() is True and engine.global_step == 1  # was: False, 0
        assert engine.cfg.engine.grad_accum_steps == 1


def test_paths_and_optional_numbers_in_a_dict_say_what_is_expected():
    """A pathlib.Path in io.paths is taken from a dict as IoConfig takes it (it was
    "expected a string"); a bad optional number says "expected a number", not "does
    not match float | None"."""
    from pathlib import Path
    assert load_config({"io": {"paths": [Path("/tmp/a")]}}).io.paths == ["/tmp/a"]
    with pytest.raises(ConfigError, match=r"^optim\.param_groups\[0\]\.lr: expected a number, "
                       r"got '0\.1'; or leave optim\.param_groups\[0\]\.lr out \(unset\)$"):
        load_config({"optim": {"param_groups": [{"params": ["a"], "lr": "0.1"}]}})


def test_engine_cfg_changed_to_a_bad_value_is_refused_where_it_is_read(tmp_path):
    """Keys the engine reads from its own `engine.cfg` at each call: a bad value is a
    ConfigError naming it, raised before anything changed (a keep_checkpoints of -1
    deleted every older checkpoint; a max_grad_norm of NaN was taken; a
    grad_accum_steps of 0 raised a ZeroDivisionError)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"engine": {"group_size": 3000},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    x = torch.ones(2, 8)
    with offload.initialize(model, cfg) as engine:
        for i in range(3):
            engine.backward(engine(x).sum())
            engine.step()
            engine.save_checkpoint(tmp_path / "ck" / f"step-{i}")
        engine.cfg.engine.keep_checkpoints = -1
        with pytest.raises(ConfigError, match="engine.keep_checkpoints: -1"):
            engine.save_checkpoint(tmp_path / "ck" / "step-3")
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
            "step-0", "step-1", "step-2"]
        engine.cfg.engine.keep_checkpoints = 0
        engine.backward(engine(x).sum())
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        norm = engine.cfg.optim.max_grad_norm
        engine.cfg.optim.max_grad_norm = float("nan")
        with pytest.raises(ConfigError, match="optim.max_grad_norm"):
            engine.step()
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        engine.cfg.optim.max_grad_norm = norm
        assert engine.step() and engine.global_step == 4
        engine.cfg.engine.grad_accum_steps = 0
        with pytest.raises(ConfigError, match="engine.grad_accum_steps"):
            engine.backward(engine(x).sum())
        engine.cfg.engine.grad_accum_steps = 1
        engine.zero_grad()
        engine.backward(engine(x).sum())
        assert engine.step() and engine.global_step == 5


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_a_key_changed_on_engine_cfg_is_refused_naming_it(tmp_path, optimizer):
    """optim.max_grad_norm turned on through engine.cfg was reported in engine.grad_norm
    but clipped nothing (turned off, it failed every later step with an internal
    message); a grad_accum_steps raised after the window's early updates had run failed
    the next backward. A key changed after initialize is refused where the engine reads
    its configuration, naming it, before anything changes; set back, training goes on."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"engine": {"group_size": 50, "optimizer": optimizer},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    x = torch.ones(2, 8)
    with offload.initialize(model, cfg) as engine:
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.cfg.optim.max_grad_norm = 0.1
        with pytest.raises(ConfigError, match=r"optim.max_grad_norm was changed from 0.0 to "
                                              r"0.1 after initialize.*resume from it"):
            engine.backward(engine(x).sum())
        engine.cfg.optim.max_grad_norm = 0.0
        engine.cfg.optim.lr = 0.5  # a resume would restore the checkpoint's lr: not the fix
        with pytest.raises(ConfigError, match=r"optim.lr was changed .*change the value in "
                                              r"engine.optimizer.param_groups"):
            engine.backward(engine(x).sum())
        engine.cfg.optim.lr = 1e-3
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        engine.cfg.optim.max_grad_norm = 0.0
        engine.backward(engine(x).sum())
        engine.cfg.engine.grad_accum_steps = 2
        with pytest.raises(ConfigError, match=r"engine.grad_accum_steps was changed from 1"):
            engine.step()
        engine.cfg.engine.grad_accum_steps = 1
        assert engine.step() and engine.global_step == 1
        engine.cfg.io.queue_depth = 7  # read by no call: a change would go unnoticed
        with pytest.raises(ConfigError, match=r"io.queue_depth"):
            engine.save_checkpoint(tmp_path / "ck")
        assert not (tmp_path / "ck").exists()


# -- the documentation -------------------------------------------------------------------

def _choices():
    rows = {k: doc for k, _, doc in config_reference()}
    out = []
    for sec, cls in typing.get_type_hints(OffloadConfig).items():
        for key, tp in typing.get_type_hints(cls).items():
            if typing.get_origin(tp) is typing.Literal:
                out.append((f"{sec}.{key}", typing.get_args(tp), rows[f"{sec}.{key}"]))
    return out


@pytest.mark.parametrize("key, choices, doc", _choices(), ids=lambda v: v if isinstance(v, str)
                         and "." in v and " " not in v else "")
def test_the_reference_names_every_allowed_value(key, choices, doc):
    missing = [c for c in choices if c not in doc]
    assert not missing, f"{key}: the reference does not name {missing}: {doc!r}"


@pytest.mark.parametrize("key, rng", [
    ("io.queue_depth", "1..1024"), ("io.threads", "1..256"),
    ("io.switch_interval", "0, or 1e-6..1"),
    ("optim.buffers", "1..16"), ("optim.buffer_share", "(0, 1]"), ("engine.seed", "0..4294967295"),
    ("domino.pieces", "1..64"), ("store.wait_timeout", "at most"), ("io.block_size", "4096"),
    ("optim.chunk_elems", "1024"), ("optim.block_elems", "1024"),
    ("engine.grad_accum_steps", ">= 1"), ("engine.min_loss_scale", "initial_loss_scale"),
])
def test_the_reference_states_the_range(key, rng):
    doc = dict((k, d) for k, _, d in config_reference())[key]
    assert rng in doc, f"{key}: {doc!r}"


def test_a_toml_file_on_python_3_10_is_a_config_error_or_loads(tmp_path):
    # offload supports Python >= 3.10; tomllib is 3.11+: `import tomllib` was a
    # ModuleNotFoundError from inside load_config. config.py needs only the standard
    # library, so it is loaded on its own by a Python 3.10 where one is installed.
    import glob
    import shutil
    import subprocess
    found = [shutil.which("python3.10")] + sorted(
        glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    py = next((p for p in found if p and subprocess.run(
        [p, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
        capture_output=True).returncode == 0), None)
    if py is None:
        pytest.skip("no Python 3.10 here")
    f = tmp_path / "c.toml"
    f.write_text("[io]\nqueue_depth = 8\n")
    src = os.path.join(os.path.dirname(offload.__file__), "config.py")
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('cfg', {src!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['cfg'] = m\n"
            "spec.loader.exec_module(m)\n"
            "try:\n"
            f"    print('loaded', m.load_config({str(f)!r}).io.queue_depth)\n"
            "except m.ConfigError as e:\n"
            "    print('refused', e)\n")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("loaded 8") or (
        out.stdout.startswith("refused") and "pip install tomli" in out.stdout
        and ".json" in out.stdout), out.stdout


@pytest.mark.parametrize("section, key", [("engine", "seed"), ("io", "queue_depth"),
                                          ("io", "max_swap_size"), ("engine", "group_size")])
def test_an_integer_too_long_to_print_is_a_config_error(section, key, tmp_path):
    # Python refuses to print an int of more than 4300 digits: the message itself raised
    # ValueError (for a byte size, out of load_config; for other keys as "engine: Exceeds
    # the limit ...", naming no key)
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: an integer of about 5001 digits"):
        load_config({section: {key: 10 ** 5000}})
    f = tmp_path / "c.json"  # json.loads raises ValueError, not JSONDecodeError, for it
    f.write_text(json.dumps({section: {key: 1}}).replace("1", "1" + "0" * 5000))
    with pytest.raises(ConfigError, match=r"c\.json: not valid JSON: .*digits"):
        load_config(f)


@pytest.mark.parametrize("name, text, kind", [("c.json", "[" * 100_000, "JSON"),
                                              ("c.toml", "a = " + "[" * 100_000, "TOML")])
def test_a_file_nested_past_the_recursion_limit_is_a_config_error(tmp_path, name, text, kind):
    # the parsers raised RecursionError, a traceback from the command line
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"{name}: not valid {kind}: nested deeper"):
        load_config(f)
