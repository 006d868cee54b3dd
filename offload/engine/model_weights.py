"""`ModelWeights`: the engine's model as torch and Hugging Face users handle one.

Parameters as registered stand-ins ([Note: registered parameters] in
params_view.py), full weights on request ([Note: full weights] in
full_weights.py), `state_dict` / `load_state_dict` as torch's, `generate`,
and `save_pretrained` streamed to safetensors shards ([Note: streamed
shards] in safetensors_writer.py). A mixin of `OffloadEngine`: it reads the
engine's groups, store, optimizer and collectives, and keeps no state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..config import format_bytes, parse_bytes
from ..io.process import available_memory, memory_limit_note
from .absent import AbsentWeight, closed_message
from .checkpoint_buffers import with_extra_state
from .full_weights import (groups_of, new_weights, read_group, refuse_apart, slot_tensors,
                           summoned)
from .interrupts import around_user_block, guarded
from .one_thread import one_call
from .params_view import state_entries
from .rank_order import tensors_crc32
from .safetensors_writer import TensorSpec, cast_finite, write_shards
from .units import EngineMark, not_compiled

log = logging.getLogger(__name__)

__all__ = ["ModelWeights"]

# The dtypes `save_pretrained(dtype=...)` writes, under torch's and the config's names:
# floating dtypes with a safetensors code (a cast to an integer dtype truncates the
# weights, nearly all to zero).
_EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp64": torch.float64}


def _export_dtype(dtype: Any) -> torch.dtype | None:
    """`save_pretrained`'s `dtype` as a torch dtype (None: each tensor's own)."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _EXPORT_DTYPES:
        return _EXPORT_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _EXPORT_DTYPES.values():
        return dtype
    raise ValueError(f"save_pretrained: dtype={dtype!r} cannot be written; pass None (each "
                     f"tensor's own dtype), one of {list(_EXPORT_DTYPES)} or "
                     f"{list(_EXPORT_DTYPES.values())}")


def _cast(stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """`save_pretrained`'s tensors in `dtype` (floating ones), each checked by
    `cast_finite`; a refusal leaves `stream` where it was, for the other ranks'
    all-gathers."""
    for name, t in stream:
        yield name, cast_finite(name, t, dtype) if dtype and t.is_floating_point() else t


def _shard_limit(max_shard_size: Any) -> int:
    """`save_pretrained`'s `max_shard_size` in bytes (an int or a string such as "5GB")."""
    limit = parse_bytes(max_shard_size, "save_pretrained: max_shard_size")
    if limit <= 0:
        raise ValueError(f"save_pretrained: max_shard_size={max_shard_size!r} is not a "
                         "positive size; pass bytes or a string such as '5GB'")
    return limit


def _with_old_versions(model: nn.Module, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """`state_dict` with what torch's modules add to a dict saved by an older version
    of them: a BatchNorm's `num_batches_tracked`, absent before its version 2 (and in
    a dict without `_metadata`), keeps the module's own, as torch's `load_state_dict`
    fills it in; the key is then neither missing nor loaded."""
    metadata = getattr(state_dict, "_metadata", None) or {}
    added = {}
    for prefix, module in model.named_modules(remove_duplicate=False):  # every name
        key = f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked"
        version = metadata.get(prefix, {}).get("version")
        if (isinstance(module, nn.modules.batchnorm._NormBase) and key not in state_dict
                and module.num_batches_tracked is not None and (version is None or version < 2)):
            added[key] = module.num_batches_tracked
    return {**state_dict, **added} if added else state_dict


def extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """{key: module} of the `_extra_state` entries torch's `load_state_dict` reads: one
    per name of each module whose class defines `set_extra_state`."""
    return {f"{name}._extra_state" if name else "_extra_state": m for name, m in
            with_extra_state(model, "set_extra_state", every_name=True).items()}


def _load_problem(state_dict: Mapping[str, Any], entries: list, expected: list[str],
                  missing: list[str], strict: bool) -> str | None:
    """Why `load_state_dict` refuses `state_dict` (None: it does not)."""
    known = set(expected)
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        return (f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                f"keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; pass "
                "strict=False to load the rest")
    for name, t, _ in entries:
        if name not in state_dict:
            continue
        value = state_dict[name]
        if not isinstance(value, torch.Tensor):
            return f"{name!r} is a {type(value).__name__}, not a tensor"
        if isinstance(value, AbsentWeight):
            return (f"{name!r} is a stand-in without values (the model's state_dict() taken "
                    "outside `with engine.full_weights():`): take the weights with "
                    "engine.state_dict()")
        if value.is_meta or value.layout != t.layout:
            kind = "meta" if value.is_meta else str(value.layout).removeprefix("torch.")
            return (f"{name!r} is a {kind} tensor: give a dense tensor with values (a model "
                    "built on the meta device has none until its weights are loaded)")
        if tuple(value.shape) != tuple(t.shape):
            return f"{name!r} has shape {tuple(value.shape)}, the model {tuple(t.shape)}"
    return None


def refuse_cast(fn: Any, dtype: torch.dtype, device: torch.device, name: str = "") -> None:
    """[Note: casts refused] `Module._apply(fn)` (what `.to`, `.half`, `.cpu` call) would
    convert the model's buffers and then fail at its first parameter, a stand-in with
    no weights: refused first, unless `fn` changes neither dtype nor device. The same
    holds for each of its modules, also where the model's own forward converts one
    (SwitchTransformers' router runs `self.classifier.to(float32)`): without the
    guard, that failed at the stand-in with "used outside the forward of unit".
    A function that makes new tensors of the same dtype and device (`to_empty`, as
    FSDP2's recipe calls after wrapping a meta model) is refused too: it would have
    replaced the buffers (BatchNorm's statistics by uninitialised memory) and then
    failed at the first stand-in in the same way."""
    probe = torch.zeros(1, dtype=dtype, device=device)
    out = fn(probe)
    what = f"module {name!r}" if name else "the model"
    if out is probe:
        return
    if isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == probe.device:
        raise RuntimeError(
            f"{what} is the engine's: a function that replaces its tensors (to_empty, "
            "Module._apply of one that makes new tensors) is refused, nothing was changed; "
            "initialize already made the weights of a meta model (by reset_parameters, "
            "seeded by engine.seed) and keeps them in its partitions; to set them, load "
            "them (engine.load_state_dict) or write them inside `with "
            "engine.full_weights(writable=True) as w:`")
    raise RuntimeError(
        f"the model's weights live in the engine's store as {dtype} on {device}: converting "
        f"{what} (.to, .half, .float, .cuda, .cpu, ...) to "
        f"{getattr(out, 'dtype', '?')} on {getattr(out, 'device', '?')} is refused, nothing "
        "was changed; set engine.dtype and store.device in the config instead (where the "
        "model's own forward converts a module to another dtype, train with engine.dtype "
        "of that dtype, or configure the model to compute in engine.dtype)")


def guard_casts(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Makes `.half()` / `.to(...)` on the wrapped model or any of its modules refuse
    first ([Note: casts refused]): an instance attribute in place of `Module._apply`."""
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod.__dict__.get("_apply"), EngineMark):  # under two names: once
            continue
        plain = mod._apply

        def _apply(fn: Any, recurse: bool = True, plain: Any = plain, name: str = name) -> Any:
            refuse_cast(fn, dtype, device, name)
            return plain(fn, recurse)
        mod.__dict__["_apply"] = EngineMark(_apply, mod, "_apply")


def guard_resize(model: nn.Module) -> None:
    """transformers' `resize_token_embeddings` on the wrapped model refuses before it
    changes anything: it would set `config.vocab_size` and the embedding's
    `num_embeddings` first and fail at the weights (fixed in shape at `initialize`),
    leaving a model whose config no longer matches its weights."""
    if not callable(getattr(type(model), "resize_token_embeddings", None)):
        return

    def resize_token_embeddings(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "resize_token_embeddings after offload.initialize is refused, nothing was "
            "changed: the parameters' shapes are fixed at initialize (their partitions, "
            "optimizer state and swap files are laid out for them); resize the model "
            "before offload.initialize, or load engine.state_dict() into a fresh model, "
            "resize that and initialize again")
    model.__dict__["resize_token_embeddings"] = EngineMark(
        resize_token_embeddings, model, "resize_token_embeddings")


def guard_tp_generate(model: nn.Module) -> None:
    """Under tensor parallelism the cut blocks keep no KV cache: transformers' `generate`
    with its cache on, in training mode (which it keeps), ran every step after the
    first without the past tokens, and gave other tokens than torch's, silently. It
    is refused unless the cache is off (`use_cache=False`), which generates as torch."""
    if not callable(getattr(type(model), "generate", None)):
        return
    plain = type(model).generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False:
            raise ValueError("generate with tp.size > 1 needs use_cache=False: the blocks "
                             "cut over the ranks keep no KV cache (nothing was generated)")
        return plain(model, *args, **kwargs)
    model.__dict__["generate"] = EngineMark(generate, model, "generate")


def guard_tie(model: nn.Module) -> None:
    """transformers' `tie_weights` on a wrapped module that would tie anything anew (an
    untied model whose `config.tie_word_embeddings` was set after `initialize`) is
    undone and refused: it put the embedding's stand-in in the head's place, the
    engine then refused every forward, state_dict and export, and the head's own
    parameter, which the engine still trained, was out of the user's reach. A call
    that ties nothing new (an already tied model) goes through."""
    _guard_method(model, "tie_weights", _tie_guarded)


def _guard_method(model: nn.Module, name: str, guarded: Callable) -> None:
    """Every module of `model` whose class has the method `name` calls
    `guarded(module, plain, *args, **kwargs)` for it instead, `plain` its class's (a
    copy made in a full_weights block gets the class's: `EngineMark`)."""
    for module in model.modules():
        plain = getattr(type(module), name, None)
        if callable(plain):
            module.__dict__[name] = EngineMark(functools.partial(guarded, module, plain),
                                               module, name)


def _tie_guarded(module: nn.Module, plain: Callable, *args: Any, **kwargs: Any) -> Any:
    before = [(m, dict(m._parameters)) for m in module.modules()]
    try:
        out = plain(module, *args, **kwargs)
    except BaseException:  # half way (a head's bias read outside its unit): as it was
        _put_back(before)
        raise
    moved = [(m, name) for m, params in before for name, p in params.items()
             if m._parameters.get(name) is not p]
    if not moved:
        return out
    _put_back(before)
    names = {id(m): n for n, m in module.named_modules()}
    m, name = moved[0]
    raise RuntimeError(
        f"tie_weights after offload.initialize would tie "
        f"{'.'.join(filter(None, (names.get(id(m), '?'), name)))!r} anew; refused, the "
        "parameters are as they were: the engine keeps untied weights as partitions of "
        "their own. Tie before offload.initialize (set config.tie_word_embeddings and "
        "call model.tie_weights()), or load engine.state_dict() into a tied model and "
        "initialize that")


def guard_save_pretrained(model: nn.Module) -> None:
    """transformers' (or peft's) `save_pretrained` on the wrapped model or one of its
    modules refuses, before it writes anything, where any of the module's parameters
    is a stand-in (outside a `full_weights` block that holds all of them): it wrote
    config.json and generation_config.json, then failed at the first weight, leaving
    a directory without weights. Inside such a block it saves as on a plain model."""
    _guard_method(model, "save_pretrained", _save_guarded)


def _save_guarded(module: nn.Module, plain: Callable, *args: Any, **kwargs: Any) -> Any:
    # given a state_dict (transformers' Trainer, engine.state_dict()), it reads no weight
    # of the modules; peft's reads its adapters alone (the trainable weights), which a
    # block may hold without the base model's
    params = [] if kwargs.get("state_dict") is not None else \
        [p for p in module.parameters() if p.requires_grad or not is_peft(module)]
    absent = next((p for p in params if isinstance(p, AbsentWeight)), None)
    if absent is None:
        return plain(module, *args, **kwargs)
    if absent.message == closed_message(absent.param_name):
        raise RuntimeError(f"save_pretrained: {absent.message}; nothing was written")
    raise RuntimeError(
        f"{type(module).__name__}.save_pretrained(dir) outside a `with engine.full_weights():` "
        "block that holds all its weights is refused, nothing was written: its parameters "
        f"(e.g. {absent.param_name!r}) are stand-ins without weights, which the engine "
        "holds. " + ("Save the adapters with `with engine.full_weights(): "
                     "model.save_pretrained(dir)` (peft's own)" if is_peft(module) else
                     "Save the model with engine.save_pretrained(dir) (streamed group by "
                     "group), or `with engine.full_weights(): model.save_pretrained(dir)` "
                     "(every weight in host memory at once)"))


def _refuse_adapters(model: nn.Module) -> None:
    """A peft model's Hugging Face layout is its adapters (peft's `save_pretrained`),
    not the wrapper's names beside the base model's config.json: `from_pretrained` of
    what the export wrote loaded without a word, every weight initialised anew."""
    if is_peft(model):
        raise ValueError(
            f"save_pretrained: the model is a peft {type(model).__name__}, whose saved form "
            "is its adapters: save them with `with engine.full_weights(): "
            "model.save_pretrained(dir)` (peft's own), or the whole model with "
            "engine.state_dict() loaded into a plain copy (nothing was written)")


def is_peft(model: Any) -> bool:
    """A peft model (a PeftModel around a transformers model)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def _put_back(before: list[tuple[nn.Module, dict]]) -> None:
    for m, params in before:
        m._parameters.clear()
        m._parameters.update(params)


class ModelWeights:
    """Parameters, full weights, state dicts, generation and export of the engine's model."""

    # -- parameters ---------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under the model's own names (no `module.` prefix):
        one registered stand-in per original parameter, full shape, compute dtype,
        its `requires_grad` ([Note: registered parameters] in params_view.py)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    # the rest of the model's listings and lookups use its names too, as state_dict()
    # does: a weight-decay rule built from named_modules() must match named_parameters()
    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:  # get_parameter, get_buffer too
        return self.module.get_submodule(target)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # type: ignore[override]
        """`engine.to(...)`, `.half()`, `.float()`, `.cpu()`...: a no-op where `fn` keeps
        the engine's dtype and device (tried on a probe tensor first); else refused
        before anything changes, as the weights live in the store in `engine.dtype`
        on `store.device`. [Note: casts refused]"""
        refuse_cast(fn, self.dtype, self.device)
        return self

    @not_compiled  # [Note: torch.compile] in units.py
    def _check_open(self) -> None:
        """Raises a clear error where a closed engine is used: its state is gone, or one a
        second Ctrl-C interrupted inside its own code ([Note: Ctrl-C at a safe point]),
        or one in a forked child ([Note: an engine in a forked child])."""
        # [Note: an engine in a forked child]
        # A forked child (a DataLoader worker, multiprocessing, os.fork()) gets a copy
        # of the engine without the threads that complete its transfers and gathers:
        # a forward there hung for good, and its swap files and locks are the
        # parent's. So every call in a child raises, and close() there only marks the
        # child's copy closed, leaving the parent's files, threads and memory alone.
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this OffloadEngine belongs to process {self._pid}, and this is a forked "
                f"child of it (pid {os.getpid()}): the engine's I/O threads and swap files "
                "are the parent's, and a child cannot use them; train in the parent, and "
                "keep workers (DataLoader workers, multiprocessing) to data loading, or "
                "initialize a new engine in the child with its own io.paths")
        if self._broken is not None and not self._closed:
            raise RuntimeError(self._broken)
        if self._closed:
            raise RuntimeError(
                "this OffloadEngine is closed (close() ran, or its `with` block ended): its "
                "partitions, optimizer state and swap files are gone; save what you need "
                "(state_dict(), save_pretrained(), save_checkpoint()) before closing, and "
                "resume a new engine from a checkpoint")

    def _check_between_steps(self, what: str) -> None:
        """Refuses `what`, a change of committed state, inside a step; else waits for a
        save in the background to have read it ([Note: saving in the background] in
        training_checkpoint.py)."""
        self._check_no_forward(what)
        if self._backwards or self._early or len(self.staged):
            raise RuntimeError(f"{what}: a step is in progress ({self._backwards} backward "
                               "call(s) since the last step); call engine.step() or "
                               "engine.zero_grad() first")
        self.wait_for_checkpoint(raise_error=False)

    def _wait_for_save(self) -> None:
        """Before the optimizer's `load_state_dict`: a save in the background reads its
        state as of the save's call ([Note: saving in the background])."""
        self.wait_for_checkpoint(raise_error=False)

    def _check_no_forward(self, what: str) -> None:
        running = [st.group.gid for st in self._states if st.active]
        if running:
            raise RuntimeError(f"{what}: called inside a forward (groups {running[:8]} are in "
                               "use); call it between forward passes")

    # -- full weights -------------------------------------------------------------
    @contextlib.contextmanager
    def full_weights(self, modules: Iterable[nn.Module | str] | nn.Module | str | None = None,
                     *, writable: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """`with engine.full_weights(): ...` registers the full weights of `modules`
        (modules or their names; None: the whole model) as the modules' parameters
        for the block, in each parameter's original dtype, and yields {name:
        parameter}. Read-only unless `writable`: then what the parameters hold when
        the block ends (in-place edits, or a new `nn.Parameter` of the same shape)
        is written to the fp32 master and to the parameter partition in every
        tier; a block that raises writes nothing. Between steps; every rank calls
        it (the weights are all-gathered). The selected weights must fit in
        `store.host_budget`; for more, select fewer modules per block or stream
        with `named_weights()`. Forward passes inside the block use the weights as
        they were when it began."""
        self._check_open()
        # the whole block: [Note: one thread at a time] in one_thread.py
        with self._one_thread.held("engine.full_weights()", outer=writable):
            with self._interrupts.held():  # [Note: Ctrl-C at a safe point] in interrupts.py
                groups = self._summonable(modules, writable, "full_weights")
            need = sum(g.padded * 4 for g in groups)
            if need > self.cfg.store.host_budget:
                raise ValueError(f"full_weights: the selected weights take {need} bytes in "
                                 f"fp32, more than store.host_budget "
                                 f"({self.cfg.store.host_budget}); pass fewer modules (e.g. one "
                                 "layer per block), or go group by group with "
                                 "engine.full_weights_by_group()")
            with around_user_block(self._interrupts, summoned(self, groups, writable)) as named:
                yield named

    def full_weights_by_group(self, modules: Iterable[nn.Module | str] | nn.Module | str
                              | None = None, *, writable: bool = False
                              ) -> Iterator[dict[str, torch.Tensor]]:
        """`full_weights` one group at a time, for models whose weights do not fit in
        memory at once: `for w in engine.full_weights_by_group(writable=True): ...`
        yields {name: parameter} of each group's parameters, registered in their
        modules until the next iteration, which writes them back (`writable`)
        first. Leaving the loop early (break, an error) discards the current
        group's edits; groups done before it stay written."""
        self._check_open()
        what = "engine.full_weights_by_group()"  # [Note: one thread at a time]: each group
        with self._one_thread.held(what, outer=writable), self._interrupts.held():
            groups = self._summonable(modules, writable, "full_weights_by_group")
        for g in groups:
            with self._one_thread.held(what, outer=writable), \
                    around_user_block(self._interrupts, summoned(self, [g], writable)) as named:
                yield named

    def __getattr__(self, name: str) -> Any:
        """A public attribute the engine does not have is the wrapped model's, as
        DeepSpeed's and FSDP's wrappers give it: `engine.config`, `generation_config`,
        `can_generate()`, `main_input_name` of a Hugging Face model."""
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, modules
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("module")
            if model is None or name.startswith("_"):
                raise
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, "
                                 f"nor has the model it wraps ({type(model).__name__})"
                                 ) from None

    def _summonable(self, modules: Any, writable: bool, what: str) -> list:
        if self.registered.summoned_weights:  # [Note: calls inside a full_weights block]
            raise RuntimeError(
                f"engine.{what}(): called inside a full_weights block (or an iteration "
                "of full_weights_by_group), whose full weights stand in the modules "
                "until it ends; select every module you need in the outer block (its "
                "dict holds them all by name), or call this after the block")
        groups = groups_of(self, modules)
        if writable:
            self._check_between_steps(f"{what}(writable=True)")
        self._check_no_forward(what)
        self._release_gathered()
        return groups

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Streams (name, full tensor in its original dtype) group by group: one group's
        weights are in memory at a time; a tied parameter (or one of a module
        registered under several names) appears under each name. Every rank takes
        part (the shards are all-gathered)."""
        self._check_open()
        names = self._slot_names()
        for g in self.groups:  # the caller's loop body runs between groups
            with self._one_thread.held("engine.named_weights()"), self._interrupts.held():
                tensors = slot_tensors(self, g, read_group(self, g))
            for i, t in enumerate(tensors):
                for name in names[(g.gid, i)]:
                    yield name, t

    def _slot_names(self) -> dict[tuple[int, int], list[str]]:
        """Every name of each parameter, (gid, slot) -> names, in torch's `state_dict`
        order (tied parameters and modules registered under several names)."""
        names: dict[tuple[int, int], list[str]] = {}
        for name, t, is_param in state_entries(self.module):
            # an open block's full weights too: [Note: calls inside a full_weights block]
            where = self.registered.locate(t, summoned=True) if is_param else None
            if where is not None:
                names.setdefault(where, []).append(name)
        for g in self.groups:
            for i, slot in enumerate(g.slots):
                if (g.gid, i) not in names and g.gid in self.registered.summoned_weights:
                    mod, attr = slot.uses[0]  # a new Parameter a writable block took: it
                    new = mod._parameters.get(attr)  # writes it back at its end, as an edit
                    if new is not None and tuple(new.shape) != tuple(slot.shape):
                        raise ValueError(
                            f"parameter {slot.fqn!r} now has shape {tuple(new.shape)}, the "
                            f"engine holds {tuple(slot.shape)}; the shape of a parameter "
                            "cannot change (nothing was written)")
                    names[(g.gid, i)] = list(slot.names)
                    continue
                if (g.gid, i) not in names:
                    raise RuntimeError(
                        f"parameter {slot.fqn!r} was replaced after initialize (a new "
                        "nn.Parameter assigned to its module): the set of parameters is "
                        "fixed at initialize and training did not see the new one; assign "
                        "the original back, and change values inside `with "
                        "engine.full_weights(writable=True)`")
        return names

    # -- state dicts --------------------------------------------------------------
    @one_call("engine.state_dict()")  # [Note: one thread at a time] in one_thread.py
    @guarded  # [Note: Ctrl-C at a safe point] in interrupts.py
    def state_dict(self, *args: Any, destination: Any = None,  # type: ignore[override]
                   prefix: str = "", keep_vars: bool = False,
                   rank0_only: bool = True) -> dict[str, Any]:
        """The model's full state as torch's `state_dict()` holds it: every parameter
        (in its original dtype, from the fp32 masters) and persistent buffer, under
        every name it is registered under, each module's extra state
        (`get_extra_state`), after its state-dict hooks, `prefix` before each key, in
        `destination` where given (torch's arguments, positional ones too; weights are
        copies whatever `keep_vars`). Gathered group by group; with
        `rank0_only` (default) only rank 0 keeps the weights, the other ranks
        return an empty dict; without, every rank gets the same dict, rank 0's
        buffers in it (each rank updates its own, as under DDP). Every rank calls
        it. The result is the whole model in host memory, outside the budgets:
        where that is more than the memory available on a rank that keeps it, every
        rank raises `MemoryError` first; `named_weights()` and `save_pretrained()`
        stream instead."""
        self._check_open()
        self._slot_names()  # a parameter replaced after initialize is named, not returned
        if args:  # torch's deprecated positional (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)
                                              [len(args):])[:3]
        keep = not rank0_only or self.comm.rank == 0
        # torch's own walk, over the stand-ins: its keys, extra states and hooks
        layout = nn.Module.state_dict(self.module, prefix=prefix, keep_vars=True)
        self._check_state_dict_fits(keep)
        values: dict[tuple[int, int], torch.Tensor] = {}
        for g in self.groups:
            full = read_group(self, g)  # a fresh buffer: its views are the values
            if keep:
                for i, t in enumerate(slot_tensors(self, g, full)):
                    values[(g.gid, i)] = t
            del full
        if not keep:
            return {} if destination is None else destination
        out = OrderedDict() if destination is None else destination
        if destination is None or hasattr(destination, "_metadata"):
            out._metadata = getattr(out, "_metadata", OrderedDict())
            out._metadata.update(layout._metadata)
        for name, t in layout.items():
            where = self.registered.locate(t) if isinstance(t, torch.Tensor) else None
            if where is not None:
                out[name] = values[where]
            else:  # a buffer, an extra state, a hook's entry
                if isinstance(t, torch.Tensor) and not rank0_only and self.comm.world > 1:
                    # every rank's dict the same: rank 0's buffers, as a checkpoint and
                    # save_pretrained hold them (each rank updates its own statistics)
                    got = self.comm.first_rank_value(t)
                    t = t if got is None else got
                out[name] = t.detach() if isinstance(t, torch.Tensor) and not keep_vars else t
        return out

    def _check_state_dict_fits(self, keep: bool) -> None:
        """Refuses a `state_dict` whose weights (all of them, outside the budgets) are more
        than the memory available on a rank that keeps them, on every rank, before any
        all-gather: a `MemoryError` naming the streaming calls, where gathering on
        would end with the OOM killer."""
        need, free = 0, None
        if keep:
            for g in self.groups:
                dtypes = self.registered.dtypes[g.gid]
                if torch.float32 in dtypes:  # its values are views of the padded fp32 buffer
                    need += g.padded * 4
                else:  # copies in their own dtype
                    need += sum(s.numel * d.itemsize for s, d in zip(g.slots, dtypes))
            need += max((g.padded * 4 for g in self.groups), default=0)  # the one being read
            free = available_memory()
        short = free is not None and need > free
        if self.groups:  # every rank is here, not one under `if rank == 0` (whose sum
            # would pair with another's forward): [Note: ranks run the same units]
            self._rank_order.check_read(self.groups[0].gid)
        (refused,) = self.comm.sum_scalars([1.0 if short else 0.0])
        if short:
            raise MemoryError(
                f"state_dict: the model's weights take {format_bytes(need)} in memory at "
                f"once, more than the {format_bytes(free)} available here"
                f"{memory_limit_note()} (nothing was gathered); stream them instead: "
                "engine.named_weights() yields one group's weights at a time, "
                "engine.save_pretrained(dir) writes safetensors shards")
        if refused:
            raise MemoryError("state_dict: another rank has less memory available than the "
                              "model's weights take (nothing was gathered); stream them with "
                              "engine.named_weights() or engine.save_pretrained(dir)")

    @one_call("engine.load_state_dict()", outer=True, sealed=True)  # [Note: one thread at a time]
    @guarded  # [Note: Ctrl-C at a safe point] in interrupts.py
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:  # type: ignore[override]
        """Loads what `state_dict()` (or torch's, of the plain model) returns: weights into the
        fp32 masters and the parameter partitions in every tier, buffers into the
        modules. Keys, shapes and values are checked first (strict: missing or
        unexpected keys raise, as torch's; a value that is not a dense tensor with
        values, a meta tensor say, raises too, naming its key); a tied parameter
        takes the value under its last name present, as torch's (it copies each name
        in turn). Between steps; every rank
        calls it with the full weights (a rank whose dict is refused makes every rank
        raise, before any collective). Returns torch's (missing_keys, unexpected_keys);
        `assign` is accepted for torch's signature."""
        self._check_open()
        try:  # raised after the ranks' check, which every rank must reach
            self._check_between_steps("load_state_dict")
            inside = None
        except RuntimeError as e:
            inside = e
        entries = list(state_entries(self.module))
        extras = extra_states(self.module)
        state_dict = _with_old_versions(self.module, state_dict)
        expected = [n for n, _, _ in entries] + list(extras)
        missing = [n for n in expected if n not in state_dict]
        problem = _load_problem(state_dict, entries, expected, missing, strict)
        if self.groups:  # every rank is here: [Note: ranks run the same units]
            self._rank_order.check_read(self.groups[0].gid)
        fails = problem is not None or inside is not None
        # every rank's dict the same: each writes its own slices from its own dict, so
        # two dicts made a model of both (a head initialised without a seed on each rank)
        prints = self.comm.every_rank(float(fails), 0.0 if fails or self.comm.world == 1 else
                                      tensors_crc32({k: state_dict[k] for k in expected
                                                        if k in state_dict}, None))
        refused, prints = sum(prints[:self.comm.world]), prints[self.comm.world:]
        if inside is not None:
            raise inside
        if problem:
            raise RuntimeError(f"load_state_dict: {problem} (nothing was loaded)")
        if refused:
            raise RuntimeError("load_state_dict: another rank refused its state dict (nothing "
                               "was loaded); give every rank the full state dict")
        refuse_apart(prints, "load_state_dict: rank {} was given other values than rank 0",
                     "loaded", "dict", "Give every rank the same state dict: load it from one "
                     "file, or seed what each rank initialises, or send rank 0's "
                     "(torch.distributed.broadcast_object_list)")
        known = set(expected)
        unexpected = [k for k in state_dict if k not in known]
        loaded: dict[tuple[int, int], torch.Tensor] = {}
        held = []  # buffers (or parameters the engine does not hold): after the weights
        for name, t, is_param in entries:
            where = self.registered.locate(t) if is_param else None
            if name not in state_dict:
                continue
            if where is not None:  # a later name of a tied parameter wins, as in torch
                loaded[where] = state_dict[name]
            else:
                held.append((t, state_dict[name]))
        self._release_gathered()
        # [Note: new weights all or nothing] in full_weights.py
        with new_weights(self, "load_state_dict") as w:
            for g in self.groups:  # with several ranks every group: collectives pair up
                if self.comm.world == 1 and not any((g.gid, i) in loaded
                                                    for i in range(len(g.slots))):
                    continue
                full = read_group(self, g)
                for i, slot in enumerate(g.slots):
                    if (g.gid, i) in loaded:
                        full[slot.offset:slot.offset + slot.numel].copy_(
                            loaded[(g.gid, i)].detach().reshape(-1))
                w.add(g, full)
        with torch.no_grad():  # memory copies of checked values: nothing fails here
            for t, value in held:
                t.copy_(value)
        for name, module in extras.items():
            if name in state_dict:
                module.set_extra_state(state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    # -- generation and export ----------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's `generate` (Hugging Face), its weights streamed from their
        tiers unit by unit; run under `torch.no_grad()` it leaves the training plan
        alone.

        [Note: generation on several ranks] Every rank gathers each unit's weights
        together, so a rank whose sequences end first must go on running forwards
        until all have ended: transformers' `synced_gpus`, which it turns on by
        itself for models it knows are sharded (ZeRO-3, FSDP). On several ranks it
        is on here unless the call says otherwise, and `initialize` marks the model
        as sharded (`_is_fsdp_managed_module`) for `model.generate` called directly."""
        self._check_open()
        # [Note: one thread at a time] in one_thread.py, [Note: Ctrl-C at a safe point]
        with self._one_thread.held("engine.generate()"), self._interrupts.held():
            if self.comm.world > 1:  # [Note: generation on several ranks]
                kwargs.setdefault("synced_gpus", True)
            try:
                out = self.module.generate(*args, **kwargs)
            except BaseException:
                self._release_gathered(orphan=True)  # [Note: orphaned gathers] in engine.py
                raise
            self._release_gathered()
        return out

    @one_call("engine.save_pretrained()")  # [Note: one thread at a time] in one_thread.py
    @guarded  # [Note: Ctrl-C at a safe point] in interrupts.py
    def save_pretrained(self, save_directory: str | os.PathLike,
                        max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | str | None = None) -> list[Path]:
        """Writes the model as Hugging Face does: safetensors shards with an index (every
        parameter under its first name, tied ones once; persistent buffers), in each
        parameter's original dtype (or `dtype`: torch.float32, bfloat16, float16 or
        float64, or "fp32", "bf16", "fp16" as the config names them), in shards of at most
        `max_shard_size` bytes (an int, or a string such as "5GB"), plus `config.json` and
        `generation_config.json` when the model has them, so
        `AutoModel*.from_pretrained(save_directory)` loads it. Streamed: one group's
        full weights and one tensor beyond the budgets are in memory at a time.
        Every rank calls it; rank 0 writes, and on a failure there (a directory
        that holds shards, a full disk) every rank still takes part in every
        all-gather before rank 0 raises. Bad arguments raise `ValueError` on every
        rank before anything is created; a `dtype` that would make a finite value inf
        raises `ValueError` on rank 0, naming the tensor, nothing written. Returns the
        files written."""
        self._check_open()
        _refuse_adapters(self.module)
        limit = _shard_limit(max_shard_size)
        dtype = _export_dtype(dtype)
        specs, order = self._export_specs(dtype)
        out = Path(save_directory)
        stream = self._export_stream(order, dtype)
        if (self.comm.rank if self.tp is None else self.tp.mesh.world.rank) != 0:
            for _ in stream:
                pass  # the all-gathers pair up with rank 0's
            return []
        with tempfile.TemporaryDirectory(prefix="offload-config-") as staged:
            copies = self._save_configs(Path(staged), dtype)  # written with the shards
            try:
                return write_shards(out, specs, _cast(stream, dtype), limit, copies=copies)
            except BaseException as e:
                if self.comm.world > 1:
                    for _ in stream:  # what the failed write left: its all-gathers
                        pass
                if isinstance(e, OverflowError):  # `cast_finite`'s refusal
                    raise ValueError(f"save_pretrained: dtype={dtype}: {e}; give dtype "
                                     "torch.bfloat16 or torch.float32 (nothing was written)"
                                     ) from None
                raise

    def _export_specs(self, dtype: torch.dtype | None) -> tuple[list[TensorSpec], list]:
        """What is written, in the order it is produced: parameters group by group, then
        the buffers."""
        specs, order = [], []
        names = self._slot_names()
        for g in self.groups:
            for i, (slot, orig) in enumerate(zip(g.slots, self.registered.dtypes[g.gid])):
                name = names[(g.gid, i)][0]
                shape = tuple(slot.shape) if self.tp is None else self.tp.full_shape(
                    name, tuple(slot.shape))  # tensor parallelism: the whole weight
                specs.append(TensorSpec(name, shape, dtype or orig))
        seen: set[int] = set()
        held = {n for ns in names.values() for n in ns}
        for name, t, is_param in state_entries(self.module):
            # an open block's full weights are the groups' too ([Note: calls inside a
            # full_weights block]): written twice, the file's offsets did not hold
            if is_param and name in held or id(t) in seen:
                continue
            seen.add(id(t))
            order.append((name, t))
            specs.append(TensorSpec(name, tuple(t.shape), dtype if dtype and
                                    t.is_floating_point() else t.dtype))
        return specs, order

    def _export_stream(self, order: list, dtype: torch.dtype | None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        names = self._slot_names()
        # an open block's full weights (a new Parameter it took included), its edits
        # included, as state_dict gives them: what the module holds that is no stand-in
        live = {name: t.detach() for name, t, is_param in state_entries(self.module)
                if is_param and self.registered.locate(t) is None} \
            if self.registered.summoned_weights else {}
        for g in self.groups:
            full = read_group(self, g)
            for i, t in enumerate(slot_tensors(self, g, full)):
                name = names[(g.gid, i)][0]
                if name in live:
                    t = live[name].to(t.dtype).reshape(t.shape)
                if self.tp is not None:  # every TP rank's slice, put together
                    t = self.tp.full(name, t, self.device)
                yield name, t
            del full
        yield from order

    def _save_configs(self, into: Path, dtype: torch.dtype | None) -> dict[str, Path]:
        """The model's `config.json` and `generation_config.json` (Hugging Face), written
        into `into`: {name: file}."""
        files = {}
        config = getattr(self.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            dtypes = {d for row in self.registered.dtypes for d in row}
            if dtype is not None or len(dtypes) == 1:  # the files' dtype, on a copy: the
                config = copy.deepcopy(config)  # live model's config stays as it was
                config.dtype = dtype or dtypes.pop()
            config.save_pretrained(into)
            files["config.json"] = into / "config.json"
        gen = getattr(self.module, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(into)
            files["generation_config.json"] = into / "generation_config.json"
        return files
