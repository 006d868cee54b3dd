"""The transformer blocks tensor parallelism knows: which Linear layers are cut and
how, and how to run a block's attention and MLP on one piece of the batch.

Every kind is a pre-norm block, `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`,
whose attention output projection and MLP down projection are row-parallel
(their outputs are partial sums, reduced by `Domino`) and whose q/k/v and MLP
up (and gate) projections are column-parallel, by heads for attention:
- the GPT-style decoder of `offload demo` (`ln1`, `attn.qkv` fused q/k/v,
  `attn.proj`, `ln2`, `mlp.fc`, `mlp.proj`);
- Hugging Face Llama-style decoder layers (`input_layernorm`, `self_attn.q_proj`
  `k_proj` `v_proj` `o_proj`, `post_attention_layernorm`, `mlp.gate_proj`
  `up_proj` `down_proj`; Mistral and Qwen2 share it);
- Hugging Face GPT-2 blocks (`ln_1`, `attn.c_attn` a fused q/k/v `Conv1D`,
  `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`); their residual dropouts
  run after the reduction (on the full output, as the model runs them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockKind", "KINDS", "kind_of"]


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


@dataclass(frozen=True)
class BlockKind(ABC):
    """One kind of block: the layers it cuts, and its attention and MLP on one piece
    (each kind defines `attention`)."""

    name: str
    norms: tuple[str, str]
    columns: dict[str, int]  # path -> fused parts (3 for one q/k/v projection)
    rows: tuple[str, str]  # attention output, MLP down
    heads: tuple[str, ...] = ()  # attributes holding head counts: each cut over TP

    def matches(self, block: nn.Module) -> bool:
        return all(_get(block, p) is not None for p in (*self.norms, *self.columns, *self.rows))

    def check(self, block: nn.Module, tp_size: int) -> None:
        """Raises `ValueError` if `block` cannot be cut over `tp_size` ranks (its heads do
        not split evenly); changes nothing."""
        for path in self.heads:
            n = self.attribute(block, path)
            if n % tp_size:
                raise ValueError(f"{self.name} block: {path} = {n} is not a multiple of "
                                 f"tp.size = {tp_size}; heads are split evenly over TP ranks")

    def attribute(self, block: nn.Module, path: str) -> object:
        """`block`'s attribute at `path` (e.g. `attn.n_head`), one this kind reads to run
        the block cut; `ValueError` where it is absent: a block that has the layers'
        names of this kind but is another model's (nanoGPT's blocks have GPT-2's
        layer names) is refused, never run as this kind."""
        owner, _, attr = path.rpartition(".")
        mod = _get(block, owner) if owner else block
        if mod is None or not hasattr(mod, attr):
            raise ValueError(f"{type(block).__name__} has the layers of a {self.name} block "
                             f"but no {path}, which tensor parallelism reads to run it: only "
                             f"the blocks docs/domino.md lists can be cut")
        return getattr(mod, attr)

    def prepare(self, block: nn.Module, tp_size: int,
                undo: list[Callable[[], None]] | None = None) -> list[float]:
        """`check`s the block and sets what the attention reads (local head counts);
        returns the dropout probabilities to apply after the attention's and the
        MLP's reductions. What it changes in `block` it undoes with the functions
        it appends to `undo` (run last first)."""
        self.check(block, tp_size)
        return [0.0, 0.0]

    @abstractmethod
    def attention(self, block: nn.Module, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The block's attention on one piece `h` (its output still a partial sum)."""

    def mlp(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return block.mlp(h)


class GptBlock(BlockKind):
    def attention(self, block: nn.Module, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        attn = block.attn
        B, T, C = h.shape
        head_dim = C // attn.n_head  # C is the full width: the input is replicated
        q, k, v = (t.view(B, T, -1, head_dim).transpose(1, 2)
                   for t in attn.qkv(h).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaBlock(BlockKind):
    def check(self, block: nn.Module, tp_size: int) -> None:
        cfg = self.attribute(block, "self_attn.config")
        for key in ("num_attention_heads", "num_key_value_heads"):
            if getattr(cfg, key) % tp_size:
                raise ValueError(f"Llama block: {key} = {getattr(cfg, key)} is not a multiple "
                                 f"of tp.size = {tp_size}; heads are split evenly over TP ranks")
        # the attention reads its local heads from q_proj's width: prepare changes nothing

    def attention(self, block: nn.Module, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return block.self_attn(hidden_states=h, **kwargs)[0]


class Gpt2Block(BlockKind):
    def check(self, block: nn.Module, tp_size: int) -> None:
        super().check(block, tp_size)
        self.attribute(block, "attn.split_size")  # prepare cuts it with the heads
        if hasattr(block, "crossattention"):
            raise ValueError("GPT-2 block with cross-attention: not supported with tp.size > 1")

    def prepare(self, block: nn.Module, tp_size: int,
                undo: list[Callable[[], None]] | None = None) -> list[float]:
        self.check(block, tp_size)
        attn = block.attn
        if undo is not None:
            old = (attn.split_size, attn.num_heads, attn.resid_dropout, block.mlp.dropout)

            def restore() -> None:
                attn.split_size, attn.num_heads, attn.resid_dropout, block.mlp.dropout = old
            undo.append(restore)
        attn.split_size //= tp_size  # the local q/k/v widths
        attn.num_heads //= tp_size
        drops = [attn.resid_dropout.p, block.mlp.dropout.p]
        attn.resid_dropout, block.mlp.dropout = nn.Identity(), nn.Identity()
        return drops

    def attention(self, block: nn.Module, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("GPT-2 block: encoder_hidden_states with tp.size > 1")
        kwargs = {k: v for k, v in kwargs.items()
                  if k not in ("encoder_hidden_states", "encoder_attention_mask")}
        return block.attn(h, **kwargs)[0]


KINDS: tuple[BlockKind, ...] = (
    GptBlock("GPT", ("ln1", "ln2"), {"attn.qkv": 3, "mlp.fc": 1}, ("attn.proj", "mlp.proj"),
             ("attn.n_head",)),
    LlamaBlock("Llama", ("input_layernorm", "post_attention_layernorm"),
               {f"self_attn.{p}_proj": 1 for p in "qkv"} | {"mlp.gate_proj": 1, "mlp.up_proj": 1},
               ("self_attn.o_proj", "mlp.down_proj")),
    Gpt2Block("GPT-2", ("ln_1", "ln_2"), {"attn.c_attn": 3, "mlp.c_fc": 1},
              ("attn.c_proj", "mlp.c_proj"), ("attn.num_heads",)),
)


def kind_of(block: nn.Module) -> BlockKind | None:
    """The kind of `block`, or None for a module that is no known block."""
    return next((k for k in KINDS if k.matches(block)), None)
