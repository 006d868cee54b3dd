"""Typed configuration: one keyword-only dataclass per layer, composed into
`OffloadConfig`. Files (TOML or JSON) and dicts load into the same types;
unknown keys and impossible values raise `ConfigError` naming the key and the
fix. Byte sizes accept ints or strings such as "512MiB", "1GiB", "4k".
"""

from __future__ import annotations

import collections.abc
import dataclasses
import fractions
import functools
import json
import math
import os
import re
import stat
import threading
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["CommConfig", "ConfigError", "DominoConfig", "EngineConfig", "IoConfig",
           "OffloadConfig", "OptimConfig", "ParamGroupConfig", "StoreConfig",
           "TensorParallelConfig", "load_config", "parse_bytes", "format_bytes", "toml_loads"]

PAGE = 4096
# the largest byte count a file offset (off_t) or a size passed to the kernel can hold
MAX_BYTES = (1 << 63) - 1
# the longest wait threading's locks and conditions take (longer ones raise OverflowError)
MAX_WAIT_S = min(1e9, threading.TIMEOUT_MAX)
# The Adam hyper-parameters a parameter group sets, keeps in a checkpoint and compares
HYPER_NAMES = ("lr", "betas", "eps", "weight_decay")


class ConfigError(ValueError):
    """A configuration key is unknown, of the wrong type or out of range."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40,
}


def _shown(value: Any) -> str:
    """`repr(value)`, but an integer too long to print (Python refuses past 4300 digits)
    by its size."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def parse_bytes(value: int | str, key: str = "size", *, whole: bool = False) -> int:
    """Parses a byte count: an int, or a string like "4KiB", "1.5GiB", "512M" (binary).
    A string is read exactly (no float rounding) and rounded down to a whole byte. With
    `whole` (every config key), a string that names a fraction of a byte ("0.5",
    "4096.5", "0.0001k") is refused rather than rounded (to 0, which means "no limit"
    for several keys). Counts above `MAX_BYTES` are refused: no file offset or
    allocation can be that large."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size, got {value!r}")
    n: int | None = None
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            unit = m.group(2).lower()
            if len(m.group(1)) > 64:  # no size needs more digits; keeps Fraction cheap
                raise ConfigError(f"{key}: {value[:40]!r}... has too many digits for a byte "
                                  "size; give a size such as '256MiB'")
            exact = fractions.Fraction(m.group(1)) * _UNITS[unit]
            n = math.floor(exact)
            if whole and exact != n and (unit in ("", "b") or n == 0):
                raise ConfigError(f"{key}: {value!r} is not a whole number of bytes; give an "
                                  "integer number of bytes or a size such as '512KiB'")
    if n is None:
        raise ConfigError(f"{key}: cannot read {value!r} as a byte size; write an integer number "
                          "of bytes or a string such as '256MiB' or '2GiB'")
    if n > MAX_BYTES:
        raise ConfigError(f"{key}: {_shown(value)} is larger than any file or memory can be "
                          f"({MAX_BYTES} bytes); give a size such as '256MiB'")
    return n


def format_bytes(n: float, up: bool = False) -> str:
    """Formats a byte count with a binary unit, e.g. 1536 -> '1.5 KiB'. `up`: rounded up
    to the tenth, not to the nearest (what a fix asks for must be at least what is
    needed: 1 MiB + 8 KiB is "1.1 MiB", not the "1.0 MiB" just refused)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(n) if up else n:.0f} {unit}"
            return f"{math.ceil(n * 10) / 10 if up else n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _bytes_field(default: int | str, doc: str, **kw: Any) -> Any:
    return field(default=parse_bytes(default), metadata={"bytes": True, "doc": doc, **kw})


def _doc(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


def _normalise(section: Any, prefix: str) -> None:
    """Checks every key of a section against its declared type, in place: byte sizes
    are parsed, ints become floats where a float is declared, and every number must
    be finite (NaN and inf mean nothing for any key here). Runs for dataclasses built
    directly as well as loaded from a file or dict."""
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}"
        value = getattr(section, f.name)
        if f.metadata.get("bytes"):
            value = parse_bytes(value, key, whole=True)
        else:
            value = _check_type(key, value, hints[f.name])
        for i, x in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(x, float) and not math.isfinite(x):
                where = f"{key}[{i}]" if isinstance(value, list) else key
                default = f.default if f.default is not dataclasses.MISSING \
                    else f.default_factory()
                fix = f.metadata.get("fix") or (  # a default of None: "unset", no number
                    f"e.g. the default, {json.dumps(default)}" if default is not None
                    else "or leave the key out (unset)")
                raise ConfigError(f"{where}: {x} is not a finite number; give a finite value, "
                                  f"{fix}")
        setattr(section, f.name, value)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_paths(paths: list[str]) -> None:
    """What can be said of io.paths without touching the file system (the rest is
    checked where the swap files are opened: offload/io/paths.py)."""
    if not paths:
        raise ConfigError("io.paths: empty; give at least one directory for swap files")
    seen: dict[str, int] = {}
    for i, p in enumerate(paths):
        if not p.strip():
            raise ConfigError(f"io.paths[{i}]: {p!r} names no directory; give a directory "
                              "for swap files such as './offload-swap'")
        if "\0" in p:
            raise ConfigError(f"io.paths[{i}]: {p!r} contains a NUL byte; give a directory path")
        norm = os.path.normpath(os.path.abspath(p))
        if norm in seen:
            j = seen[norm]
            raise ConfigError(f"io.paths[{i}]: {p!r} is the same directory as io.paths[{j}] "
                              f"({paths[j]!r}); list each directory once (two paths on one "
                              "disk stripe nothing)")
        seen[norm] = i


@dataclass(kw_only=True)
class IoConfig:
    """The block I/O layer (`offload.io`): swap files, engine, staging buffers."""

    paths: list[str] = _doc(["./offload-swap"], "directories that hold swap files; "
                            "several are striped (RAID-0 style) in stripe_size units")
    engine: Literal["auto", "aio", "threads"] = _doc(
        "auto", "aio: Linux AIO through libaio; threads: os.preadv/pwritev in a thread pool; "
        "auto: aio where libaio loads and the file system takes O_DIRECT, else threads")
    block_size: int = _bytes_field("4MiB", "bytes per I/O request submitted to the kernel",
                                   allowed="a multiple of 4096 (at least 4096)")
    queue_depth: int = _doc(32, "I/O requests kept in flight per engine", allowed="1..1024")
    threads: int = _doc(4, "worker threads of the thread engine", allowed="1..256")
    direct: bool = _doc(True, "open swap files with O_DIRECT (bypass the page cache)")
    sync_writes: bool = _doc(False, "true: a write completes only after fdatasync, on stable "
                             "storage; false: when the device has taken it (swap files hold "
                             "scratch state that does not outlive the process, and O_DIRECT "
                             "reads see every completed write)")
    checksum: bool = _doc(True, "record an xxh3-64 of each written extent and verify it on read")
    stripe_size: int = _bytes_field("1MiB", "bytes per stripe unit when several paths are given",
                                    allowed="a multiple of 4096 (at least 4096)")
    grow_step: int = _bytes_field("256MiB", "bytes by which a swap file is preallocated "
                                  "(fallocate) each time it must grow; by only what it "
                                  "needs where that would take more than half of the "
                                  "disk's free space",
                                  allowed="a multiple of io.stripe_size")
    max_swap_size: int = _bytes_field(0, "upper bound on the swap bytes per rank of each kind "
                                      "of state (param, grad, optim), over all io.paths; 0: "
                                      "the disk's free space", allowed=">= 0")
    buffer_budget: int = _bytes_field("1GiB", "bytes of page-aligned (pinned with CUDA) host "
                                      "staging buffers", allowed="at least io.block_size")
    switch_interval: float = _doc(0.0005, "seconds: Python's thread switch interval "
                                  "(sys.setswitchinterval) while an engine is open, restored "
                                  "on close; I/O completions run on Python threads and wait "
                                  "up to this long behind a thread busy in Python (Python's "
                                  "default, 0.005, halved the disk rate of a busy process); "
                                  "0 leaves it alone", allowed="0, or 1e-6..1")

    def __post_init__(self) -> None:
        if isinstance(self.paths, (list, tuple)):  # pathlib.Path entries are paths too
            self.paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in self.paths]
        _normalise(self, "io")
        # no shell reads a config file: "~/swap" made a directory named "~" under the
        # current one (and `rm -rf ~` is how one removes it)
        self.paths = [os.path.expanduser(p) for p in self.paths]
        _check_paths(self.paths)
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
        row = self.stripe_size * len(self.paths)  # a swap file grows by whole stripe rows
        if 0 < self.max_swap_size < row:
            raise ConfigError(
                f"io.max_swap_size: {self.max_swap_size} bytes is under one stripe row "
                f"(io.stripe_size {self.stripe_size} x {len(self.paths)} io.paths = {row} "
                f"bytes), the least a swap file grows by: nothing would fit; raise it to a "
                f"multiple of {row} (0: no limit), or lower io.stripe_size")
        if not 0.0 <= self.switch_interval <= 1.0 or 0.0 < self.switch_interval < 1e-6:
            # below a microsecond sys.setswitchinterval takes 0, its most frequent switching
            raise ConfigError(f"io.switch_interval: {self.switch_interval} is out of range; use "
                              "0 (leave Python's) or seconds from 1e-6 up to 1, e.g. 0.0005")
        if self.buffer_budget < self.block_size:
            raise ConfigError(f"io.buffer_budget: {self.buffer_budget} bytes is below one block "
                              f"(io.block_size={self.block_size}); raise it, e.g. to '256MiB'")


# the swap files a training run uses: parameters, gradients, and the optimizer's
# state ([Note: NVMe layout] in offload/optim/state.py: master and moments per chunk)
_KINDS = ["param", "grad", "optim"]


@dataclass(kw_only=True)
class StoreConfig:
    """The tiered tensor store (`offload.store`): tier budgets, compute device, eviction."""

    device: str = _doc("auto", "compute device of the DEVICE tier: auto (cuda if available, "
                       "else cpu), cpu (the CPU acts as the device under its own budget), cuda "
                       "or cuda:N")
    device_budget: int = _bytes_field("4GiB", "bytes of partitions the DEVICE tier may hold",
                                      allowed="at least 4096")
    host_budget: int = _bytes_field("16GiB", "bytes of page-aligned (pinned with CUDA) host "
                                    "memory the HOST tier may hold; the store's own pool, apart "
                                    "from io.buffer_budget", allowed="at least 4096")
    nvme_budget: int = _bytes_field(0, "bytes of swap extents the NVME tier may hold, the "
                                    "optimizer's state (both versions while a step is open) "
                                    "included; 0: bounded only by io.max_swap_size (per kind) "
                                    "and the disk", allowed=">= 0")
    policy: Literal["next-use", "lru"] = _doc(
        "next-use", "eviction policy when a tier is full: next-use evicts the unpinned partition "
        "the step's access trace needs last (clean copies first among equals; least recently "
        "used while the step has left the trace); lru the least recently used one")
    wait_timeout: float = _doc(300.0, "seconds a move may wait for other transfers to free "
                               "budget before it fails", allowed="> 0, at most 1e9")
    keep_swap_files: bool = _doc(False, "keep the swap files when the store closes "
                                 "(default: remove them)")
    swap_kinds: list[str] = _doc(_KINDS, "partition kinds whose swap files are opened and locked "
                                 "when the store starts; other kinds open on first use",
                                 allowed="names of 1 to 64 letters, digits, '_', '.' or '-', "
                                 "each once")

    def __post_init__(self) -> None:
        _normalise(self, "store")
        if not re.fullmatch(r"auto|cpu|cuda(:(0|[1-9][0-9]{0,3}))?", self.device):
            raise ConfigError(f"store.device: {self.device!r} is not a device; use 'auto', "
                              "'cpu', 'cuda' or 'cuda:N'")
        for key in ("device_budget", "host_budget"):
            v = getattr(self, key)
            if v < PAGE:
                raise ConfigError(f"store.{key}: {v} bytes is below one page ({PAGE}); "
                                  "use e.g. '1GiB'")
        if self.nvme_budget < 0:
            raise ConfigError("store.nvme_budget: negative; use 0 for no limit of its own")
        if not self.wait_timeout > 0:
            raise ConfigError(f"store.wait_timeout: {self.wait_timeout} s must be positive; "
                              "use e.g. 300")
        if self.wait_timeout > MAX_WAIT_S:  # longer waits raise OverflowError in threading
            raise ConfigError(f"store.wait_timeout: {self.wait_timeout} s is more than a lock "
                              f"can wait; use at most {MAX_WAIT_S:.0e} s (about 31 years), "
                              "e.g. 300")
        for i, kind in enumerate(self.swap_kinds):
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", kind):
                raise ConfigError(f"store.swap_kinds[{i}]: {kind!r} cannot be part of a file "
                                  "name; use 1 to 64 letters, digits, '_', '.' or '-'")
            if kind in self.swap_kinds[:i]:
                raise ConfigError(f"store.swap_kinds[{i}]: {kind!r} is listed twice; list "
                                  "each kind once")


@dataclass(kw_only=True)
class ParamGroupConfig:
    """One entry of `optim.param_groups`: the parameters it names train with its values
    instead of the optim section's (as torch.optim's param_groups)."""

    params: list[str] = _doc([], "parameter names or shell-style patterns (fnmatch: '*.bias', "
                             "'*norm*'), matched against every name of a parameter")
    lr: float | None = _doc(None, "learning rate of these parameters; null: optim.lr")
    betas: list[float] | None = _doc(None, "Adam's (beta1, beta2); null: optim.betas")
    eps: float | None = _doc(None, "null: optim.eps")
    weight_decay: float | None = _doc(None, "e.g. 0.0 for biases and norms; null: "
                                      "optim.weight_decay")

    def __post_init__(self) -> None:
        _normalise(self, "optim.param_groups[]")
        if not self.params:
            raise ConfigError("optim.param_groups[]: params is empty; list parameter names or "
                              "patterns, e.g. ['*.bias', '*norm*']")
        for key in ("lr", "weight_decay"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"optim.param_groups[].{key}: {v} is negative; use >= 0")
        if self.eps is not None and not self.eps > _FP32_HALF_TINY:
            raise ConfigError(f"optim.param_groups[].eps: {self.eps} must be positive"
                              f"{_in_fp32(self.eps)}")
        if self.betas is not None and (len(self.betas) != 2
                                       or not all(0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError(f"optim.param_groups[].betas: {self.betas} must be two numbers "
                              "in [0, 1)")

    def overrides(self) -> dict[str, Any]:
        """The hyper-parameters this group sets (the others are the optim section's)."""
        return {k: (tuple(v) if k == "betas" else v) for k in HYPER_NAMES
                if (v := getattr(self, k)) is not None}


@dataclass(kw_only=True)
class OptimConfig:
    """The CPU optimizer (`offload.optim`): Adam/AdamW hyper-parameters (defaults of every
    parameter group) and the pipeline that streams NVMe-resident state through host buffers."""

    name: Literal["adamw", "adam"] = _doc(
        "adamw", "adamw: decoupled weight decay (torch.optim.AdamW); adam: weight decay added "
        "to the gradient (torch.optim.Adam)")
    lr: float = _doc(1e-3, "learning rate, before the schedule's multiplier", allowed=">= 0")
    betas: list[float] = _doc([0.9, 0.999], "Adam's (beta1, beta2): decay of the first and "
                              "second moment", allowed="two numbers in [0, 1)")
    eps: float = _doc(1e-8, "added to the denominator sqrt(v_hat) for stability", allowed="> 0")
    weight_decay: float = _doc(0.01, "weight decay coefficient (per step, times lr for adamw)",
                               allowed=">= 0")
    max_grad_norm: float = _doc(0.0, "clip the global gradient 2-norm to this (as "
                                "torch.nn.utils.clip_grad_norm_); 0: no clipping",
                                fix="e.g. 1.0, or 0 for no clipping", allowed=">= 0")
    kernel: Literal["auto", "native", "fused", "foreach"] = _doc(
        "auto", "native: offload's C kernel (one pass over memory, compressed moments and the "
        "compute-dtype copy included; built by pip install where gcc is present); fused: "
        "torch._fused_adamw_ (one pass over memory); foreach: torch._foreach_* math (several "
        "passes per cache block); auto: native where built (fused for the plain fp32 update, "
        "as fast there), else fused where torch has a CPU kernel, else foreach")
    chunk_elems: int = _doc(0, "fp32 elements per chunk streamed from NVMe (each chunk moves "
                            "12 bytes per element each way, 8 in fp32 training where the "
                            "parameter is the master, with fp32 moments); 0: the largest power "
                            "of two whose buffers, sized for the state a chunk holds, fit "
                            "io.buffer_budget x buffer_share", allowed="0 or a multiple of 1024")
    buffers: int = _doc(6, "chunk buffers of the swap pipeline: 1 no overlap, 2 reads ahead, "
                        "3 or more read ahead while earlier chunks are written (more keep "
                        "more requests in flight)", allowed="1..16")
    buffer_share: float = _doc(0.5, "fraction of io.buffer_budget the pipeline's buffers may "
                               "take when chunk_elems = 0", allowed="(0, 1]")
    block_elems: int = _doc(1048576, "elements per update-kernel call; one block of the four "
                            "fp32 arrays stays in cache for the compute-dtype copy (with "
                            "several threads, at most 524288 per thread)", allowed="at least 1024")
    state_dtype: Literal["fp32", "bf16", "int8"] = _doc(
        "fp32", "form of Adam's moments in every tier (host, NVMe, state_dict): fp32 (8 bytes "
        "per parameter), bf16 (4), int8 (about 2: 8-bit codes, one fp32 scale per 256); "
        "decoded and encoded inside the update's pass; the master stays fp32")
    param_groups: list[ParamGroupConfig] = _doc(
        [], "parameter groups, as torch.optim's: a list of tables {params = [names or "
        "patterns], lr, betas, eps, weight_decay}; e.g. [{params = ['*.bias', '*norm*'], "
        "weight_decay = 0.0}]; parameters named by none train with this section's values")

    def __post_init__(self) -> None:
        _normalise(self, "optim")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas: {self.betas} must be two numbers in [0, 1), "
                              "e.g. [0.9, 0.999]")
        for key in ("lr", "weight_decay", "max_grad_norm"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}: {getattr(self, key)} is negative; use >= 0"
                                  + (" (0: no clipping)" if key == "max_grad_norm" else ""))
        if not self.eps > _FP32_HALF_TINY:
            raise ConfigError(f"optim.eps: {self.eps} must be positive{_in_fp32(self.eps)}, "
                              "e.g. 1e-8")
        if self.chunk_elems < 0 or self.chunk_elems % 1024:
            raise ConfigError(f"optim.chunk_elems: {self.chunk_elems} is not 0 or a positive "
                              "multiple of 1024 (4 KiB of fp32); use e.g. 4194304")
        if not 1 <= self.buffers <= 16:
            raise ConfigError(f"optim.buffers: {self.buffers} is out of range; use 1..16 (3 "
                              "overlaps reads, update and writes)")
        if not 0.0 < self.buffer_share <= 1.0:
            raise ConfigError(f"optim.buffer_share: {self.buffer_share} must be in (0, 1]")
        if self.block_elems < 1024:
            raise ConfigError(f"optim.block_elems: {self.block_elems} is below 1024; use e.g. "
                              "262144")


@dataclass(kw_only=True)
class EngineConfig:
    """The ZeRO-3 engine (`offload.engine`): precision, placement, grouping, prefetch."""

    dtype: Literal["fp32", "bf16", "fp16"] = _doc(
        "fp32", "compute dtype of the gathered parameters; master weights and gradients "
        "stay fp32")
    params: Literal["device", "host", "nvme"] = _doc(
        "device", "home tier of the compute-dtype parameter partitions")
    grads: Literal["device", "host", "nvme"] = _doc(
        "host", "home tier of the fp32 gradient partitions between backward and step")
    optimizer: Literal["host", "nvme"] = _doc(
        "host", "where fp32 master weights and Adam moments live (nvme: streamed in chunks)")
    group_size: int = _doc(1 << 22, "parameters per group: a module whose subtree holds at "
                           "most this many parameters is gathered as one unit", allowed=">= 1")
    grad_accum_steps: int = _doc(1, "micro-steps (backward calls) per optimizer step",
                                 allowed=">= 1")
    prefetch_depth: int = _doc(2, "groups fetched ahead of use once an access trace exists",
                               allowed=">= 0")
    loss_scale: float = _doc(0.0, "fp16 only: a fixed loss scale, or 0 for dynamic scaling",
                             fix="e.g. 1024, or 0 for dynamic scaling", allowed=">= 0")
    initial_loss_scale: float = _doc(65536.0, "fp16 dynamic scaling: the first scale",
                                     allowed="> 0")
    loss_scale_window: int = _doc(1000, "fp16 dynamic scaling: steps without overflow "
                                  "before the scale doubles", allowed=">= 1")
    min_loss_scale: float = _doc(1.0, "fp16 dynamic scaling: the scale never drops below this",
                                 allowed="> 0, at most engine.initial_loss_scale")
    seed: int = _doc(0, "seed of the per-group RNG used to initialise a meta-device model, the "
                     "same on every rank", allowed="0..4294967295")
    check_rank_order: bool = _doc(True, "with several ranks: before each unit's forward and "
                                  "backward, check that every rank runs the same unit (one "
                                  "all-reduce of one number per rank); ranks that run "
                                  "different modules, or whose model raised on one rank, "
                                  "raise instead of hanging in an all-gather; under tensor "
                                  "parallelism (two numbers per rank) each forward's first "
                                  "check also compares a crc32 of the tensors the model was "
                                  "called with over each TP group, which must be the same")
    keep_checkpoints: int = _doc(0, "committed checkpoints of the training kept in a save's "
                                 "directory (the highest steps; its older ones, resumes "
                                 "included, are removed after a save; another training's "
                                 "are left); 0 keeps all", allowed=">= 0")
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = _doc(
        "fp32", "with several ranks: the dtype gradients are reduced across ranks in (bf16: "
        "half the bytes of fp32 on the wire); each rank's reduced slice is accumulated in "
        "fp32 either way, as FSDP2's MixedPrecisionPolicy(reduce_dtype=...)")
    reductions_in_flight: int = _doc(2, "with several ranks: gradient reductions kept in "
                                     "flight behind the backward of the next groups (each "
                                     "holds a group's gradient until it completes); 0 waits "
                                     "for each when it is issued", allowed=">= 0")
    whole_modules: list[str] = _doc([], "modules (names as model.named_modules() gives them, "
                                    "or a class name for every module of that class) each "
                                    "gathered as one unit with all its children, whatever "
                                    "its size: a module whose own forward reads a child's "
                                    "weight (F.linear(h, self.wte.weight)), as FSDP wraps a "
                                    "module with its children", allowed="names of modules "
                                    "or module classes, each once")

    def __post_init__(self) -> None:
        _normalise(self, "engine")
        for i, name in enumerate(self.whole_modules):
            if not name or self.whole_modules.index(name) != i:
                raise ConfigError(f"engine.whole_modules[{i}]: {name!r} is "
                                  f"{'empty' if not name else 'given twice'}; list each "
                                  "module's name (from model.named_modules()) once")
        if self.group_size < 1:
            raise ConfigError(f"engine.group_size: {self.group_size} must be >= 1")
        if self.grad_accum_steps < 1:
            raise ConfigError(f"engine.grad_accum_steps: {self.grad_accum_steps} must be >= 1")
        if self.prefetch_depth < 0:
            raise ConfigError(f"engine.prefetch_depth: {self.prefetch_depth} must be >= 0")
        if self.reductions_in_flight < 0:
            raise ConfigError(f"engine.reductions_in_flight: {self.reductions_in_flight} must "
                              "be >= 0 (0: each reduction is waited for when it is issued)")
        if self.loss_scale < 0:
            raise ConfigError(f"engine.loss_scale: {self.loss_scale} is negative; use 0 "
                              "(dynamic scaling) or a fixed scale such as 1024")
        for key in ("initial_loss_scale", "min_loss_scale"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"engine.{key}: {getattr(self, key)} must be positive, "
                                  "e.g. 1")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"engine.min_loss_scale: {self.min_loss_scale} is above "
                              f"engine.initial_loss_scale ({self.initial_loss_scale}); lower "
                              "it, e.g. to 1")
        if self.loss_scale_window < 1:
            raise ConfigError(f"engine.loss_scale_window: {self.loss_scale_window} must be >= 1")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"engine.keep_checkpoints: {self.keep_checkpoints} must be >= 0 "
                              "(0 keeps every checkpoint)")
        if not 0 <= self.seed < 1 << 32:
            raise ConfigError(f"engine.seed: {self.seed} is out of range; use 0..{(1 << 32) - 1}")


@dataclass(kw_only=True)
class CommConfig:
    """How collectives are issued (`offload.comm`)."""

    gather_thread: bool = _doc(False, "with several data-parallel ranks: issue parameter "
                               "all-gathers from one communication thread, over a second "
                               "process group of the same ranks, so a prefetch whose shard "
                               "is still being read does not hold up the module hook; every "
                               "rank issues them in the same order. gloo only: refused with "
                               "NCCL, whose collectives are asynchronous already")

    def __post_init__(self) -> None:
        _normalise(self, "comm")


MAX_PIECES = 64


@dataclass(kw_only=True)
class TensorParallelConfig:
    """Tensor parallelism (`offload.comm.tensor_parallel`): the Linear layers of known
    transformer blocks cut over TP ranks (docs/domino.md); ZeRO-3 partitions over the
    data-parallel ranks of the DP x TP mesh."""

    size: int = _doc(1, "ranks per tensor-parallel group; must divide the world size; 1: no "
                     "tensor parallelism (every rank is a data-parallel rank)",
                     allowed=">= 1")

    def __post_init__(self) -> None:
        _normalise(self, "tp")
        if self.size < 1:
            raise ConfigError(f"tp.size: {self.size} must be >= 1 (1: no tensor parallelism)")


@dataclass(kw_only=True)
class DominoConfig:
    """Domino slicing (`offload.comm.domino`): each tensor-parallel block runs its batch
    in pieces so the all-reduce of one piece runs behind the compute of the next."""

    pieces: int = _doc(2, f"with tp.size > 1: pieces the batch of a tensor-parallel block is "
                       f"cut into (1..{MAX_PIECES}; 1 waits for each all-reduce where it is "
                       "issued); a batch that is not a multiple runs in one piece")

    def __post_init__(self) -> None:
        _normalise(self, "domino")
        if not 1 <= self.pieces <= MAX_PIECES:
            raise ConfigError(f"domino.pieces: {self.pieces} is out of range; use "
                              f"1..{MAX_PIECES}, e.g. 2")


@dataclass(kw_only=True)
class OffloadConfig:
    """Root configuration: one section per layer."""

    io: IoConfig = field(default_factory=IoConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    tp: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    domino: DominoConfig = field(default_factory=DominoConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            cls = _hints(OffloadConfig)[f.name]
            if not isinstance(value, cls):
                setattr(self, f.name, _from_dict(cls, value, f.name))

    def validate(self) -> OffloadConfig:
        """Checks every key again (a config may be changed after it was made); returns
        self, or raises `ConfigError` naming the first bad key."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if not isinstance(section, _hints(OffloadConfig)[f.name]):
                raise ConfigError(f"{f.name}: expected a {_hints(OffloadConfig)[f.name].__name__}"
                                  f", got {type(section).__name__}")
            section.__post_init__()
        return self


# an eps at or below half fp32's smallest number rounds to 0 where the kernels use it: a
# weight whose gradients were all zero then divides 0 by 0
_FP32_HALF_TINY = 2.0 ** -150


def _in_fp32(eps: float) -> str:
    return " in fp32 (it rounds to 0 there)" if 0 < eps <= _FP32_HALF_TINY else ""


def _check_type(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = " | ".join(map(str, typing.get_args(tp)))
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        refused = []  # (type, error) of each member of the union
        for arg in typing.get_args(tp):
            try:
                return _check_type(key, value, arg)
            except ConfigError as e:
                refused.append((arg, e))
        real = [e for arg, e in refused if arg is not type(None)]
        if len(real) == 1:  # `X | None`: X's own message ("expected a number, got ...")
            raise ConfigError(f"{real[0]}; or leave {key} out (unset)") from None
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
        if abs(value) > 1 << 63:  # no count here is near this; keeps messages printable
            raise ConfigError(f"{key}: {_shown(value)} is out of range (beyond 2^63); give "
                              "a value as docs/configuration.md lists, e.g. the default")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an int beyond any float (JSON integers are unbounded)
            return math.inf  # refused by _normalise, naming the key and a finite value
    if tp is str:
        if isinstance(value, os.PathLike):  # a pathlib.Path in io.paths, as the section takes
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {tp}")


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):  # a section made directly, perhaps changed since: check it again
        data.__post_init__()
        return data
    if not isinstance(data, collections.abc.Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a table of keys, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key; known keys here: {known}")
        if fields[name].metadata.get("bytes"):
            kwargs[name] = parse_bytes(value, key, whole=True)
        else:
            kwargs[name] = _check_type(key, value, hints[name])
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # a list entry checks itself under a generic name ("optim.param_groups[]"): name it
        generic = re.sub(r"\[[0-9]+\]$", "[]", prefix)
        msg = str(e)
        if generic != prefix and msg.startswith(generic):
            raise ConfigError(prefix + msg[len(generic):]) from e
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from e


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (json.loads keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"{k!r} is given twice in one table; give each key once")
        out[k] = v
    return out


def toml_loads(text: str, where: str = "config") -> dict[str, Any]:
    """TOML `text` as a dict (Python 3.11's tomllib; on 3.10 the tomli package, the same
    parser, which offload requires there); `ConfigError` naming `where` if it is not
    valid TOML."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(f"{where}: reading TOML on Python 3.10 needs the tomli package "
                              "(pip install tomli; Python 3.11 has it built in); or give the "
                              "config as .json") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from e
    except RecursionError:  # arrays or tables nested thousands deep
        raise ConfigError(f"{where}: not valid TOML: nested deeper than this reader "
                          "follows") from None


def load_config(source: OffloadConfig | dict | str | os.PathLike | None = None) -> OffloadConfig:
    """Builds an `OffloadConfig` from an instance, a dict (any mapping), or a .toml/.json
    file path."""
    if source is None:
        return OffloadConfig()
    if isinstance(source, OffloadConfig):
        return source.validate()
    if isinstance(source, collections.abc.Mapping):
        return _from_dict(OffloadConfig, source, "")
    if not isinstance(source, (str, os.PathLike)) or isinstance(source, bytes):
        hint = ""
        if dataclasses.is_dataclass(source) and not isinstance(source, type):
            section = next((f.name for f in dataclasses.fields(OffloadConfig)
                            if _hints(OffloadConfig)[f.name] is type(source)), None)
            if section:
                hint = f"; for one section, give OffloadConfig({section}=...)"
        raise ConfigError(f"config: expected an OffloadConfig, a dict, or the path of a .toml "
                          f"or .json file, got {type(source).__name__}{hint}")
    path = Path(source)
    try:
        kind = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission
        raise ConfigError(f"config file {str(path)!r} cannot be read: "
                          f"{getattr(e, 'strerror', None) or e}") from e
    if stat.S_ISDIR(kind):
        raise ConfigError(f"config file {path} is a directory; give the path of a .toml or "
                          ".json file")
    if not stat.S_ISREG(kind):
        raise ConfigError(f"config file {path} is not a regular file; give the path of a "
                          ".toml or .json file")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .toml or .json")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark (Windows) is skipped
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); save the config as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from e
    if suffix == ".toml":
        data = toml_loads(text, str(path))
    else:
        try:
            data = json.loads(text, object_pairs_hook=_json_object)
        except (json.JSONDecodeError, ValueError) as e:  # ValueError: an int too long
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
        except RecursionError:  # nested thousands deep (this module imports no offload's
            raise ConfigError(f"{path}: not valid JSON: nested deeper than this reader "
                              "follows") from None  # files.json_loads: it loads alone)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
    try:
        return _from_dict(OffloadConfig, data, "")
    except ConfigError as e:  # a key or value of the file: the file is named too
        raise ConfigError(f"{path}: {e}") from None


def _plain(value: Any) -> Any:
    """A section's value as JSON takes it (param_groups: their dicts)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items() if v is not None}
    return value


def config_reference(cls: type = OffloadConfig, prefix: str = "", values: Any = None
                     ) -> list[tuple[str, str, str]]:
    """(key, default, description) rows for every leaf key; used by the docs and CLI.
    With `values` (an instance of `cls`, an `OffloadConfig`), its value instead of the
    default."""
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
                default := f.default_factory()):
            rows.extend(config_reference(type(default), key, None if values is None
                                         else getattr(values, f.name)))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if values is not None:
            default = getattr(values, f.name)
            if dataclasses.is_dataclass(default) or (
                    isinstance(default, list) and default and dataclasses.is_dataclass(default[0])):
                default = _plain(default)
        if f.metadata.get("bytes"):
            default = format_bytes(default) if default else "0"
        doc = f.metadata.get("doc", "")
        tp = _hints(cls)[f.name]
        if typing.get_origin(tp) is Literal:
            doc += "; one of: " + ", ".join(typing.get_args(tp))
        if f.metadata.get("allowed"):
            doc += "; allowed: " + f.metadata["allowed"]
        rows.append((key, json.dumps(default) if not isinstance(default, str) else default, doc))
    return rows
