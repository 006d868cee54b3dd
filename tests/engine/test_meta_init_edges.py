"""Meta-device initialisation at its edges (offload/engine/materialise.py), checked
against the model built normally on the CPU: composite transformers models, each part
initialised by its own `_init_weights` ([Note: whose _init_weights]); the user's real
parameters and buffers never written and kept ([Note: initialisers write scratch]);
nn.ParameterList / nn.ParameterDict set by their parent; a parametrization refused
naming the cause."""

import pytest
import torch
from torch import nn

import offload
from offload.engine import meta_device

transformers = pytest.importorskip("transformers")


def _init(build, engine_cfg, **engine):
    """initialize(build) on small budgets; the engine's state_dict(), engine closed."""
    e = offload.initialize(build, engine_cfg("device", "host", "host", **engine))
    try:
        return e.state_dict()
    finally:
        e.close()


def _like_eager(got: dict, want: dict) -> None:
    """Each parameter as the CPU build has it: constant ones (norms, biases, zeroed
    tokens) equal, random ones of the same spread."""
    assert set(got) == set(want)
    for k, w in want.items():
        v = got[k].float()
        w = w.float()
        if torch.all(w == w.reshape(-1)[0]):
            assert torch.equal(v, w), k
        elif w.numel() >= 64:
            assert 0.6 < v.std() / w.std() < 1.6, (k, v.std().item(), w.std().item())


def _llama_cfg(**kw):
    return transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=100, max_position_embeddings=64, **kw)


def _vision_encoder_decoder():
    vit = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, image_size=16, patch_size=8)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                   n_positions=64)
    return transformers.VisionEncoderDecoderModel(
        config=transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2))


def _llava():
    clip = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         image_size=16, patch_size=8)
    return transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=clip, text_config=_llama_cfg(),
                                 image_token_index=99))


@pytest.mark.parametrize("build", [_vision_encoder_decoder, _llava],
                         ids=["vit-gpt2", "llava"])
def test_composite_models_get_each_parts_init(engine_cfg, build):
    """ViT's cls_token and CLIP's class_embedding are set by their own model's
    `_init_weights` (the outer model's does not know them), as when built on the CPU."""
    torch.manual_seed(0)
    want = build().state_dict()
    _like_eager(_init(build, engine_cfg), want)


class _WrapCfg(transformers.PretrainedConfig):
    model_type = "offload-meta-wrap"


class _WrapLlama(transformers.PreTrainedModel):
    """A transformers model of one's own holding a Llama of another initializer_range."""
    config_class = _WrapCfg

    def __init__(self, config) -> None:
        super().__init__(config)
        self.lm = transformers.LlamaForCausalLM(_llama_cfg(initializer_range=0.5))
        self.value = nn.Linear(32, 1)
        self.post_init()


def test_a_sub_model_is_initialised_with_its_own_config(engine_cfg):
    torch.manual_seed(0)
    want = _WrapLlama(_WrapCfg()).state_dict()
    assert 0.4 < want["lm.model.embed_tokens.weight"].std() < 0.6
    _like_eager(_init(lambda: _WrapLlama(_WrapCfg()), engine_cfg), want)


class _WrapBert(transformers.PreTrainedModel):
    config_class = _WrapCfg

    def __init__(self, config) -> None:
        super().__init__(config)
        self.bert = transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64,
            num_attention_heads=2, vocab_size=100, max_position_embeddings=16))
        self.post_init()


class _Plain(nn.Module):
    """A model of one's own (no `_init_weights`) holding a transformers model."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = transformers.LlamaModel(_llama_cfg())
        self.head = nn.Linear(32, 3)


@pytest.mark.parametrize("build", [lambda: _WrapBert(_WrapCfg()), _Plain],
                         ids=["bert-in-wrapper", "llama-in-module"])
def test_sub_models_fill_their_meta_buffers_and_parameters(engine_cfg, build):
    """BERT's position_ids (arange) and Llama's rotary inv_freq, left on meta inside
    another model, are filled by their own model's `_init_weights`, as are Llama's
    norms under a root that has none."""
    torch.manual_seed(0)
    ref = build()
    with meta_device():
        model = build()
    with offload.initialize(model, engine_cfg()) as engine:
        want = dict(ref.named_buffers())
        got = dict(engine.module.named_buffers())
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k].cpu(), v), k
        _like_eager(engine.state_dict(), ref.state_dict())


# ------------------------------------------------- the user's real tensors are only read


def test_real_t5_embedding_is_neither_written_nor_changed(engine_cfg):
    """T5's root rule writes `shared` while other groups are made: the user's real
    embedding and head keep their values, in the engine and in the user's tensors."""
    cfg = transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                                vocab_size=100, tie_word_embeddings=False)
    with meta_device():
        model = transformers.T5ForConditionalGeneration(cfg)
    shared = nn.Parameter(torch.full((100, 32), 0.5))
    head = nn.Parameter(torch.full((100, 32), 0.25))
    model.shared.weight, model.lm_head.weight = shared, head
    sd = _init(model, engine_cfg)
    assert torch.equal(shared.detach(), torch.full((100, 32), 0.5))
    assert torch.equal(head.detach(), torch.full((100, 32), 0.25))
    assert torch.equal(sd["shared.weight"], torch.full((100, 32), 0.5))
    assert torch.equal(sd["lm_head.weight"], torch.full((100, 32), 0.25))
    assert 0.5 < sd["encoder.block.0.layer.0.SelfAttention.q.weight"].std() / (
        (32 * 16) ** -0.5) < 2  # the meta ones still made as T5 makes them


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(40, 40) for _ in range(3))
        self.scale = nn.Parameter(torch.ones(40))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


class _FailsOnCpu(nn.Linear):
    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            raise RuntimeError("init failed")


def test_real_root_parameter_survives_its_rule_and_a_failed_initialize(engine_cfg):
    """The root's reset_parameters runs for every group below it: the user's real
    `scale` (2.0) is not set to its ones, neither after a failed initialize (the model
    put back as it was) nor in the engine of the retry."""
    with meta_device():
        model = _Scaled()
        model.layers.append(_FailsOnCpu(40, 40))
    user = nn.Parameter(torch.full((40,), 2.0))
    model.scale = user
    cfg = engine_cfg()
    with pytest.raises(RuntimeError, match="init failed"):
        offload.initialize(model, cfg)
    assert model.scale is user and torch.equal(user.detach(), torch.full((40,), 2.0))
    with meta_device():
        model.layers[3] = nn.Linear(40, 40)
    with offload.initialize(model, cfg) as engine:
        assert torch.equal(engine.state_dict()["scale"], torch.full((40,), 2.0))
        assert engine.state_dict()["layers.0.weight"].std() > 0.05
    assert torch.equal(user.detach(), torch.full((40,), 2.0))


def test_real_tensors_of_a_module_with_meta_ones_are_kept(engine_cfg):
    """A Linear whose weight is real and bias meta, a BatchNorm whose running
    statistics are real: their own reset_parameters (run to make the meta ones) wrote
    the user's tensors (the weight kaiming, the statistics reset)."""
    with meta_device():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    w = nn.Parameter(torch.full((8, 8), 0.5))
    model[0].weight = w
    stats = torch.full((8,), 3.0)
    model[1].register_buffer("running_mean", stats)
    model[1].register_buffer("running_var", torch.full((8,), 4.0))
    model[1].register_buffer("num_batches_tracked", torch.tensor(7))
    with offload.initialize(model, engine_cfg()) as engine:
        sd = engine.state_dict()
        assert torch.equal(sd["0.weight"], torch.full((8, 8), 0.5))
        assert sd["0.bias"].abs().max() <= 8 ** -0.5 and sd["0.bias"].std() > 0.05
        assert torch.equal(sd["1.weight"], torch.ones(8))
        assert torch.equal(sd["1.running_mean"], torch.full((8,), 3.0))
        assert torch.equal(sd["1.running_var"], torch.full((8,), 4.0))
        assert int(sd["1.num_batches_tracked"]) == 7
    assert torch.equal(w.detach(), torch.full((8, 8), 0.5))
    assert torch.equal(stats, torch.full((8,), 3.0))


# ------------------------------------------------- parameter containers, parametrizations


class _Experts(nn.Module):
    """Weights in an nn.ParameterList and an nn.ParameterDict, set by their parent."""

    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.empty(d, d)) for _ in range(n)])
        self.b = nn.ParameterDict({f"e{i}": nn.Parameter(torch.empty(d)) for i in range(n)})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.w:
            nn.init.normal_(w, std=0.02)
        for b in self.b.values():
            nn.init.constant_(b, 0.5)


def test_parameter_list_and_dict_are_set_by_their_parent(engine_cfg):
    torch.manual_seed(0)
    want = _Experts().state_dict()
    sd = _init(_Experts, engine_cfg)
    assert set(sd) == set(want)
    for k, v in want.items():
        if k.startswith("b."):
            assert torch.equal(sd[k], v), k
        else:
            assert 0.6 < sd[k].std() / v.std() < 1.6, k


def test_a_parametrized_meta_module_is_refused_naming_the_cause(engine_cfg):
    """weight_norm's original0/original1 are written by no initialiser (they write the
    weight it computes): refused, naming the parametrization and the fix."""
    def build():
        return nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"parametrizations\.weight\.original[01] .*"
                                         r"parametrization.*build the parametrized module "
                                         r"on the CPU"):
        _init(build, engine_cfg)


class _Target(nn.Module):
    """A frozen target its reset_parameters copies from the trainable online weights
    (two groups: trainable and frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Parameter(torch.empty(64, 64))
        self.target = nn.Parameter(torch.empty(64, 64), requires_grad=False)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.target.copy_(self.online)


def test_a_meta_weight_copied_from_a_real_one_gets_the_users_values(engine_cfg):
    """`target` (meta) is made by copying the user's real `online`: it gets the user's
    values, as `reset_parameters` gives on the CPU; the module's real weight was given
    new storage when its meta one was made, and the copy took that memory's values."""
    with meta_device():
        model = _Target()
    torch.manual_seed(0)
    user = nn.Parameter(torch.randn(64, 64))
    want = user.detach().clone()
    model.online = user
    sd = _init(model, engine_cfg)
    assert torch.equal(sd["online"], want)
    assert torch.equal(sd["target"], want)
    assert torch.equal(user.detach(), want)


class _TargetOfOwnInit(_Target):
    """`online` set by the model's `_init_weights`, which runs after reset_parameters."""

    def _init_weights(self, m: nn.Module) -> None:
        if m is self:
            nn.init.normal_(self.online)


def test_a_meta_weight_copied_from_one_already_handed_over_is_refused(engine_cfg):
    """Both meta: when the frozen group is made the trainable one is the engine's, and
    the copy read a scratch of uninitialised memory, trained as it was; now it reads
    NaN and is refused, naming it."""
    with pytest.raises(ValueError, match=r"parameter target was built on meta and nothing "
                                         r"initialised it.*copies it from a weight of "
                                         r"another group"):
        _init(_TargetOfOwnInit, engine_cfg)


class _DrawnTarget(_Target):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.online, std=0.1)
        with torch.no_grad():
            self.target.copy_(self.online)


def test_a_modules_own_copy_holds_across_its_groups(engine_cfg):
    """online (trainable) and target (frozen) are two groups of one module: both are
    made in the first group's pass and kept, so the copy holds as on the CPU (the
    second pass drew them again, target from other draws than online's)."""
    ref = _DrawnTarget()
    ref.reset_parameters()
    assert torch.equal(ref.target, ref.online)
    sd = _init(_DrawnTarget, engine_cfg)
    assert 0.08 < sd["online"].std() < 0.12
    assert torch.equal(sd["target"], sd["online"])
