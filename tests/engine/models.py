"""Small models for engine tests: tied weights, a module used twice, dynamic control flow."""

import torch
from torch import nn


class TiedTwice(nn.Module):
    """Embedding tied to the output head; `l1`/`l2` run twice per forward."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(dim))  # a parameter of the root itself

    def reset_parameters(self) -> None:
        """Initialises the root's own parameter (used when built on the meta device)."""
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for _ in range(2):
            h = h + self.l2(torch.relu(self.l1(h)))
        return self.head(self.norm(h) * self.scale)


class Branchy(nn.Module):
    """Uses a different set and order of layers depending on the input."""

    def __init__(self, dim: int = 32, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i in route:
            h = torch.tanh(self.layers[i](h))
        return self.out(h)


def lm_batches(steps: int, vocab: int = 64, batch: int = 4, seq: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(steps)]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def lm_train(engine, batches) -> list[float]:
    """One step of `engine` per (x, y) of `batches`; the losses."""
    losses = []
    for x, y in batches:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_state_dict_as_torch(engine, ref: nn.Module) -> None:
    """The engine's state_dict equals `ref`'s, key by key, bit for bit."""
    sd = engine.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


def assert_weights_as_torch(engine, ref: nn.Module, atol: float) -> None:
    """The engine's full weights equal `ref`'s parameters, name by name."""
    with engine.full_weights() as w:
        for n, q in ref.named_parameters():
            torch.testing.assert_close(w[n], q.detach(), atol=atol, rtol=0,
                                       msg=lambda m: f"{n}: {m}")
