"""The MODEL argument of `offload estimate` and `offload tune`, and what is learnt from
it on the `meta` device: partition sizes, activation bytes and compute per unit.

MODEL is a Hugging Face config (a `config.json` file, or a local model
directory holding one; `--hf-config FILE` says the same) or `module:function`,
a function that returns an `nn.Module` (the module is imported from the current
directory or PYTHONPATH). The model is built under `torch.device("meta")`:
nothing is materialised. A Hugging Face model (a config's: the class its
`architectures` names, else AutoModelForCausalLM's) is fed as its head needs
(model_arg_hf.py). Another model's batch is `--batch` rows of `--seq` tokens where its
first parameterised module is an embedding, else `--batch` rows (of `--seq`
positions when `--seq` is given) of the first Linear's input features. A Hugging
Face model's context (`max_position_embeddings`, GPT-2's `n_positions`) bounds
`--seq` and, where it is shorter than 512, is the default.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..files import json_loads, read_regular_text
from .args import UsageError, integer
from .model_arg_hf import (WRAPPER, build_from_config, hf_base, hf_batch, image_positions,
                           is_hf_model, set_eager)

__all__ = ["ModelSpec", "MeasuredModel", "add_model_arguments", "model_spec", "measure_model"]

DTYPES = ("fp32", "bf16", "fp16")
# far above any real micro-batch, and low enough that batch x seq x a layer's width (up to
# 65536) x 4 bytes fits torch's 64-bit sizes; a wider batch is refused by `_zeros`
MAX_BATCH, MAX_SEQ = 1 << 20, 1 << 24


@dataclass(frozen=True)
class ModelSpec:
    """What the command line names: the model, the batch shape and the compute dtype."""

    source: str          # "hf" or "function"
    target: str          # the config path, or "module:function"
    batch: int
    seq: int | None      # None: the model's default for its kind
    dtype: str

    def build(self, eager: bool = False) -> Any:
        """The model on the meta device (or, called under another device, there); a
        Hugging Face model with `eager` (a config's, or one a function returns): with
        transformers' eager attention ([Note: eager on meta])."""
        if self.source == "hf":  # the class its architectures names (model_arg_hf.py)
            return build_from_config(self.target, eager)
        mod_name, fn_name = self.target.split(":")
        model = getattr(importlib.import_module(mod_name), fn_name)()
        if eager and is_hf_model(model):
            set_eager(model)
        return model

    def factory(self) -> Callable[[], Any]:
        """A function that builds the model: what `offload.initialize` takes."""
        return self.build

    def describe(self) -> str:
        return f"{self.target} ({self.dtype}, batch {self.batch}" + (
            f" x {self.seq})" if self.seq else ")")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, --hf-config, --batch, --seq, --dtype."""
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face config.json or model directory, or module:function "
                   "returning an nn.Module")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json (or a "
                   "directory holding one), instead of MODEL")
    p.add_argument("--batch", type=integer(1, MAX_BATCH, example=8), default=8,
                   help=f"rows per micro-batch, 1..{MAX_BATCH} (default 8)")
    p.add_argument("--seq", type=integer(1, MAX_SEQ, example=512), default=None,
                   help=f"tokens per row, 1..{MAX_SEQ} (default 512 for a model with an "
                   "embedding, or a Hugging Face model's context where shorter; at most "
                   "that context)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="compute dtype: fp32, bf16 or fp16 (default bf16)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The checked model argument; `UsageError` (one line, exit 2) when it names nothing
    usable."""
    if args.model and args.hf_config:
        raise UsageError("MODEL and --hf-config: give one of them, not both")
    text = args.hf_config or args.model
    flag = "--hf-config" if args.hf_config else "MODEL"
    if not text:
        raise UsageError("MODEL: missing; give a Hugging Face config.json or model directory, "
                         "or module:function returning an nn.Module")
    if args.hf_config or os.path.exists(text) or text.endswith(".json"):
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: {text!r} is not a config.json file or a directory "
                             "holding one; give the path of a Hugging Face config")
        try:
            data = json_loads(read_regular_text(path))
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag}: {path} cannot be read as JSON ({e}); give a Hugging "
                             "Face config.json") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise UsageError(f"{flag}: {path} has no model_type; give a Hugging Face "
                             "config.json")
        return ModelSpec("hf", path, args.batch, _hf_seq(data, args.seq), args.dtype)
    if text.count(":") != 1 or not all(text.split(":")):
        raise UsageError(f"MODEL: {text!r} is neither an existing config file or directory nor "
                         "module:function; give e.g. ./config.json or mymodels:build")
    mod_name, fn_name = text.split(":")
    if mod_name.endswith(".py") or os.sep in mod_name:  # a file's path, not a module's name
        where, name = os.path.split(mod_name[:-3] if mod_name.endswith(".py") else mod_name)
        raise UsageError(f"MODEL: {mod_name!r} is a file's path, not a module's name; give "
                         f"{name}:{fn_name}" + (f" with PYTHONPATH={where}" if where else "")
                         + " (module:function, as python -m names a module)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would find the user's module
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module: any import failure is a bad argument
        raise UsageError(f"MODEL: cannot import {mod_name!r} ({type(e).__name__}: {e}); give "
                         "module:function importable from the current directory") from None
    if not callable(getattr(mod, fn_name, None)):
        raise UsageError(f"MODEL: module {mod_name!r} has no function {fn_name!r}; give "
                         "module:function returning an nn.Module")
    return ModelSpec("function", text, args.batch, args.seq, args.dtype)


# the keys a Hugging Face config names its context length by (GPT-2's n_positions is
# what transformers maps max_position_embeddings to; Whisper's decoder, the causal LM,
# has max_target_positions)
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                  "seq_length", "max_target_positions")
# models whose positions start after the padding index (RoBERTa's embeddings number a
# row's tokens pad_token_id + 1, ...): their context is that much shorter
_PADDED_POSITIONS = ("roberta", "xlm-roberta", "camembert")
DEFAULT_SEQ = 512


def _hf_seq(config: dict, seq: int | None) -> int | None:
    """--seq checked against the model's context (a longer batch cannot run: a real step
    of a model with position embeddings fails), and the default (512) cut to it."""
    key = next((k for k in _POSITION_KEYS if isinstance(config.get(k), int)
                and not isinstance(config.get(k), bool) and config[k] > 0), None)
    if key is None:
        return seq
    limit, why = config[key], f"{key} ({config[key]})"
    pad = config.get("pad_token_id")
    if config.get("model_type") in _PADDED_POSITIONS and isinstance(pad, int) and pad >= 0:
        limit -= pad + 1  # positions pad + 1 .. pad + seq must be rows of the table
        why += f" less its positions' offset ({pad + 1}, after pad_token_id)"
    if seq is None:
        return min(DEFAULT_SEQ, limit)
    if seq > limit:
        raise UsageError(f"--seq: {seq} is above the model's {why}: a longer row cannot "
                         f"run; give at most {limit}")
    return seq


@dataclass
class MeasuredModel:
    """A model measured on meta: its groups' elements per rank, activation bytes, and
    forward FLOPs per unit (in the units' forward order)."""

    spec: ModelSpec
    params: int                              # elements
    shards: tuple[tuple[int, bool], ...]     # per group: elements per rank, trains
    unit_names: list[str]
    unit_groups: list[list[int]]             # gids each unit gathers
    unit_flops: list[float]                  # forward FLOPs of each unit (own modules)
    activations: int                         # bytes saved for backward
    activations_checkpointed: int            # with checkpointing of each block
    tokens: int                              # positions per micro-batch
    groups: list = field(default_factory=list, repr=False)  # the engine's groups (meta)
    containers: list[str] = field(default_factory=list)  # units that are never called
    model_class: str = ""  # the class measured (a config's: the one its architectures names)


def _build_meta(spec: ModelSpec, eager: bool = False):
    import torch

    from ..engine.meta import meta_device

    with meta_device():
        try:
            model = spec.build(eager)
        except (MemoryError, UsageError):  # out of memory; a config no class builds
            raise
        except Exception as e:  # the user's code or config: report, not a traceback
            raise UsageError(f"MODEL: building {spec.target} on the meta device failed "
                             f"({type(e).__name__}: {e}); check the model") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"MODEL: {spec.target} returned {type(model).__name__}, not an "
                         "nn.Module; return the model")
    from ..config import ConfigError
    from ..engine.model_checks import refuse_lazy
    try:
        refuse_lazy(model, f"MODEL: {spec.target}")
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return model


def example_batch(model: Any, spec: ModelSpec, device: Any) -> tuple[dict, Callable]:
    """(kwargs of one forward call, loss of its output) for the batch shape."""
    import torch
    from torch import nn

    def make(shape, dtype):
        return _zeros(spec, shape, dtype, device)

    if spec.source == "hf" or is_hf_model(model):  # inputs as its head needs them
        seq = spec.seq or DEFAULT_SEQ
        if spec.source != "hf":  # a function's Hugging Face model: its context
            seq = _hf_seq(model.config.to_dict(), spec.seq) or DEFAULT_SEQ
        return hf_batch(model, spec, seq, make)
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))),
                 None)
    if isinstance(first, nn.Embedding):
        ids = make((spec.batch, spec.seq or DEFAULT_SEQ), torch.long)
        return {"input": ids}, lambda out: out.float().square().mean()
    if first is None:
        raise UsageError(f"MODEL: {spec.target} has no Linear or Embedding to take a batch "
                         "shape from; give a model whose first layer is one")
    shape = (spec.batch, spec.seq, first.in_features) if spec.seq else \
        (spec.batch, first.in_features)
    return {"input": make(shape, torch.float32)}, lambda out: out.float().square().mean()


def _fed(batch: dict) -> str:
    """What a forward was given, in words: "input_ids (8, 512) int64 and
    labels=input_ids"."""
    ids = batch.get("input_ids")
    parts = [f"{k}=input_ids" if v is ids and k != "input_ids" else
             f"{'one tensor' if k == 'input' else k} {tuple(v.shape)} "
             f"{str(v.dtype).removeprefix('torch.')}" for k, v in batch.items()]
    return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


def _zeros(spec: ModelSpec, shape: tuple, dtype: Any, device: Any) -> Any:
    """The batch tensor; a shape torch refuses (too many elements, or too many bytes
    where it is allocated) is a bad --batch/--seq, not a traceback."""
    import torch

    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, OverflowError, MemoryError) as e:
        raise UsageError(f"--batch/--seq: a batch of shape {tuple(shape)} for {spec.target} "
                         f"cannot be made on the {device} device ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); give a smaller "
                         "--batch or --seq") from None


def call(model: Any, batch: dict) -> Any:
    return model(batch["input"]) if "input" in batch else model(**batch)


def _blocks(model: Any) -> list:
    """The repeated blocks activation checkpointing wraps: the children of the largest
    ModuleList (a transformer's layers), or the top-level children."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return list(max(lists, key=len))
    return list(model.children()) or [model]


def _saved_bytes(model: Any, spec: ModelSpec) -> tuple[int, int, Any]:
    """Bytes of tensors saved for backward (parameters excluded), total and with each
    block checkpointed (its input kept, plus the largest block's saved bytes while it
    is recomputed), and the flop counter of the same meta forward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    blocks = _blocks(model)
    seen: set[int] = set()
    per_block = [0] * len(blocks)
    inputs = [0] * len(blocks)
    current = [-1]
    total = [0]

    keep: list = []  # holds what `seen` names, so no id is reused while it counts

    def pack(t):
        base = t._base if t._base is not None else t  # a view's bytes are its base's
        if id(base) not in params and id(t) not in params and id(base) not in seen:
            seen.add(id(base))
            keep.append(base)
            n = base.numel() * base.element_size()
            total[0] += n
            if current[0] >= 0:
                per_block[current[0]] += n
        return t

    hooks = []
    for i, b in enumerate(blocks):
        def pre(mod, args, i=i):
            current[0] = i
            inputs[i] = sum(a.numel() * a.element_size() for a in args
                            if isinstance(a, torch.Tensor))

        hooks += [b.register_forward_pre_hook(pre),
                  b.register_forward_hook(lambda *a: current.__setitem__(0, -1))]
    batch, loss_of = example_batch(model, spec, "meta")
    params = set()
    # the engine computes with parameters gathered in the compute dtype (no autocast)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    model.to(dtype)
    params.update(id(p) for p in model.parameters())
    batch = {k: v.to(dtype) if v.dtype.is_floating_point else v for k, v in batch.items()}
    try:
        with FlopCounterMode(display=False) as fc, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of(call(model, batch))
    except UsageError:
        raise
    except Exception as e:
        # say what the model was fed: a Hugging Face model's head may want other inputs
        fix = (f"it was fed {_fed(batch)}: check --batch/--seq against the model, or "
               + (WRAPPER if "input" not in batch else "give module:function returning a "
                  "wrapper whose forward takes that one tensor"))
        if "Expected inputs of BF16 type" in str(e):  # grouped_mm's check on meta alone
            fix = ("the model's experts (grouped_mm) run on the meta device in bf16 alone, "
                   "where they train in any dtype: estimate with --dtype bf16 (its "
                   "activations are half of fp32's)")
        raise UsageError(f"MODEL: a forward pass of {spec.target} on the meta device at batch "
                         f"{spec.batch} failed ({type(e).__name__}: {e}); {fix}") from None
    finally:
        for h in hooks:
            h.remove()
    outside = total[0] - sum(per_block)
    ckpt = outside + sum(inputs) + max(per_block, default=0)
    return total[0], min(ckpt, total[0]), fc


def measure_model(spec: ModelSpec, group_size: int, world: int = 1) -> MeasuredModel:
    """Builds the model on meta and measures it ([module docstring])."""
    from ..engine.units import build_units

    model = _build_meta(spec)
    try:
        act, act_ckpt, fc = _saved_bytes(model, spec)
    except UsageError as first:
        # [Note: eager on meta] Some of transformers' kernels cannot run on the meta
        # device where they run on a CPU or GPU: the SDPA mask of BART's decoder
        # (MBart, Marian, Pegasus) calls .item(). Those models were refused though
        # they train. Built with the eager attention they are measured (a config's
        # model built so, a function's set so once built: either source's): eager
        # attention keeps its scores for backward, so the activations counted are at
        # least SDPA's (an upper bound). A model refused that way too is refused with
        # its first error (MoE experts: grouped_mm is checked on meta for bf16 alone,
        # and the eager experts' nonzero has no meta form).
        if not is_hf_model(model):
            raise
        try:
            model = _build_meta(spec, eager=True)
            act, act_ckpt, fc = _saved_bytes(model, spec)
        except UsageError:
            raise first from None
    units, groups = build_units(model, group_size, world)
    counts = fc.get_flop_counts()
    root = type(model).__name__
    flops = []
    for u in units:
        name = root if u.name == "<root>" else f"{root}.{u.name}"
        per = counts.get(name, {})
        own = sum(per.values())
        # a unit that only holds its own direct parameters (children are units of their
        # own) counts the FLOPs of its direct parameters' ops only: none are known, so 0
        flops.append(float(own) if _whole_unit(u) else 0.0)
    batch, _ = example_batch(model, spec, "meta")
    x = next(iter(batch.values()))
    tokens = x.shape[0] * (x.shape[1] if x.dim() > 1 and x.dtype.is_floating_point is False
                           else (x.shape[1] if x.dim() > 2 else 1))
    if "pixel_values" in batch:  # an image model: its patches are its positions
        tokens = x.shape[0] * image_positions(model.config)
    return MeasuredModel(spec, sum(g.numel for g in groups),
                         tuple((g.shard, g.requires_grad) for g in groups),
                         [u.name for u in units], [list(u.needs) for u in units], flops,
                         act, act_ckpt, int(tokens), groups,
                         [u.name for u in units if _never_called(u.module)],
                         type(hf_base(model)).__name__)


def _never_called(module) -> bool:
    """A container (ModuleList, ModuleDict) has no forward: as a unit its hooks would
    never run, so its parameters could not be gathered."""
    from torch import nn

    return type(module).forward is nn.Module.forward


def _whole_unit(u) -> bool:
    """A unit gathering its whole subtree (its FLOPs are its subtree's)."""
    own = {id(p) for p in u.module.parameters(recurse=False)}
    return not own or len(own) == sum(1 for _ in u.module.parameters())
