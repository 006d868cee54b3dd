"""Reading initial weights lazily from safetensors files (one tensor at a time).

A checkpoint is a `.safetensors` file, or a directory, whose files are chosen as
transformers' `from_pretrained` chooses them (`_checkpoint_files`). Tensors are
read by name when their group is materialised, so no process holds the whole
checkpoint; names may carry a prefix the model lacks (or lack one it has),
as with `transformer.` in GPT-2 files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from ..files import json_loads, read_regular_text

log = logging.getLogger(__name__)

__all__ = ["SafetensorsCheckpoint"]

_T = TypeVar("_T")
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"  # transformers' names


def _natural(name: str) -> tuple:
    """A sort key ordering `experts.10` after `experts.9`."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _conversions(model: Any) -> tuple[list, list, Callable] | None:
    """transformers' (renamings, converters, rename_source_key) for `model`, where it is
    a transformers 5 model with any; else None ([Note: transformers' conversions])."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return (renamings, converters, rename_source_key) if transforms else None


def _targets(new: str, cv: Any) -> list[tuple[str, str | None]]:
    """The model's names a converter makes from a stored name that `rename_source_key`
    renamed to `new` (its first target), each with the operations' output to take:
    one (None: the only output) or, where one stored tensor is split (a fused qkv),
    one per target pattern, `new` with its target part replaced."""
    targets = list(cv.target_patterns)
    if len(targets) == 1 or len(cv.source_patterns) != 1:
        return [(new, None)]
    first = next((t for t in targets if t in new), None)
    if first is None:
        return [(new, None)]
    return [(new.replace(first, t, 1), t) for t in targets]


def _header(h: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of an open safetensors file."""
    out = {}
    for k in h.keys():
        sl = h.get_slice(k)
        out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _weight_map(index: Path) -> dict[str, Path]:
    """{tensor: shard file} of transformers' `model.safetensors.index.json`, each shard a
    path inside the index's directory. A value that is not a file name, or that points
    outside the directory (absolute, or through `..`, as transformers refuses it), is
    refused, naming the index, the tensor and the value, before any shard is opened."""
    try:
        weight_map = json_loads(read_regular_text(index))["weight_map"]
    except PermissionError:
        raise  # no damage: the error names the file and the permission
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint index {index} is not a transformers safetensors index "
                         f"(JSON with a \"weight_map\": {type(e).__name__}: {e}); fix or "
                         "remove it") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {index}: \"weight_map\" is not a mapping of "
                         "tensor names to shard files; fix or remove it")
    files = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not Path(shard).parts:  # 5, None, [...], "", "."
            raise ValueError(f"checkpoint index {index} puts {name!r} in {shard!r}, which is "
                             "not a shard file name: each \"weight_map\" value names a "
                             ".safetensors file beside the index (such as \"model-00001-of-"
                             "00002.safetensors\"); fix or remove the index")
        # as transformers checks it: by the name, not the resolved path (the Hub's cache
        # links each shard to a file elsewhere)
        if Path(shard).anchor or ".." in Path(shard).parts:
            raise ValueError(f"checkpoint index {index} puts {name!r} in {shard!r}, which is "
                             f"outside the checkpoint directory {index.parent} (transformers "
                             "refuses it too): shard names are relative to the index's "
                             "directory and stay in it; put the shards beside the index and "
                             "name them so, or remove the index")
        files[name] = index.parent / shard
    return files


def _checkpoint_files(p: Path) -> tuple[dict[str, Path] | None, list[Path]]:
    """The files checkpoint `p` is, as transformers' `from_pretrained` chooses them in a
    directory: its `model.safetensors` where it has one (the other safetensors files
    and index beside it are not read: a warning names them), else the shards its
    `model.safetensors.index.json` names (with that {tensor: shard} map), else (a
    directory from_pretrained refuses) every `*.safetensors` file in it, in name order.
    A path to a file: that file alone."""
    if p.is_file():
        return None, [p]
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    single, index = p / _SINGLE, p / _INDEX
    if single.is_file():
        unread = [_INDEX] if index.is_file() else []
        unread += sorted(f.name for f in p.glob("*.safetensors") if f != single)
        if unread:  # (an index's shards can be thousands: the first three named)
            more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
            log.warning("checkpoint %s: only %s is read, as transformers' from_pretrained "
                        "reads it, not %s%s beside it; remove what is not part of the "
                        "checkpoint", p, _SINGLE, ", ".join(unread[:3]), more)
        return None, [single]
    if index.is_file():
        files = _weight_map(index)
        return files, sorted(set(files.values()))
    shards = sorted(p.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"checkpoint directory {p} holds no .safetensors file (as "
                                f"from_pretrained reads it: {_SINGLE}, or {_INDEX} and its "
                                "shards)")
    return None, shards


class SafetensorsCheckpoint:
    """Name -> file index over one or more safetensors files; `get(name)` reads one tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as e:
            raise ImportError("reading a checkpoint needs safetensors: pip install "
                              "'offload[hf]'") from e
        self._open, self._error = safe_open, SafetensorError
        p = Path(path)
        self.directory = p if p.is_dir() else None
        files, shards = _checkpoint_files(p)
        index = p / _INDEX
        for f in shards:  # only an index names files that may not be there
            if f.is_file():
                continue
            name = next(k for k, v in (files or {}).items() if v == f)
            if f.exists():
                raise ValueError(f"checkpoint index {index} puts {name!r} in {f}, which is "
                                 "not a file: each \"weight_map\" value names a .safetensors "
                                 "file beside the index; fix or remove the index")
            raise FileNotFoundError(
                f"checkpoint index {index} puts {name!r} (and maybe more) in {f}, which "
                "does not exist: the download or copy is incomplete; fetch the missing "
                "shard, or remove the index to load the shards that are there")
        # every header up front (a few KiB each): a name the index puts in a shard that
        # lacks it, a name two files hold, a shape or dtype the model cannot take, are
        # refused before any group is read ([Note: weights a checkpoint lacks] in
        # __init__.py)
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        held: dict[str, Path] = {}
        for f in shards:
            for k, spec in self._read(f, _header).items():
                if k in held:  # one would replace the other, whichever is read last
                    raise ValueError(
                        f"checkpoint tensor {k!r} is in both {held[k]} and {f}: a "
                        "checkpoint holds each tensor once, so which to load is not "
                        "clear; remove the file that is not part of this checkpoint (or "
                        "save the checkpoint again)")
                self.specs[k] = spec
                held[k] = f
        for name, f in (files or {}).items():
            if held.get(name) != f:
                raise ValueError(
                    f"checkpoint index {index} puts {name!r} in {f}, which does not hold "
                    "it: the index does not match its shards; fix or remove the index "
                    "(without it every shard's tensors are loaded by their names)")
        self.files = files if files is not None else held
        self._resolved: dict[str, str | None] = {}
        self._stored = dict(self.files)  # every stored name: the file that holds it
        # a model's name made of stored ones: renamed (name), or converted (converter,
        # {source pattern: stored names in order}); [Note: transformers' conversions]
        self._made: dict[str, Any] = {}

    def adopt(self, model: Any) -> None:
        """Takes transformers' checkpoint conversions for `model` (transformers 5: its
        renamings and weight converters), so that names a checkpoint stores in
        another layout resolve to the model's.

        [Note: transformers' conversions]
        transformers 5 reads some models' checkpoints in another layout than its
        modules: Mixtral's experts stored one tensor each (`block_sparse_moe.experts.
        K.w1.weight`) become one stacked `mlp.experts.gate_up_proj`; GPT-NeoX's
        `embed_out` is `lm_head`. Its `save_pretrained` writes the stored layout back,
        so the files a user has are in it. `get_model_conversion_mapping` gives the
        renamings and converters; each stored name is renamed as `from_pretrained`
        renames it, and a converted parameter is made, when its group is read, by the
        converter's own operations on its stored tensors (one parameter's at a time;
        where one stored tensor is split into several parameters, a fused qkv, each
        takes its part of the operations' output: `_targets`).
        The stored names it consumes are then used, not "matched by nothing"."""
        conv = _conversions(model)
        if conv is None:
            return
        renamings, converters, rename = conv
        ours = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        ours |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
        tails = {".".join(n.split(".")[i:]) for n in ours for i in range(n.count(".") + 1)}
        def is_ours(name: str) -> bool:
            return name in tails or any(".".join(name.split(".")[i:]) in ours
                                        for i in range(name.count(".") + 1))
        made: dict[str, Any] = {}
        for key in list(self._stored):
            new, pattern = rename(key, renamings, converters)
            if new == key or new in self._stored or not is_ours(new):
                continue  # not renamed, or into a name the model does not have
            if pattern is None:
                made[new] = key
                continue
            cv = next(c for c in converters if pattern in c.source_patterns)
            for name, pick in _targets(new, cv):  # one stored tensor may make several
                if is_ours(name):  # (operations size a split's parts by its first name)
                    made.setdefault(name, (cv, {}, pick, new))[1].setdefault(
                        pattern, []).append(key)
        for new, how in made.items():
            if isinstance(how, str):  # renamed
                sources, self._made[new] = [how], how
                self.specs[new] = self.specs[how]
            else:  # converted: its stored tensors in their order (expert 2 before 10)
                for ks in how[1].values():
                    ks.sort(key=_natural)
                sources = [k for ks in how[1].values() for k in ks]
                self._made[new] = (*how, model)
                self.specs[new] = (self._shape_of(new), self.specs[sources[0]][1])
            for k in sources:
                self.files.pop(k, None)
            self.files[new] = self._stored[sources[0]]
        self._resolved.clear()

    def _shape_of(self, name: str) -> tuple[int, ...]:
        """The shape a conversion gives, from its stored tensors' shapes (on meta)."""
        try:
            return tuple(self._convert(name, meta=True).shape)
        except ValueError:  # one stored tensor made several (a fused qkv split): said there
            raise
        except Exception as e:  # noqa: BLE001 - an operation that needs the values
            raise ValueError(f"checkpoint: transformers' conversion of {name!r} cannot be "
                             f"followed without reading its tensors ({type(e).__name__}: "
                             f"{e}); load this model with transformers' from_pretrained and "
                             "pass it to initialize without checkpoint=") from e

    def _tensor(self, name: str) -> torch.Tensor:
        """The tensor the model's name `name` resolved to: stored, or made from stored
        ones ([Note: transformers' conversions])."""
        how = self._made.get(name)
        if how is None or isinstance(how, str):  # stored, under its name or renamed
            return self._stored_tensor(how or name)
        return self._convert(name)

    def _stored_tensor(self, key: str) -> torch.Tensor:
        return self._read(self._stored[key], lambda h: h.get_tensor(key))

    def _convert(self, name: str, meta: bool = False) -> torch.Tensor:
        cv, sources, pick, layer, model = self._made[name]
        tensors = {p: [torch.empty(self.specs[k][0], device="meta") if meta else
                       self._stored_tensor(k) for k in ks] for p, ks in sources.items()}
        for op in cv.operations:
            tensors = op.convert(tensors, source_patterns=cv.source_patterns,
                                 target_patterns=cv.target_patterns, full_layer_name=layer,
                                 model=model, config=getattr(model, "config", None),
                                 missing_keys=None)
        if pick is not None and pick in tensors:  # one of a split's parts
            return tensors[pick]
        if len(tensors) != 1:
            raise ValueError(f"checkpoint: transformers' conversion of {name!r} splits its "
                             f"stored tensors into {sorted(tensors)}, which checkpoint= does "
                             "not follow; load this model with transformers' from_pretrained "
                             "and pass it to initialize without checkpoint=")
        return next(iter(tensors.values()))

    def _read(self, f: Path, what: Callable[[Any], _T]) -> _T:
        """`what(handle)` of safetensors file `f`; a file that is not one is named."""
        try:
            with self._open(str(f), framework="pt") as h:
                return what(h)
        except self._error as e:
            raise ValueError(f"checkpoint {f} is not a valid safetensors file ({e}); pass "
                             "a .safetensors file, or a directory of them as transformers' "
                             "save_pretrained writes") from e

    def generation_config(self, model: Any) -> Any | None:
        """The directory's `generation_config.json` for a model that can generate (a
        transformers model's `can_generate()`), read as `from_pretrained` reads it; None
        where the checkpoint is a file, the directory has none, or the model cannot
        generate. A file transformers cannot read is refused, naming it."""
        f = self.directory / "generation_config.json" if self.directory else None
        can = getattr(model, "can_generate", None)
        if f is None or not f.is_file() or not callable(can) or not can():
            return None
        from transformers import GenerationConfig
        try:
            return GenerationConfig.from_pretrained(self.directory)
        except (OSError, ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"checkpoint {f} is not a generation config transformers can "
                             f"read ({e}); fix it, or remove it to keep the model's "
                             "own") from e

    def resolve(self, fqn: str) -> str | None:
        """The checkpoint's name for model parameter `fqn` (prefixes tolerated)."""
        if fqn in self.files:
            return fqn
        if fqn not in self._resolved:  # a scan of every name: once per model name
            self._resolved[fqn] = next((name for name in self.files if name.endswith(
                "." + fqn) or fqn.endswith("." + name)), None)
        return self._resolved[fqn]

    def check(self, fqn: str, names: list[str], shape: tuple[int, ...]) -> None:
        """Refuses, from the headers alone, a tensor stored for parameter `fqn` (under
        any of `names`) whose shape is not `shape` or whose dtype is not a float."""
        for name in filter(None, map(self.resolve, names)):
            got, dtype = self.specs[name]
            if tuple(got) != tuple(shape):
                raise ValueError(f"checkpoint tensor {name!r} ({self.files[name]}) for "
                                 f"{fqn} has shape {tuple(got)}, the model expects "
                                 f"{tuple(shape)}: give the checkpoint of this model "
                                 "(or of this configuration of it)")
            if dtype not in _FLOATS:
                raise ValueError(f"checkpoint tensor {name!r} ({self.files[name]}) for "
                                 f"{fqn} is {dtype}, not a floating-point dtype: give the "
                                 "checkpoint of this model")

    def find(self, fqns: list[str]) -> torch.Tensor | None:
        """The tensor stored under `fqns` (the names of tied uses; prefixes tolerated),
        or None where the checkpoint holds none of them. Stored under several of them
        with different values (an untied checkpoint for a tied model), the last name's
        is taken, as torch's `load_state_dict` takes it, with a warning."""
        names = list(dict.fromkeys(filter(None, map(self.resolve, fqns))))
        found = [self._tensor(n) for n in names]
        if len(found) > 1 and not all(torch.equal(t, found[-1]) for t in found):
            log.warning("checkpoint: %s hold different values for one tied parameter of the "
                        "model (untied in the checkpoint): %r's are loaded, as torch's "
                        "load_state_dict would; untie the model (Hugging Face: "
                        "tie_word_embeddings=False) to keep both", " and ".join(map(repr, names)),
                        names[-1])
        return found[-1] if found else None
