"""Domino slicing: tensor-parallel transformer blocks whose all-reduces run behind
compute.

[Note: Domino schedule]
A tensor-parallel block needs its row-parallel outputs summed over the TP
ranks twice per forward (after attention, after the MLP), and nothing after
each sum can start before it lands. Cutting the batch into `pieces`
independent pieces (rows of the batch never mix inside a block) gives the
ranks something to compute meanwhile:

    attention(0) -> start reduce a0
    attention(1) -> start reduce a1      # a0 runs behind attention(1)
    finish a0; mlp(0) -> start reduce m0 # a1 runs behind mlp(0)
    finish a1; mlp(1) -> start reduce m1 # m0 runs behind mlp(1)
    finish m0, m1; concatenate

In backward each column-parallel layer all-reduces its input gradient
while it computes its weight gradient ([Note: which gradients are reduced
over TP] in tensor_parallel.py); autograd runs the pieces' graphs one after
the other, so that all-reduce also runs behind the weight gradients of the
layer. Every rank issues the same collectives in the same order (the schedule
is fixed; backward's order is autograd's, the same graph on every rank).
`pieces = 1` is plain tensor parallelism: each sum is waited for as soon as it
is issued.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..trace import NULL_RECORDER, TraceRecorder
from .blocks import BlockKind, kind_of
from .collectives import Collectives
from .tensor_parallel import ColumnParallel, RowParallel, ShardSpec, check_cut

__all__ = ["DominoBlock", "TensorParallelPlan", "parallelize", "tp_blocks"]

log = logging.getLogger(__name__)


def _split(value: Any, batch: int, pieces: int) -> list[Any]:
    """`value` for each piece: tensors (in tuples, lists, dicts) whose first dimension is
    the batch are cut along it; anything else (masks broadcast over the batch,
    flags) is the same for every piece."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return list(value.chunk(pieces))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, batch, pieces) for v in value]
        return [type(value)(p[k] for p in parts) for k in range(pieces)]
    if isinstance(value, dict):
        parts = {k: _split(v, batch, pieces) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(pieces)]
    return [value] * pieces


class DominoBlock(nn.Module):
    """A tensor-parallel transformer block run in `pieces` pieces ([Note: Domino
    schedule]). It takes the block's children as its own (parameter names do not
    change) and its call signature; the first argument is the hidden states."""

    def __init__(self, block: nn.Module, kind: BlockKind, pieces: int, dropouts: list[float],
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        super().__init__()
        self.check(block)
        for name, child in block.named_children():
            self.add_module(name, child)
        # transformers' gradient_checkpointing_enable() sets these on every module that has
        # `gradient_checkpointing`, as it set them on the block this one replaces
        self.gradient_checkpointing = bool(getattr(block, "gradient_checkpointing", False))
        func = getattr(block, "_gradient_checkpointing_func", None)
        if func is not None:
            self._gradient_checkpointing_func = func
        self.kind = kind
        self.pieces = pieces
        self.dropouts = dropouts
        self.recorder = recorder
        self.signature = inspect.signature(block.forward)
        self.block_type = type(block).__name__

    @staticmethod
    def check(block: nn.Module) -> None:
        if any(p is not None for p in block._parameters.values()):
            raise ValueError(f"{type(block).__name__} has parameters of its own: not a block "
                             "tensor parallelism knows")

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
        bound = self.signature.bind(*args, **kwargs).arguments
        names = list(bound)
        x = bound.pop(names[0])
        rest: dict[str, Any] = {}
        for name, value in bound.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                rest.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                rest[name] = value
        for key in ("cache", "past_key_values"):
            if rest.get(key) is None:
                continue
            if not self.training:  # generation would read a cache this block never fills
                raise ValueError(f"{self.block_type}: a KV cache with tp.size > 1 is not "
                                 "supported (call the model with use_cache=False)")
            rest[key] = None  # a training forward's cache (transformers' default) stays empty
        return x, rest

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The block's forward, recomputed in backward where activation checkpointing is on
        (transformers' `gradient_checkpointing_enable()`): every TP rank recomputes the
        same blocks in the same order, so the recomputation's all-reduces pair up."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            func = getattr(self, "_gradient_checkpointing_func", None) or functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False)
            return func(functools.partial(self._pieces, **kwargs), *args)
        return self._pieces(*args, **kwargs)

    def _pieces(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, rest = self._arguments(args, kwargs)
        kind, rec = self.kind, self.recorder
        batch = x.shape[0]
        pieces = self.pieces if batch % self.pieces == 0 else 1
        xs = list(x.chunk(pieces))
        kws = _split(rest, batch, pieces)
        norm1, norm2 = (self.get_submodule(n) for n in kind.norms)
        row_attn, row_mlp = (self.get_submodule(p) for p in kind.rows)
        attn = []
        for k in range(pieces):
            with rec.span(f"domino:attention {k}", cat="compute", track="compute"):
                partial = kind.attention(self, norm1(xs[k]), kws[k])
            attn.append((partial, row_attn.start(partial)))
        hs, mlp = [], []
        for k in range(pieces):
            out = self._dropout(row_attn.finish(*attn[k]), 0)
            hs.append(xs[k] + out)
            with rec.span(f"domino:mlp {k}", cat="compute", track="compute"):
                partial = kind.mlp(self, norm2(hs[k]))
            mlp.append((partial, row_mlp.start(partial)))
        outs = [h + self._dropout(row_mlp.finish(*m), 1) for h, m in zip(hs, mlp)]
        return outs[0] if pieces == 1 else torch.cat(outs)

    def _dropout(self, t: torch.Tensor, which: int) -> torch.Tensor:
        p = self.dropouts[which]
        return F.dropout(t, p, self.training) if p else t

    def extra_repr(self) -> str:
        return f"{self.kind.name} block, {self.pieces} pieces"


@dataclass
class TensorParallelPlan:
    """What `parallelize` did: the blocks it made tensor-parallel and how each cut
    parameter (by its name in the model) is sliced over the TP ranks."""

    tp: Collectives
    pieces: int
    blocks: list[DominoBlock] = field(default_factory=list)
    sharded: dict[str, ShardSpec] = field(default_factory=dict)
    undo_log: list[Callable[[], None]] | None = field(default=None, repr=False)

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor `name` from every TP rank's value (replicated: rank 0's)."""
        spec = self.sharded.get(name)
        return shards[0] if spec is None else spec.unshard(shards)

    def undo(self) -> None:
        """[Note: undoing parallelize] Puts the model back as `parallelize` found it:
        its original blocks and Linear layers (which still hold the full weights:
        the slices are copies) and what `BlockKind.prepare` changed. Possible while
        the plan keeps its undo log: always inside `parallelize` (a block that
        cannot be cut leaves the model as it was), after it only with
        `keep_undo=True`, until `commit`. Doing it twice does nothing."""
        if self.undo_log is None:
            raise RuntimeError("TensorParallelPlan.undo: parallelize kept no undo log "
                               "(call it with keep_undo=True)")
        while self.undo_log:
            self.undo_log.pop()()
        self.blocks.clear()
        self.sharded.clear()

    def commit(self) -> None:
        """Drops the undo log, and with it the original layers' full weights."""
        self.undo_log = None


def _replace(root: nn.Module, path: str, new: nn.Module,
             undo: list[Callable[[], None]] | None) -> None:
    owner, _, attr = path.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    if undo is not None:
        old = getattr(mod, attr)
        undo.append(lambda: setattr(mod, attr, old))
    setattr(mod, attr, new)


def parallelize(model: nn.Module, tp: Collectives, pieces: int, *,
                recorder: TraceRecorder = NULL_RECORDER,
                keep_undo: bool = False) -> TensorParallelPlan:
    """Makes every known transformer block of `model` tensor-parallel over `tp`, in
    place: its column and row layers keep this rank's slices, and the block runs
    as a `DominoBlock` of `pieces` pieces, every parameter first set to the TP
    group's first rank's values (`_weights_from_first_rank`). Raises `ValueError`
    (naming the layer where one cannot be cut: `tp_blocks`) if it finds no block, a
    block already cut, or one it cannot cut, and leaves `model` as it was then.
    `keep_undo`: the plan keeps what `undo` needs, the original layers with their
    full weights, until `commit` ([Note: undoing parallelize]); without it they
    are freed."""
    plan = TensorParallelPlan(tp, pieces)
    found = tp_blocks(model, tp.world)  # every refusal before anything changes
    if keep_undo:
        plan.undo_log = []
    try:
        _weights_from_first_rank(model, tp, plan.undo_log)
        for name, block, kind in found:
            _parallelize_block(plan, model, name, block, kind, recorder)
    except BaseException:  # with keep_undo; else only what the checks cannot foresee
        if plan.undo_log is not None:
            plan.undo()
        raise
    return plan


def tp_blocks(model: nn.Module, world: int) -> list[tuple[str, nn.Module, BlockKind]]:
    """The blocks `parallelize` cuts over `world` TP ranks, as (name, block, kind), each
    checked; `ValueError` or `TypeError` naming the first that cannot be cut. Talks to
    no other rank: `initialize` runs it where every rank hears of a refusal."""
    if any(isinstance(m, DominoBlock) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} already has tensor-parallel blocks "
                         "(DominoBlock), cut by an earlier initialize that failed: build the "
                         "model again (its cut layers hold one rank's slices)")
    found = [(name, m, kind) for name, m in model.named_modules()
             if name and (kind := kind_of(m)) is not None]
    if not found:
        raise ValueError(f"tp.size = {world}: {type(model).__name__} has no transformer "
                         "block tensor parallelism knows (GPT-style Block, Llama-style "
                         "decoder layer, GPT-2 block)")
    names: dict[int, list[str]] = {}  # every name of a module, shared ones under each
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    for name, block, kind in found:
        try:
            DominoBlock.check(block)
            kind.check(block, world)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        cut = [(p, True) for p in kind.columns] + [(p, False) for p in kind.rows]
        for path, column in cut:
            try:
                check_cut(block.get_submodule(path), column, kind.columns.get(path, 1), world)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}.{path}: {e}") from e
        for path, m in [("", block)] + [(p, block.get_submodule(p)) for p, _ in cut]:
            full = f"{name}.{path}" if path else name
            others = [n for n in names[id(m)] if n != full]
            if others:  # the other name would run it uncut, or cut it twice
                raise ValueError(f"{full} is also {others[0]!r} in the model: a block or "
                                 "layer used at two places cannot be cut (one place would "
                                 "run it without its all-reduce); give each place its own "
                                 "module")
            hooks = _users_hooks(m)
            if hooks:
                raise ValueError(f"{full} has hooks ({', '.join(hooks)}) that would not run "
                                 "once it is cut (a tensor-parallel module replaces it): "
                                 "register them after offload.initialize, on engine.module")
    return found


def _users_hooks(m: nn.Module) -> list[str]:
    """The hooks on `m` a cut would drop, each as kind: name. Not transformers' output
    capturing ones: a forward with output_hidden_states (or output_attentions) leaves
    them on every decoder layer for good, and what they capture is refused under
    tensor parallelism anyway."""
    out = []
    for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                 "_backward_hooks"):
        for h in (getattr(m, kind, None) or {}).values():
            name = getattr(h, "__qualname__", type(h).__name__)
            if not (getattr(h, "__module__", "") or "").startswith("transformers.") \
                    or "output_capturing" not in name:
                out.append(f"{kind.strip('_')}: {name}")
    return out


def _weights_from_first_rank(model: nn.Module, tp: Collectives,
                             undo: list[Callable[[], None]] | None) -> None:
    """[Note: rank 0's weights] in offload/engine/placing.py, over the TP group, before
    the cut: each rank cuts its slices from its own full weights and keeps its own
    copy of the replicated ones, so ranks that built the model seeded each their own
    way (`manual_seed(seed + rank)`) would train a model no rank built, with
    replicated weights that differ between the TP ranks. Every parameter takes the
    TP group's first rank's values, in place (as DDP does); the data-parallel
    groups then take their first rank's, so every rank trains from rank 0's
    weights. A warning names the first parameter that differed."""
    if tp.world == 1:
        return
    first = None
    for name, p in model.named_parameters():
        if p.is_meta:  # made from engine.seed, alike on every rank
            continue
        got = tp.first_rank_value(p)
        if got is None:
            continue
        first = first or name
        if undo is not None:
            old = p.detach().clone()
            undo.append(lambda p=p, old=old: p.data.copy_(old))
        p.data.copy_(got)
    if first is not None:
        log.warning("initialize: rank %d's initial weights differ from those of the first "
                    "rank of its tensor-parallel group (first: %r); every rank trains from "
                    "rank 0's, as under DDP", tp.rank, first)


def _parallelize_block(plan: TensorParallelPlan, model: nn.Module, name: str,
                       block: nn.Module, kind: BlockKind, recorder: TraceRecorder) -> None:
    tp, undo = plan.tp, plan.undo_log
    dropouts = kind.prepare(block, tp.world, undo)
    for path, parts in kind.columns.items():
        layer = ColumnParallel(block.get_submodule(path), tp, parts=parts, recorder=recorder)
        _replace(block, path, layer, undo)
        plan.sharded[f"{name}.{path}.weight"] = layer.spec
        if layer.bias is not None:
            plan.sharded[f"{name}.{path}.bias"] = ShardSpec(0, parts)
    for path in kind.rows:
        layer = RowParallel(block.get_submodule(path), tp, recorder=recorder)
        _replace(block, path, layer, undo)
        plan.sharded[f"{name}.{path}.weight"] = layer.spec
    wrapped = DominoBlock(block, kind, plan.pieces, dropouts, recorder)
    _replace(model, name, wrapped, undo)
    plan.blocks.append(wrapped)
