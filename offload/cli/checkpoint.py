"""`offload checkpoint info PATH` and `offload checkpoint export PATH --to DIR`.

`info` prints what a checkpoint holds (step, config, world size, bytes per
tensor kind, `extra`) and reads every chunk to check its checksum (exit code
1 when something is damaged); `export` writes the weights as Hugging Face
safetensors shards with a `model.safetensors.index.json`, one tensor in
memory at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

from ..config import format_bytes
from .args import (DamageError, UsageError, byte_size, directory, existing_directory,
                   missing_directories, remove_directories)

if TYPE_CHECKING:
    import torch

    from ..engine.checkpoint_reader import CheckpointReader

__all__ = ["add_arguments", "run_info", "run_export", "export_safetensors", "summary"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_CONFIGS = ("config.json", "generation_config.json")  # what from_pretrained reads beside weights
RECORD = "checkpoint.json"  # the commit record (offload/engine/training_checkpoint.py)


def _open(path: str) -> "CheckpointReader":
    """The checkpoint at `path` (the engine, and torch, are imported only now)."""
    from ..engine.checkpoint_files import CheckpointPermissionError
    from ..engine.checkpoint_reader import CheckpointReader
    from ..engine.training_checkpoint import CheckpointCorruptError, CheckpointError
    try:
        return CheckpointReader(path)
    except (CheckpointCorruptError, CheckpointPermissionError) as e:  # exit code 1
        raise DamageError(str(e)) from e  # (docs/cli.md)
    except CheckpointError as e:
        raise UsageError(str(e)) from e


def add_arguments(sub: argparse._SubParsersAction) -> None:
    ckpt = existing_directory(RECORD, "checkpoint directory (written by "
                              "engine.save_checkpoint)")
    info = sub.add_parser("info", help="step, config, bytes per tensor kind, integrity")
    info.add_argument("path", type=ckpt, help="the checkpoint directory")
    info.add_argument("--json", action="store_true", help="one JSON object on stdout")
    info.add_argument("--no-verify", action="store_true",
                      help="skip reading every chunk to check its checksum")
    info.set_defaults(func=run_info)
    exp = sub.add_parser("export", help="the weights as Hugging Face safetensors shards")
    exp.add_argument("path", type=ckpt, help="the checkpoint directory")
    exp.add_argument("--to", required=True, type=directory("directory for the shards"),
                     help="the directory to write (created; existing shards are refused)")
    exp.add_argument("--dtype", choices=["saved", "fp32", "bf16", "fp16"], default="saved",
                     help="saved: the parameters in the compute dtype they were trained in; "
                          "fp32, bf16, fp16: converted from the fp32 master weights where "
                          "the checkpoint has them, else from the parameters (default "
                          "saved)")
    exp.add_argument("--shard-size", type=byte_size(1, example="5GB"), default="5GB",
                     help="bytes per shard at most (a larger tensor has a shard of its own) "
                     "(default 5GB)")
    exp.add_argument("--config", type=existing_directory(
        "config.json", "model directory holding config.json (e.g. one written by "
        "save_pretrained)"), help="copy its config.json (its dtype set to the weights') and "
        "generation_config.json into --to, so transformers' from_pretrained loads the result")
    exp.set_defaults(func=run_export)


def summary(reader: CheckpointReader) -> dict:
    """What `info` prints, as a dict (bytes per kind are the logical tensor bytes)."""
    from ..engine.training_checkpoint import KINDS
    rec = reader.record
    kinds = {k: 0 for k in KINDS}
    for t in reader.tensors.values():
        n = math.prod(t["shape"])
        for kind, dtype in t["kinds"].items():
            kinds[kind] += n * _ITEMSIZE[dtype]
    on_disk = sum(f.stat().st_size for f in reader.path.rglob("*") if f.is_file())
    cfg = rec["config"]["engine"]
    return {"path": str(reader.path), "format": rec["format"], "version": rec["version"],
            "global_step": rec["global_step"], "world": rec["world"], "dtype": rec["dtype"],
            "placement": {k: cfg[k] for k in ("params", "grads", "optimizer")},
            "loss_scale": rec["loss_scale"], "tensors": len(reader.tensors),
            "parameters": sum(math.prod(t["shape"]) for t in reader.tensors.values()),
            "bytes": {k: v for k, v in kinds.items() if v}, "bytes_on_disk": on_disk,
            "param_groups": rec["param_groups"], "extra": rec["extra"],
            "config": rec["config"]}


def _integrity(denied: bool) -> str:
    """What `info` calls a checkpoint with problems: where they are only files this
    process may not read, their permissions (the files may be intact), else damage."""
    return "unreadable (permissions)" if denied else "damaged"


def run_info(args: argparse.Namespace) -> int:
    try:
        reader = _open(args.path)
    except DamageError as e:  # --json: still one object on stdout, for a script to read
        if args.json:
            from ..engine.checkpoint_files import CheckpointPermissionError
            denied = isinstance(e.__cause__, CheckpointPermissionError)
            print(json.dumps({"path": str(args.path), "integrity": _integrity(denied),
                              "problems": [str(e)]}, indent=1))
        raise
    s = summary(reader)
    problems = None if args.no_verify else reader.verify()
    s["integrity"] = ("not checked" if problems is None else "ok" if not problems
                      else _integrity(not reader.damaged))
    s["problems"] = problems or []
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(f"checkpoint {s['path']} ({s['format']}, offload {s['version']})")
        print(f"  step {s['global_step']}, written by {s['world']} rank(s), {s['dtype']}, "
              f"params on {s['placement']['params']}, optimizer state on "
              f"{s['placement']['optimizer']}, loss scale {s['loss_scale']:g}")
        print(f"  {s['tensors']} tensors, {s['parameters']:,} parameters, "
              f"{format_bytes(s['bytes_on_disk'])} on disk")
        for kind, n in s["bytes"].items():
            print(f"  {kind:<11} {format_bytes(n)}")
        if s["extra"]:
            print(f"  extra {json.dumps(s['extra'])}")
        print(f"  integrity: {s['integrity']}")
        for p in s["problems"]:
            print(f"    {p}")
    return 1 if problems else 0


# what a peft model's names hold besides the base model's under "base_model.model."
_PEFT_MARKS = (".lora_", ".base_layer.", ".ia3_", ".modules_to_save.", ".original_module.",
               "prompt_encoder.", ".lokr_", ".loha_", ".oft_", ".boft_", ".vera_")


def export_safetensors(reader: CheckpointReader, out: str | os.PathLike, *,
                       dtype: str = "saved", shard_size: int = 5 * 10**9,
                       config: str | os.PathLike | None = None) -> list[Path]:
    """Writes the weights as safetensors shards (`model.safetensors`, or
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), one
    tensor in memory at a time, as `engine.save_pretrained` writes them; tied
    weights are written once, under their first name, and the module buffers the
    checkpoint holds after them (as `engine.save_pretrained`); a conversion that would
    make a finite value inf raises `UsageError`; with `config`, that
    directory's config.json (its dtype field set to the weights' dtype: `_config_copies`)
    and generation_config.json beside them, where no file of those names in `out` would
    then disagree with it (else `UsageError`: `_check_copies`). All or
    nothing: a failure (an `OSError` of the disk keeps its errno and names the file
    and the fix) leaves no file of them in `out`. Returns the files."""
    import torch

    from ..engine.safetensors_writer import TensorSpec, write_shards
    from ..engine.checkpoint_layout import TORCH_DTYPES

    if any(name.startswith("base_model.model.") for name in reader.tensors) and any(
            mark in name for name in reader.tensors for mark in _PEFT_MARKS):
        # peft's names: a model under them loads as a fresh one, without a word
        raise UsageError("CHECKPOINT holds a peft model (its names start with "
                         "'base_model.model.'), whose Hugging Face form is its adapters: "
                         "resume it (offload.initialize(peft_model, config, resume=CHECKPOINT))"
                         " and save them with `with engine.full_weights(): "
                         "model.save_pretrained(dir)` (nothing was written)")

    def kind_and_dtype(t: dict) -> tuple[str, str]:
        if dtype == "saved":
            return "param", t["kinds"]["param"]
        # the fp32 master where there is one: an fp16 copy made bf16 was rounded twice
        kind = "master" if "master" in t["kinds"] else "param"
        return kind, _TORCH_DTYPES[dtype]
    specs = [TensorSpec(name, tuple(t["shape"]), getattr(torch, kind_and_dtype(t)[1]))
             for name, t in reader.tensors.items()]
    # the persistent buffers (BatchNorm's statistics), after the parameters, as
    # save_pretrained writes them: without them a loaded model computes otherwise
    buffers = reader.buffers()

    def buffer_dtype(b: torch.Tensor) -> torch.dtype:
        if dtype == "saved" or not b.is_floating_point():
            return b.dtype
        return getattr(torch, _TORCH_DTYPES[dtype])
    specs += [TensorSpec(name, tuple(b.shape), buffer_dtype(b)) for name, b in buffers.items()]

    def tensors():
        for name, t in reader.tensors.items():
            kind, dt = kind_and_dtype(t)
            flat = reader.read_range(kind, name, 0, math.prod(t["shape"]))
            yield name, _converted(name, flat, TORCH_DTYPES[dt], dtype).reshape(t["shape"])
        for name, b in buffers.items():
            yield name, _converted(name, b, buffer_dtype(b), dtype)
    written = {kind_and_dtype(t)[1] for t in reader.tensors.values()}
    with tempfile.TemporaryDirectory(prefix="offload-config-") as staged:
        copies = _config_copies(config, Path(staged), written.pop() if len(written) == 1
                                else None)
        _check_copies(out, config, copies)
        try:
            return write_shards(out, specs, tensors(), shard_size, copies=copies,
                                elsewhere="give another --to")
        except FileExistsError as e:
            raise UsageError(f"--to: {e}") from e


def _converted(name: str, t: torch.Tensor, to: torch.dtype, asked: str) -> torch.Tensor:
    """`cast_finite` with its refusal as a `UsageError` naming --dtype."""
    from ..engine.safetensors_writer import cast_finite
    try:
        return cast_finite(name, t, to)
    except OverflowError as e:
        raise UsageError(f"--dtype {asked}: {e}; give --dtype bf16 or fp32 (nothing was "
                         "written)") from None


def _config_copies(config: str | os.PathLike | None, staged: Path,
                   dtype: str | None) -> dict[str, Path]:
    """{name in --to: file} of what `config` (a model directory) gives the export: its
    config.json and generation_config.json where it has them. Where config.json's
    "dtype" (or older "torch_dtype") names another dtype than `dtype` (the exported
    parameters' one torch dtype, e.g. "bfloat16"; None where they have several), a copy
    in `staged` that names `dtype` instead, as `engine.save_pretrained` writes the
    config: from_pretrained builds the model in the config's dtype. A config.json that
    is not a JSON object raises `UsageError` naming it."""
    if config is None:
        return {}
    from ..files import json_loads, read_regular_text
    copies = {name: Path(config) / name for name in _CONFIGS
              if (Path(config) / name).is_file()}
    src = copies.get("config.json")
    if src is None:
        return copies
    try:
        fields = json_loads(read_regular_text(src))
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {src} cannot be read as JSON ({e}); give a model "
                         "directory whose config.json transformers reads") from e
    if not isinstance(fields, dict):
        raise UsageError(f"--config: {src} is not a JSON object; give a model directory "
                         "whose config.json transformers reads")
    keys = [k for k in ("dtype", "torch_dtype") if k in fields and fields[k] != dtype]
    if dtype is not None and keys:
        fields.update({k: dtype for k in keys})
        copies["config.json"] = staged / "config.json"  # as transformers writes it:
        copies["config.json"].write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return copies


def _check_copies(to: str | os.PathLike, config: str | os.PathLike | None,
                  copies: dict[str, Path]) -> None:
    """Refuses, before anything is written, a config file in --to that the export would
    leave disagreeing with --config: one that is neither --config's file nor the copy
    (`copies`) written over it (the user's own config.json), or one --config lacks (another
    model's generation_config.json, which from_pretrained would read with these weights)."""
    for name in _CONFIGS if config is not None else ():
        src, dst = Path(config) / name, Path(to) / name
        if not (dst.exists() or dst.is_symlink()):
            continue
        if name not in copies:
            raise UsageError(f"--to: {dst} exists and --config {config} has no {name}: "
                             "from_pretrained would read it with the exported weights; give "
                             "an empty --to, or remove it")
        try:
            if dst.is_file() and (src.samefile(dst) or dst.read_bytes() in (
                    src.read_bytes(), copies[name].read_bytes())):
                continue
        except OSError:
            pass
        raise UsageError(f"--to: {dst} exists and is not the --config file {src}; give an "
                         "empty --to, or remove it")


def _check_outside(to: str, checkpoint: str) -> None:
    """Refuses a --to inside the checkpoint: a published checkpoint is never changed
    (its size, as `info` reports it, would count the export)."""
    dst, src = Path(to).resolve(), Path(checkpoint).resolve()
    if dst == src or src in dst.parents:
        raise UsageError(f"--to: {to} is inside the checkpoint {checkpoint}, which a save "
                         "published and nothing changes; give a directory outside it")


def run_export(args: argparse.Namespace) -> int:
    from ..engine.training_checkpoint import CheckpointError
    _check_outside(args.to, args.path)
    reader = _open(args.path)
    created = missing_directories(args.to)
    files = None
    try:
        files = export_safetensors(reader, args.to, dtype=args.dtype,
                                   shard_size=args.shard_size, config=args.config)
    except (CheckpointError, OSError) as e:  # a damaged checkpoint, a full disk: the machine's
        print(f"offload checkpoint export: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        if files is None:  # a failed export leaves no directory it made (its files are gone)
            remove_directories(created)
    for f in files:
        print(f)
    return 0
