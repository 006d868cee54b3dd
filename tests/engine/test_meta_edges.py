"""Tests of meta-device initialisation (`offload.initialize(lambda: Model())`, or a
model built under `offload.engine.meta_device()`): each parameter group is
materialised on real storage by its modules' own initialisers (`_materialise` in
offload/engine/materialise.py), checked against the model built normally on the CPU:
buffers and real weights kept, parents' rules, nn.MultiheadAttention, T5, parameters
nothing initialises, a failed initialize put back."""

import math
import os

import pytest
import torch
from torch import nn

import offload
from offload.engine import meta_device

from .models import TiedTwice
from .ranks import gloo_group, spawn


def _init(build, engine_cfg, **engine):
    """initialize(build) on small budgets; the engine's state_dict(), engine closed."""
    e = offload.initialize(build, engine_cfg("device", "host", "host", **engine))
    try:
        return e.state_dict()
    finally:
        e.close()


# --------------------------------------------------------------------------- works


class _TorchZoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 16, padding_idx=3)
        self.lin = nn.Linear(16, 32)
        self.conv = nn.Conv2d(3, 8, 3)
        self.lstm = nn.LSTM(8, 16)
        self.gru = nn.GRU(8, 16)
        self.ln = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16)


def test_torch_modules_get_their_reset_parameters_init(engine_cfg):
    """Linear, Embedding (padding row zeroed), Conv, LSTM, GRU, LayerNorm, RMSNorm built
    on meta get the distribution their reset_parameters gives on the CPU."""
    sd = _init(_TorchZoo, engine_cfg)
    emb = sd["emb.weight"]
    assert torch.equal(emb[3], torch.zeros(16))
    assert 0.85 < emb.std().item() < 1.15  # N(0, 1)
    lin_bound = 1 / math.sqrt(16)  # kaiming_uniform(a=sqrt 5) and the bias: U(+-1/sqrt(fan_in))
    for k in ("lin.weight", "lin.bias"):
        assert sd[k].abs().max() <= lin_bound and sd[k].std() > 0.5 * lin_bound / math.sqrt(3), k
    conv_bound = 1 / math.sqrt(3 * 3 * 3)
    assert sd["conv.weight"].abs().max() <= conv_bound and sd["conv.weight"].std() > 0.05
    rnn_bound = 1 / math.sqrt(16)
    for k, v in sd.items():
        if k.startswith(("lstm.", "gru.")):
            assert v.abs().max() <= rnn_bound and v.std() > 0.5 * rnn_bound / math.sqrt(3), k
    for k in ("ln.weight", "rms.weight"):
        assert torch.equal(sd[k], torch.ones(16)), k
    assert torch.equal(sd["ln.bias"], torch.zeros(16))


def test_frozen_parts_and_bf16_construction_are_initialised(engine_cfg):
    """A module whose parameters are split over a trainable and a frozen group, a frozen
    module, and modules constructed in bf16 all get their init (no zeros, no garbage)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.a.weight.requires_grad_(False)
            self.emb = nn.Embedding(64, 16).requires_grad_(False)
            self.ln = nn.LayerNorm(16)
            self.ln.bias.requires_grad_(False)
            self.b = nn.Linear(64, 64, dtype=torch.bfloat16)
            self.n = nn.LayerNorm(64, dtype=torch.bfloat16)
    sd = _init(M, engine_cfg)
    bound = 1 / math.sqrt(16)
    for k in ("a.weight", "a.bias"):
        assert sd[k].abs().max() <= bound and sd[k].std() > 0.1, k
    assert 0.8 < sd["emb.weight"].std() < 1.2
    assert torch.equal(sd["ln.weight"], torch.ones(16))
    assert torch.equal(sd["ln.bias"], torch.zeros(16))
    b = sd["b.weight"].float()
    assert b.abs().max() <= 1 / 8 + 1e-3 and b.std() > 0.05
    assert torch.equal(sd["n.weight"].float(), torch.ones(64))


def test_meta_init_is_seeded_by_engine_seed_not_the_callers_rng(engine_cfg):
    """The same factory gives the same weights whatever the caller's RNG state; another
    engine.seed gives other weights."""
    torch.manual_seed(1)
    a = _init(TiedTwice, engine_cfg)
    torch.manual_seed(2)
    b = _init(TiedTwice, engine_cfg)
    c = _init(TiedTwice, engine_cfg, seed=7)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    assert not torch.equal(a["l1.weight"], c["l1.weight"])
    assert torch.equal(a["emb.weight"], a["head.weight"])  # the tie holds


def test_factory_that_raises_leaves_nothing_behind(engine_cfg, tmp_path):
    """A factory's error propagates as it is; the meta device is no longer the default,
    no swap file is left, and the next initialize on the same directory works."""
    def boom():
        nn.Linear(4, 4)
        raise KeyError("factory failed")
    cfg = engine_cfg("nvme", "nvme", "nvme")
    with pytest.raises(KeyError, match="factory failed"):
        offload.initialize(boom, cfg)
    assert torch.empty(1).device.type == "cpu"
    swap = tmp_path / "swap"
    assert not swap.exists() or not os.listdir(swap)
    e = offload.initialize(lambda: nn.Linear(40, 40), cfg)
    assert e.state_dict()["weight"].std() > 0.05
    e.close()


def test_failure_while_materialising_removes_swap_files(engine_cfg, tmp_path):
    """An initialiser that raises in a late group: the error propagates, the swap files of
    the groups already placed are removed, and the directory can be used again."""
    class Bad(nn.Linear):
        def reset_parameters(self) -> None:
            if not self.weight.is_meta:
                raise RuntimeError("init failed")
    cfg = engine_cfg("nvme", "nvme", "nvme")
    with pytest.raises(RuntimeError, match="init failed"):
        offload.initialize(lambda: nn.Sequential(*[nn.Linear(40, 40) for _ in range(4)],
                                                 Bad(40, 40)), cfg)
    assert not [f for f in os.listdir(tmp_path / "swap")]
    e = offload.initialize(lambda: nn.Sequential(*[nn.Linear(40, 40) for _ in range(4)]), cfg)
    e.close()
    assert not [f for f in os.listdir(tmp_path / "swap")]


def test_factory_returning_a_cpu_model_keeps_its_weights(engine_cfg):
    """A factory may build on the CPU explicitly: its weights are taken as they are."""
    torch.manual_seed(0)
    ref = nn.Linear(40, 40)
    want = ref.weight.detach().clone()
    sd = _init(lambda: ref, engine_cfg)
    torch.testing.assert_close(sd["weight"], want, atol=0, rtol=0)


def _llama(tie: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_on_meta_buffers_and_tie_match_a_cpu_build(engine_cfg):
    """Llama with tied embeddings built on meta: its rotary buffers equal a CPU build's,
    the head stays tied to the embedding, norms are ones."""
    ref = _llama(True)
    with meta_device():
        model = _llama(True)
    e = offload.initialize(model, engine_cfg("device", "host", "host", group_size=5000))
    try:
        want = dict(ref.named_buffers())
        got = dict(model.named_buffers())
        assert set(want) == set(got)
        for k, v in want.items():
            torch.testing.assert_close(got[k].cpu(), v, atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        sd = e.state_dict()
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
        assert 0.015 < sd["model.embed_tokens.weight"].std() < 0.025
        assert torch.equal(sd["model.norm.weight"], torch.ones(32))
    finally:
        e.close()


def _rank_worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    import offload as off
    with gloo_group(rank, world, init_file):
        torch.manual_seed(100 + rank)  # the caller's RNG differs by rank: it must not matter
        e = off.initialize(lambda: TiedTwice(vocab=96), cfg)
        torch.save(e.state_dict(rank0_only=False), f"{out}.{rank}")
        e.close()


@pytest.mark.distributed
def test_two_ranks_materialise_the_same_weights_as_one_process(tmp_path, engine_cfg):
    """Two gloo ranks initialising a meta-built model hold the same full weights as each
    other and as one process with the same engine.seed."""
    cfg = engine_cfg("nvme", "host", "host")
    out = str(tmp_path / "sd")
    spawn(_rank_worker, str(tmp_path / "init"), out, cfg)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    one = _init(lambda: TiedTwice(vocab=96), engine_cfg)
    assert set(r0) == set(r1) == set(one)
    for k in r0:
        torch.testing.assert_close(r0[k], r1[k], atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(r0[k], one[k], atol=0, rtol=0, msg=lambda m: f"{k}: {m}")


# --------------------------------------------------------------------------- bugs


class _MaskedLinear(nn.Module):
    """A parameter on meta and, as docs/guide-oversized.md says to, its buffer on the CPU."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, d))
        with torch.device("cpu"):
            self.register_buffer("mask", torch.tril(torch.ones(d, d)))
            self.register_buffer("pos", torch.arange(d), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * self.mask) + self.pos


def test_cpu_buffers_of_a_module_with_meta_parameters_are_kept(engine_cfg):
    """docs: 'a model of your own builds its buffers on the CPU' - the buffers of a module
    that also owns meta parameters must keep their values (a causal mask, positions)."""
    with meta_device():
        model = _MaskedLinear()
    assert model.weight.is_meta and model.mask.device.type == "cpu"
    e = offload.initialize(model, engine_cfg())
    try:
        assert torch.equal(model.mask.cpu(), torch.tril(torch.ones(16, 16)))
        assert torch.equal(model.pos.cpu(), torch.arange(16))
    finally:
        e.close()


class _SharedScale(nn.Module):
    """One buffer registered by two modules, left on meta, filled by `_init_weights`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        shared = torch.ones(4)
        self.a.register_buffer("scale", shared)
        self.b.register_buffer("scale", shared)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.scale.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.a.scale) * self.b.scale


def test_a_meta_buffer_two_modules_share_stays_one_tensor(engine_cfg):
    """Made on the CPU once: an edit or a load under one name reaches the other."""
    with torch.device("meta"):
        model = _SharedScale()
    with offload.initialize(model, engine_cfg()) as engine:
        assert engine.module.a.scale is engine.module.b.scale
        assert torch.equal(engine.module.a.scale, torch.full((4,), 2.0))


class _ZeroInitOut(nn.Module):
    """A parent whose reset_parameters overrides its child's init (zero-initialised output
    projection, as in many residual blocks), run at the end of __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(16))
        self.proj = nn.Linear(16, 16)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)


def test_parent_reset_parameters_overrides_its_child_as_on_the_cpu(engine_cfg):
    ref = _ZeroInitOut()
    sd = _init(_ZeroInitOut, engine_cfg)
    assert torch.equal(sd["gain"], ref.gain.detach())
    assert torch.equal(sd["proj.weight"], ref.proj.weight.detach())  # zeros
    assert torch.equal(sd["proj.bias"], ref.proj.bias.detach())


def test_multihead_attention_on_meta_gets_its_init(engine_cfg):
    sd = _init(lambda: nn.MultiheadAttention(32, 4), engine_cfg)
    w = sd["in_proj_weight"]
    bound = math.sqrt(6 / (32 + 96))  # xavier_uniform_ of the (96, 32) in_proj_weight
    assert w.abs().max() <= bound and w.std() > 0.5 * bound / math.sqrt(3)
    assert torch.equal(sd["in_proj_bias"], torch.zeros(96))
    assert torch.equal(sd["out_proj.bias"], torch.zeros(32))  # MHA zeroes its child's bias


def test_hf_t5_on_meta_initialises(engine_cfg):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=96, d_model=32, d_ff=64, num_layers=1, num_heads=4,
                                d_kv=8)

    def build():
        return transformers.T5ForConditionalGeneration(cfg)
    torch.manual_seed(0)
    want = build().state_dict()
    sd = _init(build, engine_cfg, group_size=5000)
    w, v = want["shared.weight"], sd["shared.weight"]
    assert 0.8 < v.std() / w.std() < 1.25


class _PartlyCpu(nn.Module):
    """Built under meta, with one layer put on the CPU and given known values (a part
    loaded from elsewhere, or built on the CPU as the guide shows for buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        with torch.device("cpu"):
            self.b = nn.Linear(8, 8)
        with torch.no_grad():
            self.b.weight.fill_(0.5)
            self.b.bias.fill_(0.25)


def test_cpu_weights_in_a_group_with_meta_ones_are_kept(engine_cfg):
    sd = _init(_PartlyCpu, engine_cfg)
    assert sd["a.weight"].std() > 0.05
    assert torch.equal(sd["b.weight"], torch.full((8, 8), 0.5))
    assert torch.equal(sd["b.bias"], torch.full((8,), 0.25))


def test_hf_parameter_no_initialiser_touches_is_not_left_uninitialised(engine_cfg):
    transformers = pytest.importorskip("transformers")

    class Scale(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.gamma = nn.Parameter(torch.ones(d))

    class Cfg(transformers.PretrainedConfig):
        model_type = "metacase-toy"

    class Toy(transformers.PreTrainedModel):
        config_class = Cfg

        def __init__(self, config) -> None:
            super().__init__(config)
            self.lin = nn.Linear(16, 16)
            self.scale = Scale(1237)
            self.post_init()

        def _init_weights(self, module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0, 0.02)
                module.bias.data.zero_()

    # Built on the CPU, gamma is ones; on meta nothing gives it values: it was trained
    # as whatever memory held, now it is refused, naming it
    with pytest.raises(ValueError, match=r"parameter scale\.gamma was built on meta and "
                                         r"nothing initialised it"):
        _init(lambda: Toy(Cfg()), engine_cfg)


def test_meta_model_can_be_retried_after_a_failed_initialize(engine_cfg):
    class Bad(nn.Linear):
        def reset_parameters(self) -> None:
            if not self.weight.is_meta:
                raise RuntimeError("init failed")
    with meta_device():
        model = nn.Sequential(*[nn.Linear(40, 40) for _ in range(4)], Bad(40, 40))
    cfg = engine_cfg()
    with pytest.raises(RuntimeError, match="init failed"):
        offload.initialize(model, cfg)
    with meta_device():
        model[4] = nn.Linear(40, 40)  # the user fixes the failing part and tries again
    e = offload.initialize(model, cfg)
    try:
        assert e.state_dict()["0.weight"].std() > 0.05
    finally:
        e.close()
