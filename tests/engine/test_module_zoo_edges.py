"""torch's own modules, as users build models from them, trained under the engine
against plain PyTorch (torch.optim.AdamW, fp32, same init and data): the losses of
every step, the final weights and an evaluation forward match. Parametrizations,
sparse embeddings, attention and transformer layers, grouped and transposed
convolutions, recurrent layers with projections, activation checkpoints inside a
unit, data-dependent shapes; and what the engine refuses, with a clear error."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize, prune
from torch.utils.checkpoint import checkpoint

import offload


class Head(nn.Module):
    """`body`, then a linear head to one value per sample (of the mean over a
    sequence's positions where `seq`)."""

    def __init__(self, body: nn.Module, features: int, seq: bool = False) -> None:
        super().__init__()
        self.body = body
        self.seq = seq
        self.head = nn.Linear(features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h.mean(1) if self.seq else h.flatten(1))


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def _parametrized(kind: str, n: int) -> nn.Module:
    lin = nn.Linear(n, n)
    if kind == "weight_norm":
        lin = parametrizations.weight_norm(lin)
    elif kind == "spectral_norm":
        lin = parametrizations.spectral_norm(lin)  # power iteration buffers, in training
    elif kind == "orthogonal":
        lin = parametrizations.orthogonal(lin)
    elif kind == "custom":  # module.parametrizations.weight.original
        parametrize.register_parametrization(lin, "weight", Symmetric())
        parametrize.register_parametrization(lin, "bias", nn.Tanh())
    elif kind == "old_weight_norm":  # a forward pre-hook registered before initialize
        lin = nn.utils.weight_norm(lin)
    elif kind == "old_spectral_norm":
        lin = nn.utils.spectral_norm(lin)
    elif kind == "prune":  # weight = weight_orig * weight_mask, in a forward pre-hook
        prune.l1_unstructured(lin, "weight", amount=0.3)
    return Head(nn.Sequential(lin, nn.Tanh()), n)


class Attention(nn.Module):
    def __init__(self, kdim: int | None = None) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, bias=False, kdim=kdim,
                                          vdim=kdim)
        self.kdim = kdim
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = x if self.kdim is None else x[..., :self.kdim]
        out, weights = self.attn(x, kv, kv)
        return self.head(out).mean(1) + weights.mean((1, 2))[:, None]


def _encoder(norm_first: bool = False) -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, bias=False,
                                       norm_first=norm_first)
    return Head(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), 8, seq=True)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True, bias=False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.t(x, x[:, :3])).mean(1)


class Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = (nn.LSTM(8, 12, proj_size=4, batch_first=True) if kind == "lstm_proj" else
                    nn.RNN(8, 6, num_layers=2, batch_first=True, bidirectional=True))
        self.head = nn.Linear(4 if kind == "lstm_proj" else 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0]).mean(1)


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bil = nn.Bilinear(8, 8, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bil(x, x.flip(-1)))


class Scaled(nn.Module):
    """Reads a parameter of the root, reached through a plain attribute."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.__dict__["root"] = root  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.root.scale


class RootParamInChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.inp = nn.Linear(8, 8)
        self.inner = Scaled(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.inp(x))).sum(-1, keepdim=True)


class Checkpointed(nn.Module):
    """Activation checkpoints inside one forward: per block (`blocks`), or of a
    function of the model's own layers between two of them (`mid`); `mid` used
    plainly and again inside a checkpoint, after (`shared`) or before it
    (`shared-first`)."""

    def __init__(self, where: str, reentrant: bool) -> None:
        super().__init__()
        self.where, self.reentrant = where, reentrant
        self.inp = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
                                    for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.where == "blocks":
            for b in self.blocks:
                h = h + checkpoint(b, h, use_reentrant=self.reentrant)
        elif self.where.startswith("shared"):
            first = self.where == "shared-first"
            h = h if first else torch.tanh(self.mid(h))
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=self.reentrant)
            h = torch.tanh(self.mid(h)) if first else h
        else:  # the backward of `inp`, `mid` reads their weights after the checkpoint's
            h = self.mid(torch.tanh(h))
            h = checkpoint(lambda t: torch.tanh(self.blocks[0](t)), h,
                           use_reentrant=self.reentrant)
        return self.out(h)


class CheckpointedWeights(nn.Module):
    """The root's own weights are read only inside a reentrant checkpoint, after a child
    unit: their group's gradient comes only from the nested pass, and is reduced at the
    end of backward."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.a = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.randn(8, 1) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(t @ self.a) @ self.b, self.pre(x),
                          use_reentrant=True)


class TiedAcrossUnits(nn.Module):
    """The root's own weight is tied to the weight of a unit inside it, and the root
    reads it after that unit's forward ended: the inner unit's end must not free it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.blocks[1].weight = self.w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return F.linear(x, self.w).sum(-1, keepdim=True)


class Lookup(nn.Module):
    def __init__(self, bag: bool, **kw) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum", **kw) if bag else nn.Embedding(20, 8, **kw)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h if h.dim() == 2 else h.mean(1))


class DataDependent(nn.Module):
    """`.item()`, a boolean mask's data-dependent shape, in-place ops on activations and
    on a copy of the input, and an output whose other parts need no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Split()
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, 0] = 0.0
        h, stats, zeros = self.a(x)
        n = int((h > 0).sum().item()) % 5 + 1
        h = h.clone()
        h[:, :n] *= 2
        picked = h[h.abs() > 0.1]
        return self.out(torch.relu_(self.b(h)) + stats + zeros.sum()) + picked.mean()


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.lin(x)
        return torch.tanh(h), h.detach().mean(-1, keepdim=True), torch.zeros(3)


def _floats(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def _ids(*shape):
    return lambda g: torch.randint(0, 20, shape, generator=g)


CONV = {
    "conv1d_groups_prelu_groupnorm": lambda: Head(nn.Sequential(
        nn.Conv1d(4, 8, 3, groups=2), nn.PReLU(8), nn.GroupNorm(2, 8)), 8 * 6),
    "conv2d_groups_instancenorm": lambda: Head(nn.Sequential(
        nn.Conv2d(4, 8, 3, groups=4, bias=False), nn.InstanceNorm2d(8, affine=True),
        nn.PReLU()), 8 * 16),
    "conv3d_groups": lambda: Head(nn.Sequential(nn.Conv3d(2, 4, 2, groups=2), nn.Tanh()), 4 * 27),
    "conv_transpose_groups": lambda: Head(nn.Sequential(
        nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2), nn.Tanh()), 4 * 9 * 9),
}
CONV_INPUT = {"conv1d_groups_prelu_groupnorm": (4, 4, 8),
              "conv2d_groups_instancenorm": (4, 4, 6, 6), "conv3d_groups": (4, 2, 4, 4, 4),
              "conv_transpose_groups": (4, 4, 4, 4)}

# (id, build, input, group_size, build of the torch reference where it differs)
CASES = [
    *[(f"parametrize_{k}", lambda k=k: _parametrized(k, 8), _floats(4, 8), 200, None)
      for k in ("weight_norm", "spectral_norm", "orthogonal", "custom", "old_weight_norm")],
    # a parametrized layer larger than a unit: its ParametrizationList is a unit itself
    ("parametrize_weight_norm_split", lambda: _parametrized("weight_norm", 16), _floats(4, 16),
     200, None),
    ("parametrize_custom_split", lambda: _parametrized("custom", 16), _floats(4, 16), 200, None),
    # the pre-hook computing the weight runs inside the unit's forward, after its gather
    *[(f"{k}_split", lambda k=k: _parametrized(k, 16), _floats(4, 16), 200, None)
      for k in ("old_weight_norm", "old_spectral_norm", "prune")],
    # out_proj would be a unit of its own, which MultiheadAttention's forward never calls
    ("multihead_attention", Attention, _floats(4, 5, 8), 60, None),
    ("multihead_attention_kdim", lambda: Attention(kdim=6), _floats(4, 5, 8), 60, None),
    ("transformer_encoder", _encoder, _floats(4, 5, 8), 200, None),
    ("transformer_encoder_norm_first", lambda: _encoder(True), _floats(4, 5, 8), 100000, None),
    *[(k, CONV[k], _floats(*CONV_INPUT[k]), 200, None) for k in CONV],
    ("lstm_proj_size", lambda: Recurrent("lstm_proj"), _floats(4, 5, 8), 100, None),
    ("rnn_bidirectional", lambda: Recurrent("rnn"), _floats(4, 5, 8), 200, None),
    ("bilinear", Bilinear, _floats(4, 8), 200, None),
    ("root_parameter_in_a_child", RootParamInChild, _floats(4, 8), 60, None),
    # [Note: reentrant checkpoints inside a unit]: the model is one unit
    *[(f"checkpoint_{where}_{'reentrant' if r else 'non_reentrant'}",
       lambda w=where, r=r: Checkpointed(w, r), _floats(4, 8), 100000, None)
      for where in ("blocks", "mid") for r in (True, False)],
    ("checkpoint_blocks_reentrant_units", lambda: Checkpointed("blocks", True), _floats(4, 8),
     120, None),  # each block a unit, recomputed with its hooks
    ("checkpoint_of_the_roots_weights", CheckpointedWeights, _floats(4, 8), 80, None),
    ("tied_across_units", TiedAcrossUnits, _floats(4, 8), 72, None),
    ("embedding_padding_idx", lambda: Lookup(False, padding_idx=0), _ids(4, 5), 200, None),
    ("embedding_scale_grad_by_freq", lambda: Lookup(False, scale_grad_by_freq=True), _ids(4, 5),
     200, None),
    # [Note: sparse gradients]: trains as sparse=False (torch's AdamW refuses sparse ones)
    ("embedding_sparse", lambda: Lookup(False, sparse=True), _ids(4, 5), 100,
     lambda: Lookup(False)),
    ("embedding_bag_sparse", lambda: Lookup(True, sparse=True, padding_idx=0), _ids(4, 5), 100,
     lambda: Lookup(True, padding_idx=0)),
    ("data_dependent", DataDependent, _floats(4, 8), 80, None),
]


def _config(engine_cfg, group_size, placement=("host", "host", "host")):
    cfg = engine_cfg(*placement, group_size=group_size)
    cfg["optim"]["eps"] = 1e-6
    return cfg


def _train_as_torch(engine, ref, make_x, steps=3):
    g = torch.Generator().manual_seed(1)
    batches = [(make_x(g), torch.randn(4, 1, generator=g)) for _ in range(steps + 1)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    for i, (x, y) in enumerate(batches[:steps]):
        got = F.mse_loss(engine(x), y)
        engine.backward(got)
        engine.step()
        opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        assert got.item() == pytest.approx(want.item(), abs=1e-6), f"step {i}"
    sd = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")
    engine.eval()
    ref.eval()
    with torch.no_grad():  # evaluation between steps: torch's fast paths, where it has them
        torch.testing.assert_close(engine(batches[-1][0]), ref(batches[-1][0]), atol=2e-6,
                                   rtol=0)


@pytest.mark.parametrize("build,make_x,group_size,reference",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_torch_modules_train_as_torch(engine_cfg, build, make_x, group_size, reference):
    torch.manual_seed(0)
    ref = (reference or build)()
    torch.manual_seed(0)  # the same weights (and spectral_norm's vectors) again
    with offload.initialize(build(), _config(engine_cfg, group_size)) as engine:
        _train_as_torch(engine, ref, make_x)


@pytest.mark.parametrize("where", ["blocks", "mid"])
def test_reentrant_checkpoint_inside_a_unit_with_early_updates(engine_cfg, where):
    """[Note: reentrant checkpoints inside a unit] Optimizer state on NVMe updates each
    group as soon as its gradient is reduced: before the fix the second piece of the
    unit's gradient raised "group 0 already has new parameters in this step"."""
    torch.manual_seed(0)
    ref = Checkpointed(where, True)
    torch.manual_seed(0)
    cfg = _config(engine_cfg, 100000, ("nvme", "nvme", "nvme"))
    with offload.initialize(Checkpointed(where, True), cfg) as engine:
        _train_as_torch(engine, ref, _floats(4, 8))


@pytest.mark.parametrize("where", ["shared", "shared-first"])
def test_a_unit_used_inside_and_outside_a_reentrant_checkpoint_with_early_updates(
        engine_cfg, where):
    """[Note: a gradient in several passes] `mid`, a unit of its own, gets its gradient
    in the checkpoint's nested pass and in the outer pass: before the fix every step
    failed with "group N already has new parameters in this step"."""
    torch.manual_seed(0)
    ref = Checkpointed(where, True)
    torch.manual_seed(0)
    cfg = _config(engine_cfg, 100, ("host", "host", "nvme"))
    with offload.initialize(Checkpointed(where, True), cfg) as engine:
        assert len(engine.groups) > 3
        _train_as_torch(engine, ref, _floats(4, 8))


class SiblingWeight(nn.Module):
    """`b`'s forward reads `a`'s weight with F.linear, `a` being a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.__dict__["other"] = self.a  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return F.linear(h, self.b.other.weight).sum(-1, keepdim=True)


def test_a_weight_read_outside_its_unit_raises_naming_it_and_the_fix(engine_cfg):
    """Where a module's weight is read in another unit's forward, the first forward
    raises, naming the parameter and `engine.whole_modules`; with both in one unit
    it trains as torch."""
    torch.manual_seed(0)
    with offload.initialize(SiblingWeight(), _config(engine_cfg, 60)) as engine:
        with pytest.raises(RuntimeError, match=r"'a\.weight'.*engine\.whole_modules"):
            engine(torch.randn(4, 8))
    torch.manual_seed(0)
    ref = SiblingWeight()
    torch.manual_seed(0)
    with offload.initialize(SiblingWeight(), _config(engine_cfg, 200)) as engine:
        _train_as_torch(engine, ref, _floats(4, 8))


def test_transformer_encoder_evaluates_padded_batches_as_torchs_fast_path(engine_cfg):
    """In evaluation torch runs nn.TransformerEncoderLayer through its fused kernel
    (and, with a padding mask, nested tensors); under the engine the units' hooks
    keep it on the plain path, with the same numbers."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                           batch_first=True), 2)
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                             batch_first=True), 2)
    x = torch.randn(3, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    ref.eval()
    with offload.initialize(model, _config(engine_cfg, 200)) as engine:
        engine.eval()
        with torch.no_grad():
            got = engine(x, src_key_padding_mask=pad)
            want = ref(x, src_key_padding_mask=pad)
    keep = ~pad  # torch's fast path leaves the padded positions at zero
    torch.testing.assert_close(got[keep], want[keep], atol=2e-6, rtol=0)


@pytest.mark.parametrize("group_size", [200, 100000])
def test_full_transformer_trains_as_torch(engine_cfg, group_size):
    torch.manual_seed(0)
    ref = Seq2Seq()
    torch.manual_seed(0)
    with offload.initialize(Seq2Seq(), _config(engine_cfg, group_size)) as engine:
        _train_as_torch(engine, ref, _floats(4, 5, 8))
