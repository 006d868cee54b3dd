"""Configuration: files and dicts load into typed sections; bad input names the key."""

import json

import pytest

from offload.config import (ConfigError, IoConfig, OffloadConfig, config_reference, load_config,
                            parse_bytes)


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
])
def test_bad_values_name_key_and_fix(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


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
