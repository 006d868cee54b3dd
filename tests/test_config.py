"""Configuration: files and dicts load into typed sections; bad input names the key."""

import json
import math
import typing

import pytest

from offload.config import (ConfigError, EngineConfig, IoConfig, OffloadConfig, OptimConfig,
                            StoreConfig, config_reference, load_config, parse_bytes)


def test_defaults_and_dict():
    c = load_config({"io": {"block_size": "512KiB", "paths": ["/a", "/b"], "queue_depth": 64}})
    assert isinstance(c, OffloadConfig) and c.io.block_size == 512 << 10
    assert c.io.paths == ["/a", "/b"] and c.io.queue_depth == 64
    assert load_config(None) == OffloadConfig()


def test_toml_and_json_files(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text('[io]\nengine = "threads"\nbuffer_budget = "2GiB"\nchecksum = false\n')
    c = load_config(t)
    assert c.io.engine == "threads" and c.io.buffer_budget == 2 << 30 and not c.io.checksum
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"io": {"direct": False, "max_swap_size": 10 << 30}}))
    assert load_config(str(j)).io.direct is False


@pytest.mark.parametrize("data, match", [
    ({"io": {"blocksize": 4096}}, r"io.blocksize: unknown key; known keys here: .*block_size"),
    ({"iox": {}}, r"iox: unknown key"),
    ({"io": {"block_size": 1000}}, r"io.block_size: 1000 bytes is not a positive multiple of 4096"),
    ({"io": {"block_size": "lots"}}, r"io.block_size: cannot read 'lots'"),
    ({"io": {"engine": "uring"}}, r"io.engine: 'uring' is not one of auto \| aio \| threads"),
    ({"io": {"queue_depth": 0}}, r"io.queue_depth: 0 is out of range"),
    ({"io": {"queue_depth": "8"}}, r"io.queue_depth: expected an integer"),
    ({"io": {"direct": "yes"}}, r"io.direct: expected true or false"),
    ({"io": {"paths": "/tmp"}}, r"io.paths: expected a list"),
    ({"io": {"paths": []}}, r"io.paths: empty"),
    ({"io": {"buffer_budget": "1MiB", "block_size": "4MiB"}}, r"io.buffer_budget: .* raise it"),
    ({"io": {"grow_step": "1MiB", "stripe_size": "4MiB"}}, r"io.grow_step"),
    ({"io": {"switch_interval": -1}}, r"io.switch_interval: -1(\.0)? is out of range"),
    ({"io": {"paths": [""]}}, r"io.paths\[0\]: '' names no directory; give a directory"),
    ({"io": {"paths": ["  "]}}, r"io.paths\[0\]: '  ' names no directory"),
    ({"io": {"paths": ["/a\0b"]}}, r"io.paths\[0\]: .* contains a NUL byte"),
    ({"io": {"paths": ["/x/a", "/x/b/../a/"]}},
     r"io.paths\[1\]: '/x/b/../a/' is the same directory as io.paths\[0\] \('/x/a'\); list "
     "each directory once"),
    ({"store": {"swap_kinds": ["param", "param"]}}, r"store.swap_kinds\[1\]: 'param' is listed "
     "twice"),
    ({"engine": {"loss_scale": -1}}, r"engine.loss_scale: -1.0 is negative; use 0"),
    ({"engine": {"initial_loss_scale": 0}}, r"engine.initial_loss_scale: 0.0 must be positive"),
    ({"engine": {"min_loss_scale": 0}}, r"engine.min_loss_scale: 0.0 must be positive"),
    ({"engine": {"min_loss_scale": 8, "initial_loss_scale": 4}},
     r"engine.min_loss_scale: 8.0 is above engine.initial_loss_scale \(4.0\); lower it"),
    ({"engine": {"seed": -1}}, r"engine.seed: -1 is out of range; use 0..4294967295"),
    ({"engine": {"seed": 1 << 40}}, r"engine.seed: \d+ is out of range"),
])
def test_bad_values_name_key_and_fix(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


# Every float key: NaN and inf are refused with the key and a finite value to use.
_FLOAT_KEYS = [(sec, key) for sec, cls in (("io", IoConfig), ("store", StoreConfig),
                                           ("optim", OptimConfig), ("engine", EngineConfig))
               for key, tp in typing.get_type_hints(cls).items() if tp in (float, list[float])]


def test_every_float_key_is_covered():
    assert set(_FLOAT_KEYS) >= {("optim", "lr"), ("optim", "weight_decay"),
                                ("optim", "max_grad_norm"), ("optim", "eps"),
                                ("optim", "betas"), ("optim", "buffer_share"),
                                ("io", "switch_interval"), ("store", "wait_timeout"),
                                ("engine", "loss_scale"), ("engine", "initial_loss_scale"),
                                ("engine", "min_loss_scale")}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("section, key", _FLOAT_KEYS)
def test_nan_and_inf_are_refused_for_every_float_key(section, key, bad):
    value = [0.9, bad] if key == "betas" else bad
    where = rf"{section}\.{key}" + (r"\[1\]" if key == "betas" else "")
    with pytest.raises(ConfigError, match=rf"^{where}: -?(nan|inf) is not a finite number; "
                                          r"give a finite value, e\.g\. "):
        load_config({section: {key: value}})


@pytest.mark.parametrize("key", ["lr", "weight_decay", "eps"])
def test_nan_in_a_param_group_says_to_leave_the_key_out(key):
    # its default is unset (the optim section's value): "e.g. the default, null" before
    with pytest.raises(ConfigError, match=rf"^optim\.param_groups\[0\]\.{key}: nan is not a "
                                          r"finite number; give a finite value, or leave the "
                                          r"key out \(unset\)$"):
        load_config({"optim": {"param_groups": [{"params": ["a*"], key: math.nan}]}})


def test_nan_max_grad_norm_says_how_to_turn_clipping_off():
    with pytest.raises(ConfigError, match=r"optim.max_grad_norm: nan .* or 0 for no clipping"):
        load_config({"optim": {"max_grad_norm": math.nan}})


def test_a_config_changed_after_it_was_made_is_checked_again():
    cfg = OffloadConfig()
    cfg.optim.lr = math.nan
    with pytest.raises(ConfigError, match="optim.lr: nan"):
        load_config(cfg)
    cfg.optim.lr = 1e-3
    cfg.io.paths = ["/a", "/a"]
    with pytest.raises(ConfigError, match=r"io.paths\[1\]"):
        load_config(cfg)
    cfg.io.paths = ["/a"]
    cfg.engine.grad_accum_steps = 0
    with pytest.raises(ConfigError, match="engine.grad_accum_steps"):
        load_config({"engine": cfg.engine})  # a section given as an instance, in a dict
    cfg.engine.grad_accum_steps = 1
    assert load_config(cfg) is cfg


def test_direct_construction_checks_types_and_parses_sizes():
    assert IoConfig(block_size="1MiB").block_size == 1 << 20
    assert isinstance(OptimConfig(lr=1).lr, float)
    with pytest.raises(ConfigError, match="optim.lr: expected a number, got '0.1'"):
        OptimConfig(lr="0.1")
    with pytest.raises(ConfigError, match="io.queue_depth: expected an integer, got True"):
        IoConfig(queue_depth=True)
    assert OffloadConfig(io={"paths": ["/x"]}).io.paths == ["/x"]
    from pathlib import Path
    assert IoConfig(paths=[Path("/x"), "/y"]).paths == ["/x", "/y"]
    with pytest.raises(ConfigError, match=r"io.paths\[0\]: expected a string, got 3"):
        IoConfig(paths=[3])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[io\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    y = tmp_path / "c.yaml"
    y.write_text("io: {}")
    with pytest.raises(ConfigError, match="use .toml or .json"):
        load_config(y)
    with pytest.raises(ConfigError, match="is a directory; give the path of a .toml"):
        load_config(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[io]\npaths = ["/tmp/caf\xe9"]\n')  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"latin\.toml: not UTF-8 text .* save the config as "
                                          "UTF-8"):
        load_config(latin)
    typo = tmp_path / "typo.toml"  # a key or value the file holds: named with the file
    typo.write_text('[stor]\nhost_budget = "1GiB"\n')
    with pytest.raises(ConfigError, match=r"^.*typo\.toml: stor: unknown key"):
        load_config(typo)
    value = tmp_path / "value.json"
    value.write_text('{"store": {"host_budget": "lots"}}')
    with pytest.raises(ConfigError, match=r"^.*value\.json: store.host_budget"):
        load_config(value)


def test_parse_bytes():
    assert parse_bytes("4k") == 4096 and parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("2GB") == 2_000_000_000 and parse_bytes(123) == 123
    with pytest.raises(ConfigError):
        parse_bytes(True)


def test_reference_lists_every_key():
    keys = [k for k, _, _ in config_reference()]
    assert "io.block_size" in keys and "io.paths" in keys
    assert all(doc for _, _, doc in config_reference())
    assert len(keys) == len(set(keys))


def test_dataclass_direct_construction_validates():
    with pytest.raises(ConfigError):
        IoConfig(queue_depth=-1)


def test_docs_list_every_key():
    from pathlib import Path
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    rows = [f"| `{k}` | `{d}` | {m} |" for k, d, m in config_reference()]
    stale = [r for r in rows if r not in doc]
    assert not stale, ("docs/configuration.md is out of date; regenerate its table with "
                       f"'offload config --markdown': {stale}")
