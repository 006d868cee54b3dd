"""The model's buffers at `initialize`: made where a model built on meta left them, read
from a `checkpoint=`, taken from rank 0 as DDP does, and moved to the store's device.
Parameters are the engine's (`_materialise` in materialise.py); buffers stay the model's."""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn

from ..comm import Collectives
from .checkpoint import SafetensorsCheckpoint
from .materialise import Lineage, scratch_for_others
from .meta import SkipMetaNormal

log = logging.getLogger(__name__)

__all__ = ["buffers_from_first_rank", "buffers_to", "load_buffers", "materialise_buffers",
           "persistent_buffers", "saved_buffers"]


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Moves the model's buffers to `device`; a buffer several modules share stays one."""
    moved: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                if id(b) not in moved:
                    moved[id(b)] = b.to(device)
                m._buffers[name] = moved[id(b)]


def buffers_from_first_rank(comm: Collectives, model: nn.Module) -> None:
    """[Note: rank 0's weights] Buffers too, as DDP broadcasts the module's buffers: a
    buffer that differs from rank 0's (a mask or statistics made per rank) is replaced
    by a tensor holding rank 0's values (the old tensor is left as it was), and one
    warning names the first. Every rank of the job (`comm`: all of them) calls it; a
    buffer shared by several modules stays one. Where the ranks' buffers differ in
    name, shape, dtype or sharing, `initialize` has refused already, on every rank
    (`buffer_section`, [Note: ranks agree at initialize])."""
    done: dict[int, torch.Tensor] = {}
    first = None
    for mname, m in model.named_modules():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in done:
                got = comm.first_rank_value(b)
                done[id(b)] = b if got is None else got
                if first is None and got is not None:
                    first = f"{mname}.{name}" if mname else name
            m._buffers[name] = done[id(b)]
    if first is not None:
        log.warning("initialize: rank %d's buffers differ from rank 0's (first: %r); every "
                    "rank uses rank 0's, as under DDP", comm.rank, first)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(full name, module, attribute) of each persistent buffer (what a state dict and
    save_pretrained hold), under every name it is registered under."""
    for prefix, m in model.named_modules(remove_duplicate=False):
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield f"{prefix}.{name}".lstrip("."), m, name


def saved_buffers(model: nn.Module, ckpt: SafetensorsCheckpoint | None) -> set[str]:
    """Names of the persistent buffers `ckpt` holds (none without one)."""
    if ckpt is None:
        return set()
    return {fqn for fqn, _, _ in persistent_buffers(model) if ckpt.resolve(fqn) is not None}


def load_buffers(model: nn.Module, ckpt: SafetensorsCheckpoint) -> None:
    """The persistent buffers `checkpoint=` holds (BatchNorm statistics, BART's
    final_logits_bias), as transformers' from_pretrained loads them; the others keep
    the model's values."""
    with torch.no_grad():
        for fqn, m, name in persistent_buffers(model):
            t = ckpt.find([fqn])
            if t is None:
                continue
            b = m._buffers[name]
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"checkpoint tensor for buffer {fqn} has shape "
                                 f"{tuple(t.shape)}, the model's is {tuple(b.shape)}")
            b.copy_(t.to(b.dtype))


def materialise_buffers(model: nn.Module, seed: int, saved: set[str]) -> None:
    """Buffers left on meta by a model built there are made on the CPU: those named in
    `saved` (the checkpoint resumed from holds them) as zeros it overwrites, the others
    (rotary `inv_freq`, BERT's `position_ids`) filled by the `_init_weights` of the
    transformers model they are in ([Note: whose _init_weights] in materialise.py), as
    transformers fills them when it loads a model; the other tensors that rule could
    write are scratch ([Note: initialisers write scratch]). A buffer that several
    modules share stays one tensor (the save may name it once)."""
    names: dict[int, list[str]] = {}  # a buffer shared by several modules: all its names
    for prefix, m in model.named_modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                names.setdefault(id(b), []).append(f"{prefix}.{name}".lstrip("."))
    made: dict[int, torch.Tensor] = {}  # one CPU tensor per meta one: sharing is kept

    def fresh(b: torch.Tensor) -> torch.Tensor:
        if id(b) not in made:
            made[id(b)] = torch.zeros_like(b, device="cpu")
        return made[id(b)]
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta and any(n in saved for n in names[id(b)]):
                m._buffers[name] = fresh(b)
    owners = [m for m in model.modules()
              if any(b is not None and b.is_meta for b in m._buffers.values())]
    if not owners:
        return
    lineage = Lineage(model)
    unruled = [f"{prefix}.{name}".lstrip(".") for prefix, m in model.named_modules()
               if lineage.rule.get(id(m)) is None
               for name, b in m._buffers.items() if b is not None and b.is_meta]
    if unruled:
        raise ValueError(f"buffers {unruled[:4]} are on the meta device and "
                         f"{type(model).__name__} has no _init_weights to fill them; build "
                         "buffers on the CPU (only parameters may be meta)")
    with torch.random.fork_rng(devices=[]), torch.no_grad(), scratch_for_others(owners), \
            SkipMetaNormal():
        torch.manual_seed(seed)
        for m in owners:
            for name, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[name] = fresh(b)
            lineage.rule[id(m)](m)
