"""Typed configuration: one keyword-only dataclass per layer, composed into
`OffloadConfig`. Files (TOML or JSON) and dicts load into the same types;
unknown keys and impossible values raise `ConfigError` naming the key and the
fix. Byte sizes accept ints or strings such as "512MiB", "1GiB", "4k".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["ConfigError", "IoConfig", "OffloadConfig", "load_config", "parse_bytes", "format_bytes"]

PAGE = 4096


class ConfigError(ValueError):
    """A configuration key is unknown, of the wrong type or out of range."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40,
}


def parse_bytes(value: int | str, key: str = "size") -> int:
    """Parses a byte count: an int, or a string like "4KiB", "1.5GiB", "512M" (binary)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{key}: cannot read {value!r} as a byte size; write an integer number "
                      "of bytes or a string such as '256MiB' or '2GiB'")


def format_bytes(n: float) -> str:
    """Formats a byte count with a binary unit, e.g. 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _bytes_field(default: int | str, doc: str) -> Any:
    return field(default=parse_bytes(default), metadata={"bytes": True, "doc": doc})


def _doc(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


@dataclass(kw_only=True)
class IoConfig:
    """The block I/O layer (`offload.io`): swap files, engine, staging buffers."""

    paths: list[str] = _doc(["./offload-swap"], "directories that hold swap files; "
                            "several are striped (RAID-0 style) in stripe_size units")
    engine: Literal["auto", "aio", "threads"] = _doc(
        "auto", "aio: Linux AIO through libaio; threads: os.preadv/pwritev in a thread pool; "
        "auto: aio where libaio loads and the file system takes O_DIRECT, else threads")
    block_size: int = _bytes_field("1MiB", "bytes per I/O request submitted to the kernel")
    queue_depth: int = _doc(16, "I/O requests kept in flight per engine")
    threads: int = _doc(4, "worker threads of the thread engine")
    direct: bool = _doc(True, "open swap files with O_DIRECT (bypass the page cache)")
    sync_writes: bool = _doc(True, "a write completes only after fdatasync, i.e. when the data "
                             "is on stable storage; false: when the device has taken it")
    checksum: bool = _doc(True, "record an xxh3-64 of each written extent and verify it on read")
    stripe_size: int = _bytes_field("1MiB", "bytes per stripe unit when several paths are given")
    grow_step: int = _bytes_field("256MiB", "bytes by which a swap file is preallocated "
                                  "(fallocate) each time it must grow")
    max_swap_size: int = _bytes_field(0, "upper bound on the swap bytes per rank; 0: the disk's "
                                      "free space")
    buffer_budget: int = _bytes_field("1GiB", "bytes of page-aligned (pinned with CUDA) host "
                                      "staging buffers")

    def __post_init__(self) -> None:
        if not self.paths:
            raise ConfigError("io.paths: empty; give at least one directory for swap files")
        for key in ("block_size", "stripe_size"):
            v = getattr(self, key)
            if v < PAGE or v % PAGE:
                raise ConfigError(f"io.{key}: {v} bytes is not a positive multiple of {PAGE}; "
                                  f"use e.g. '1MiB'")
        if not 1 <= self.queue_depth <= 1024:
            raise ConfigError(f"io.queue_depth: {self.queue_depth} is out of range; use 1..1024")
        if not 1 <= self.threads <= 256:
            raise ConfigError(f"io.threads: {self.threads} is out of range; use 1..256")
        if self.grow_step < self.stripe_size or self.grow_step % self.stripe_size:
            raise ConfigError(f"io.grow_step: {self.grow_step} must be a positive multiple of "
                              f"io.stripe_size ({self.stripe_size})")
        if self.max_swap_size < 0:
            raise ConfigError("io.max_swap_size: negative; use 0 for no limit")
        if self.buffer_budget < self.block_size:
            raise ConfigError(f"io.buffer_budget: {self.buffer_budget} bytes is below one block "
                              f"(io.block_size={self.block_size}); raise it, e.g. to '256MiB'")


@dataclass(kw_only=True)
class OffloadConfig:
    """Root configuration: one section per layer."""

    io: IoConfig = field(default_factory=IoConfig)


def _check_type(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = " | ".join(map(str, typing.get_args(tp)))
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _check_type(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, key)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {tp}")


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key; known keys here: {known}")
        if fields[name].metadata.get("bytes"):
            kwargs[name] = parse_bytes(value, key)
        else:
            kwargs[name] = _check_type(key, value, hints[name])
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from e


def load_config(source: OffloadConfig | dict | str | os.PathLike | None = None) -> OffloadConfig:
    """Builds an `OffloadConfig` from an instance, a dict, or a .toml/.json file path."""
    if source is None:
        return OffloadConfig()
    if isinstance(source, OffloadConfig):
        return source
    if isinstance(source, dict):
        return _from_dict(OffloadConfig, source, "")
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from e
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
    else:
        raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .toml or .json")
    return _from_dict(OffloadConfig, data, "")


def config_reference(cls: type = OffloadConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, description) rows for every leaf key; used by the docs and CLI."""
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
                default := f.default_factory()):
            rows.extend(config_reference(type(default), key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.metadata.get("bytes"):
            default = format_bytes(default) if default else "0"
        rows.append((key, json.dumps(default) if not isinstance(default, str) else default,
                     f.metadata.get("doc", "")))
    return rows
