"""What `initialize` refuses of a model before anything is made: what the engine cannot
run as torch does (lazy modules, parameters it cannot keep as partitions in the
compute dtype, parameters that share memory, modules that change their weights in
place or mix dtypes torch refuses)."""

from __future__ import annotations

import logging
import math
from typing import Iterator, Sequence

import torch
from torch import nn

from ..config import ConfigError
from .absent import post_accumulate_message
from .grads import _DTYPES
from .weight_writes import EMBEDDING_FIX

log = logging.getLogger(__name__)

__all__ = ["refuse_lazy", "refuse_unsupported"]


def refuse_lazy(model: nn.Module, where: str = "initialize(model)") -> None:
    """Raises `ConfigError`, its message starting with `where`, naming the first
    parameter or buffer of a lazy module (nn.LazyLinear, nn.LazyBatchNorm1d and the
    like) not sized yet: there is nothing to partition, and torch's own error came
    from deep inside the unit building, naming no parameter."""
    from torch.nn.parameter import is_lazy

    lazy = [(f"parameter {n!r}", t) for n, t in model.named_parameters()]
    lazy += [(f"buffer {n!r}", t) for n, t in model.named_buffers()]
    for name, p in lazy:
        if is_lazy(p):
            raise ConfigError(
                f"{where}: {name} is not initialized yet (a lazy "
                "module, sized at its first call): run one forward with a batch of the "
                "real shape before handing the model over, or give the module its sizes "
                "(nn.Linear for nn.LazyLinear)")


def refuse_unsupported(model: nn.Module, dtype: str) -> None:
    """Raises `ConfigError` naming the first module the engine cannot run as torch does:
    an embedding with `max_norm` renormalises the rows it looks up in place inside
    forward, which the gathered weights (views of one flat buffer) refuse, and whose new
    values would reach no partition; a BatchNorm with affine weights and running
    statistics under bf16/fp16 compute gets cast weights beside fp32 statistics
    (buffers keep their dtype), a mix torch's batch_norm refuses at the first forward;
    a float64 parameter would train in the compute dtype with fp32 masters, its
    precision silently lost (and a float64 input refused by the first layer); a complex
    one (complex32 too) would lose its imaginary part; a float8 or an integer or bool
    parameter would be cast to the compute dtype, its dtype changed and values rounded.
    bf16/fp16 parameters under another compute dtype are only warned of: they train,
    in that dtype."""
    refuse_lazy(model)
    for name, p in model.named_parameters():
        kind = str(p.dtype).replace("torch.", "")
        if p.dtype == torch.float64:
            raise ConfigError(
                f"initialize(model): parameter {name!r} is float64; the engine computes in "
                "engine.dtype (fp32, bf16 or fp16) with fp32 master weights, so it would not "
                "train at that precision: convert the model first (model.float()), and its "
                "inputs")
        if p.is_complex():
            raise ConfigError(
                f"initialize(model): parameter {name!r} is {kind}; the engine keeps real "
                "partitions in engine.dtype, so its imaginary part would be lost: keep it as "
                "a real parameter of twice the size (nn.Parameter(torch.view_as_real(p))) and "
                "make the complex tensor in forward (torch.view_as_complex)")
        if p.layout != torch.strided:
            raise ConfigError(
                f"initialize(model): parameter {name!r} is a {str(p.layout)[6:]} tensor; the "
                "engine keeps dense partitions: make it dense first "
                "(nn.Parameter(p.to_dense())), or register it as a buffer if it does not "
                "train")
        if p.is_floating_point() and p.element_size() == 1:
            raise ConfigError(
                f"initialize(model): parameter {name!r} is {kind}; the engine keeps "
                f"partitions in engine.dtype and would change its dtype: convert it to "
                f"engine.dtype first (model.to({_DTYPES[dtype]})), or register it as a "
                "buffer (module.register_buffer(name, tensor)) if it does not train")
        if p._post_accumulate_grad_hooks:
            raise ConfigError(f"initialize(model): {post_accumulate_message(name)}")
        if not p.is_floating_point():
            raise ConfigError(
                f"initialize(model): parameter {name!r} is {kind}; "
                "the engine keeps parameters as floating-point partitions in engine.dtype, "
                "which would round its values and change its dtype: register it as a "
                "buffer instead (module.register_buffer(name, tensor)), which the engine "
                "leaves on its module and state_dict() keeps under the same key")
    _refuse_aliased(model)
    compute = _DTYPES[dtype]
    low = [(n, p.dtype) for n, p in model.named_parameters()
           if p.dtype in (torch.bfloat16, torch.float16) and p.dtype != compute]
    if low:  # an HF model loaded with torch_dtype=bf16 under the default engine.dtype
        name, got = low[0]
        key = next(k for k, v in _DTYPES.items() if v == got)
        log.warning("initialize: %d parameters are %s (first: %r) and engine.dtype is %r: "
                    "they compute in %s from here on (with fp32 masters); set engine.dtype "
                    "to %r to compute in %s", len(low), str(got)[6:], name, dtype,
                    str(compute)[6:], key, str(got)[6:])
    for name, m in model.named_modules():
        where = name or type(model).__name__
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ConfigError(
                f"initialize(model): {where} is an {type(m).__name__} with "
                f"max_norm={m.max_norm}, which rewrites its weight in place inside forward; "
                f"that is not supported: {EMBEDDING_FIX}")
        if dtype != "fp32" and isinstance(m, nn.modules.batchnorm._BatchNorm) \
                and m.affine and m.track_running_stats:
            raise ConfigError(
                f"engine.dtype={dtype!r}: {where} is a {type(m).__name__} with affine "
                f"weights and running statistics, which torch's batch_norm cannot run with "
                f"{dtype} weights and fp32 statistics; train it with engine.dtype 'fp32', or "
                "use a norm without running statistics (track_running_stats=False, "
                "nn.GroupNorm, nn.LayerNorm)")


def _refuse_aliased(model: nn.Module) -> None:
    """Two parameters whose elements overlap in memory (`nn.Parameter(w.data[:4])`) train
    together in torch; the engine keeps each as a partition of its own, so they would
    drift apart unnoticed. Views that share no element (an LSTM's weights flattened
    into one buffer on a GPU, a weight's column halves) train as torch does."""
    spans: dict[tuple, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.is_meta or p.numel() == 0 or type(p.data) is not torch.Tensor \
                or p.layout != torch.strided:
            continue
        size = p.element_size()
        lo = p.storage_offset() * size
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))) * size
        spans.setdefault((p.device, p.untyped_storage().data_ptr()), []).append(
            (lo, hi, name, p.data))
    for found in spans.values():
        found.sort(key=lambda span: (span[0], -span[1]))  # the larger of two first
        end, run = -1, []  # views whose byte spans overlap, one run at a time
        for lo, hi, name, t in found + [(None, 0, "", None)]:
            if lo is None or lo >= end:
                shared = _shared(run) if len(run) > 1 else None
                if shared is not None:
                    raise ConfigError(
                        f"initialize(model): parameters {shared[0]!r} and {shared[1]!r} "
                        "share memory (one is a view of the other, as "
                        "nn.Parameter(w.data[:4]) makes); torch updates them together, the "
                        "engine keeps each as a partition of its own and would train them "
                        "apart: give one its own copy (nn.Parameter(t.clone())), or compute "
                        "it from the other in forward")
                run = []
            run.append((lo, hi, name, t))
            end = max(end, hi)


def _shared(views: list[tuple[int, int, str, torch.Tensor]]) -> tuple[str, str] | None:
    """Two of `views` of one storage, whose byte spans overlap, that share a byte, or
    None: each byte's owner marked on a scratch array of their span, one pass for all.
    Past 2**27 bytes of span they are taken as apart, with a warning."""
    base = views[0][0]
    span = max(hi for _, hi, _, _ in views) - base
    if span > 1 << 27 or len(views) > 32767:
        log.warning("initialize: parameters %s may share memory (their spans overlap; too "
                    "large to check byte by byte): they train apart", [v[2] for v in views])
        return None
    owner = torch.full((span,), -1, dtype=torch.int16)
    for k, (_, _, name, t) in enumerate(views):
        size = t.element_size()
        for offsets in _offsets(t.shape, t.stride(), t.storage_offset() * size - base,
                                step=size):
            if size > 1:
                offsets = (offsets[:, None] + torch.arange(size)).reshape(-1)
            held = owner[offsets]
            if bool((held >= 0).any()):
                return views[int(held[held >= 0][0])][2], name
            owner[offsets] = k
    return None


def _offsets(shape: Sequence[int], stride: Sequence[int], start: int, step: int = 1,
             most: int = 1 << 22) -> Iterator[torch.Tensor]:
    """The offsets of a view's elements (stride 1 being `step` units), in pieces of at
    most about `most`."""
    if not shape:
        yield torch.tensor([start])
        return
    inner = math.prod(shape[1:])
    if inner > most:  # one index of the first dimension at a time, the rest cut again
        for i in range(shape[0]):
            yield from _offsets(shape[1:], stride[1:], start + i * stride[0] * step, step,
                                most)
        return
    rows = max(1, most // max(inner, 1))
    for first in range(0, shape[0], rows):
        n = min(rows, shape[0] - first)
        idx = torch.tensor([start + first * stride[0] * step])
        for size, st in zip((n, *shape[1:]), stride):
            idx = (idx[..., None] + torch.arange(size) * st * step)
        yield idx.reshape(-1)
