"""A small GPT-style decoder and a learnable synthetic task, for `offload demo` and
`offload bench oversized`.

The model is a plain pre-norm decoder: token and position embeddings, `n_layer`
blocks of (LayerNorm, causal self-attention through
`F.scaled_dot_product_attention`, LayerNorm, MLP), a final LayerNorm and an
output head tied to the token embedding. Every module with parameters has a
`reset_parameters` (stock `nn.Linear` and `nn.LayerNorm`; `Embedding` with
GPT-2's initialisation), so `offload.initialize` can build the model on the meta
device and initialise it one group at a time.

The task is sequence reversal: a row is `x_1 .. x_L SEP x_L .. x_1`; the model
reads it left to right and the loss counts only the reversed half, so a model
that learns nothing stays at ln(symbols) and one that has learnt the task goes
to zero. Every position of the answer needs attention to one exact position of
the question, so the loss falls only by learning, not by counting tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "ReversalTask", "PRESETS", "preset_for_params",
           "state_bytes_per_param"]

IGNORE = -100  # cross_entropy's ignore_index: positions outside the answer


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder. `vocab` counts the task's symbols plus its SEP token."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    max_seq: int
    mlp_ratio: int = 4

    @property
    def params(self) -> int:
        """Parameters (elements), counting the tied embedding/head once."""
        d, L = self.d_model, self.n_layer
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) \
            + (self.mlp_ratio * d * d + self.mlp_ratio * d) + (self.mlp_ratio * d * d + d)
        return L * block + self.vocab * d + self.max_seq * d + 2 * d


# Named sizes for --size. "tiny" is for tests (seconds a run); "small" is the demo's
# default: about half a second a step on 2 cores, the task learnt in 30-40 steps.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=128, n_head=2, vocab=17, max_seq=32),
    "small": GPTConfig(n_layer=6, d_model=384, n_head=6, vocab=17, max_seq=32),
    "base": GPTConfig(n_layer=8, d_model=512, n_head=8, vocab=17, max_seq=32),
    "large": GPTConfig(n_layer=12, d_model=768, n_head=12, vocab=17, max_seq=32),
}


def preset_for_params(target: int, *, vocab: int = 256, max_seq: int = 256,
                      head_dim: int = 128) -> GPTConfig:
    """A decoder of about `target` parameters with GPT-like proportions
    (depth ~ d_model / 80, d_model a multiple of `head_dim`)."""
    if target <= 0:
        raise ValueError(f"target of {target} parameters; give a positive count")
    best = None
    for d in range(head_dim, 16 * 1024 + 1, head_dim):
        layers = max(1, round((target - vocab * d - max_seq * d) / (12 * d * d + 13 * d)))
        cfg = GPTConfig(n_layer=layers, d_model=d, n_head=d // head_dim, vocab=vocab,
                        max_seq=max_seq)
        # prefer the right size, then an aspect ratio near GPT-3's (d ~ 80-130 x depth)
        score = abs(math.log(cfg.params / target)) + 0.2 * abs(math.log(d / (100 * layers)))
        if best is None or score < best[0]:
            best = (score, cfg)
    return best[1]


def state_bytes_per_param(dtype: str) -> int:
    """Bytes of training state per parameter: compute-dtype weights, fp32 gradient,
    fp32 master weights and the two fp32 Adam moments (2 + 4 + 4 + 4 + 4 = 18 for
    bf16/fp16 compute; 4 + 4 + 4 + 4 = 16 for fp32, whose weights are the master)."""
    return 16 if dtype == "fp32" else 18


class Embedding(nn.Embedding):
    """`nn.Embedding` initialised N(0, 0.02) as GPT-2 does, not N(0, 1): the head is
    tied to it, and unit-variance rows would start the logits far from uniform."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx)` returns logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = Embedding(cfg.vocab, cfg.d_model)
        self.pos = Embedding(cfg.max_seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # a Linear (not F.linear on tok.weight) so the engine sees the tied weight used
        # here too and gathers it for this module
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        # position ids as a CPU buffer: the engine allows only parameters on meta
        self.register_buffer("positions", torch.arange(cfg.max_seq, device="cpu"),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.max_seq:
            raise ValueError(f"sequence of {T} tokens, the model takes at most "
                             f"{self.cfg.max_seq}")
        x = self.tok(idx) + self.pos(self.positions[:T].to(idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ReversalTask:
    """Batches of `x SEP reversed(x)` over `symbols` symbols (token ids 0..symbols-1;
    SEP = symbols). Inputs are the row without its last token, targets the row
    shifted by one with everything before the answer ignored."""

    def __init__(self, symbols: int, length: int, batch: int, seed: int = 0) -> None:
        if symbols < 2 or length < 1 or batch < 1:
            raise ValueError(f"ReversalTask(symbols={symbols}, length={length}, batch={batch}) "
                             "needs at least 2 symbols, length 1 and batch 1")
        self.symbols, self.length, self.batch = symbols, length, batch
        self.sep = symbols
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def vocab(self) -> int:
        return self.symbols + 1

    @property
    def seq_len(self) -> int:
        """Tokens the model reads per row (inputs)."""
        return 2 * self.length

    @property
    def chance_loss(self) -> float:
        """Loss of a model that guesses uniformly among the symbols."""
        return math.log(self.symbols)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets), each (batch, 2 * length) int64."""
        x = torch.randint(0, self.symbols, (self.batch, self.length), generator=self.generator)
        sep = torch.full((self.batch, 1), self.sep, dtype=torch.long)
        row = torch.cat([x, sep, x.flip(1)], dim=1)
        inputs, targets = row[:, :-1].clone(), row[:, 1:].clone()
        targets[:, :self.length - 1] = IGNORE  # before SEP nothing is predictable
        targets[:, self.length - 1] = IGNORE   # SEP itself is given, not learnt
        return inputs, targets

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the answer positions (fp32)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1).to(logits.device), ignore_index=IGNORE)
