"""Size units, the ends of each allowed range, and refusals naming their key."""

import json

import pytest

from offload.config import MAX_BYTES, ConfigError, load_config, parse_bytes


# -- size strings: which units are binary and which decimal -----------------------------

def test_size_units_binary_and_decimal():
    # a bare letter and "iB" are binary; "B"-suffixed multiples are decimal (docs)
    assert parse_bytes("1k") == parse_bytes("1KiB") == 1024
    assert parse_bytes("1kb") == parse_bytes("1KB") == 1000
    assert parse_bytes("512M") == parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("3MB") == 3_000_000
    assert parse_bytes("2g") == 2 << 30 and parse_bytes("1t") == 1 << 40
    assert load_config({"io": {"buffer_budget": "64M"}}).io.buffer_budget == 64 << 20


@pytest.mark.parametrize("value", [0.5, 4096.5])
def test_a_fractional_number_for_a_byte_key_is_refused(value, tmp_path):
    # a TOML/JSON float such as 0.5 must not be truncated (to 0: "no limit")
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"io": {"max_swap_size": value}}))
    with pytest.raises(ConfigError, match=r"^\S*c\.json: io\.max_swap_size: cannot read"):
        load_config(f)
    # a float that is a whole number is a byte count
    assert load_config({"io": {"max_swap_size": 2097152.0}}).io.max_swap_size == 2097152


def test_the_largest_byte_count_is_accepted_and_one_more_refused():
    assert parse_bytes(MAX_BYTES) == MAX_BYTES
    with pytest.raises(ConfigError, match="larger than any file"):
        parse_bytes(MAX_BYTES + 1)


# -- refusals: each names the key -------------------------------------------------------

@pytest.mark.parametrize("data, match", [
    ({"io": {"max_swap_size": -1}}, r"^io\.max_swap_size: negative; use 0 for no limit"),
    # a swap file grows by whole stripe rows: less than one held nothing, and said
    # "would be exceeded (0 in use)" at the first 4 KiB
    ({"io": {"max_swap_size": "1MiB", "paths": ["a", "b"]}},
     r"^io\.max_swap_size: 1048576 bytes is under one stripe row \(io\.stripe_size 1048576 "
     r"x 2 io\.paths = 2097152 bytes\)"),
    ({"io": {"block_size": 0}}, r"^io\.block_size: 0 bytes is not a positive multiple of 4096"),
    ({"io": {"block_size": -4096}}, r"^io\.block_size: -4096 bytes is not a positive multiple"),
    ({"io": {"queue_depth": 1025}}, r"^io\.queue_depth: 1025 is out of range; use 1\.\.1024"),
    ({"io": {"threads": 257}}, r"^io\.threads: 257 is out of range; use 1\.\.256"),
    ({"io": {"stripe_size": "2MiB", "grow_step": "3MiB"}},
     r"^io\.grow_step: \d+ must be a positive multiple of io\.stripe_size"),
    ({"io": {"switch_interval": 1.5}}, r"^io\.switch_interval: 1\.5 is out of range"),
    ({"io": {"switch_interval": 1e-9}}, r"^io\.switch_interval: 1e-09 is out of range"),
    ({"optim": {"buffers": 17}}, r"^optim\.buffers: 17 is out of range"),
    ({"engine": {"keep_checkpoints": -1}}, r"^engine\.keep_checkpoints: -1 must be >= 0"),
    ({"engine": {"prefetch_depth": -1}}, r"^engine\.prefetch_depth: -1 must be >= 0"),
    ({"engine": {"seed": 1 << 32}}, r"^engine\.seed: 4294967296 is out of range"),
    ({"domino": {"pieces": 65}}, r"^domino\.pieces: 65 is out of range; use 1\.\.64"),
])
def test_out_of_range_values_are_refused_naming_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


def test_the_ends_of_each_allowed_range_are_accepted():
    c = load_config({
        "io": {"queue_depth": 1024, "threads": 256, "switch_interval": 1,
               "stripe_size": "1MiB", "grow_step": "3MiB",
               "block_size": "4MiB", "buffer_budget": "4MiB", "max_swap_size": 0},
        "optim": {"buffers": 16},
        "engine": {"seed": (1 << 32) - 1, "keep_checkpoints": 0, "prefetch_depth": 0},
        "domino": {"pieces": 64},
    })
    assert c.io.switch_interval == 1.0 and c.io.buffer_budget == c.io.block_size
    assert c.engine.seed == (1 << 32) - 1 and c.domino.pieces == 64
