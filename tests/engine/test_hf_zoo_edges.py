"""Hugging Face model families beyond GPT-2 / Llama / BERT / T5 / BART (test_hf*.py),
trained under offload and checked against plain PyTorch (`torch.optim.AdamW` on a
deepcopy, same data): Mixture-of-Experts (Mixtral and Qwen2-MoE with their experts in
3-D tensors; SwitchTransformers with one module per expert, so an expert no token is
routed to gets no gradient and torch's AdamW leaves it alone), sliding-window attention
(Mistral, Gemma2), Gemma, Phi, ViT, a CLIP two-tower model; greedy/beam/sampled
`generate` with the KV cache; tuple outputs with hidden states; bf16 compute; and a
model whose forward converts one of its modules to another dtype, refused clearly."""

import copy

import pytest
import torch

import offload

from .test_hf_flows import left_padded

transformers = pytest.importorskip("transformers")
T = transformers

V = 128
_NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
_DECODER = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, **_NO_TOKENS)


def _mixtral():
    return T.MixtralForCausalLM(T.MixtralConfig(
        **_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.01))


def _qwen2_moe():
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **_DECODER, num_key_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True))


def _mistral():
    return T.MistralForCausalLM(T.MistralConfig(**_DECODER, num_key_value_heads=2,
                                                sliding_window=4))


def _gemma():
    return T.GemmaForCausalLM(T.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=8))


def _gemma2():
    return T.Gemma2ForCausalLM(T.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=8,
                                              sliding_window=4))


def _phi():
    return T.PhiForCausalLM(T.PhiConfig(**_DECODER, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attention_dropout=0.0))


def _switch(jitter=0.01, **kw):
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, expert_capacity=8, num_layers=2,
        num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1,
        num_heads=4, num_experts=8, router_jitter_noise=jitter, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kw))


def _vit():
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _clip():
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, projection_dim=16)
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, max_position_embeddings=16, eos_token_id=V - 1,
                         bos_token_id=0, pad_token_id=1, **tower),
        vision_config=dict(image_size=16, patch_size=4, **tower), projection_dim=16))


def _ids(n, seed=1, shape=(2, 12)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V - 1, shape, generator=g) for _ in range(n)]


def _pixels(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 3, (2,), generator=g))
            for _ in range(n)]


def _lm(m, x):
    return m(input_ids=x, labels=x).loss


def _seq2seq(m, x):
    return m(input_ids=x, labels=x[:, :5].clone()).loss


def _image_classes(m, b):
    return m(pixel_values=b[0], labels=b[1]).loss


def _contrastive(m, b):
    text = _ids(1, seed=int(b[1].sum()), shape=(2, 8))[0]
    text[:, -1] = V - 1  # the end token the text tower pools at
    return m(input_ids=text, pixel_values=b[0], return_loss=True).loss


# name: (build, batches, loss, weight tolerance, keys left out of the weight comparison)
# Tolerances: eps=1e-6 (as test_hf_flows.py); where a gradient entry is a rounding
# residue of a true zero or ~1e-6 of the largest (unrouted rows of a fused expert tensor,
# unused embedding rows under batched experts), Adam magnifies the rounding. Attention's
# key bias has a zero true gradient (softmax ignores a constant shift): left out for CLIP,
# whose loss makes it a pure rounding residue.
CASES = {
    "mixtral": (_mixtral, _ids, _lm, 3e-6, ()),
    "qwen2_moe": (_qwen2_moe, _ids, _lm, 3e-6, ()),
    "switch_unrouted_experts": (_switch, lambda n: _ids(n, shape=(2, 6)), _seq2seq, 2e-5, ()),
    "mistral_sliding_window": (_mistral, _ids, _lm, 3e-6, ()),
    "gemma": (_gemma, _ids, _lm, 3e-6, ()),
    "gemma2": (_gemma2, _ids, _lm, 3e-6, ()),
    "phi": (_phi, _ids, _lm, 3e-6, ()),
    "vit": (_vit, _pixels, _image_classes, 3e-6, ()),
    "clip": (_clip, _pixels, _contrastive, 3e-6, ("k_proj.bias",)),
}
# the default set; the others are marked slow, covered there by the same path
DEFAULT = {"mixtral", "switch_unrouted_experts", "gemma2", "clip"}


def _cfg(engine_cfg, placement=("device", "host", "host"), **engine):
    cfg = engine_cfg(*placement, group_size=5000, **engine)
    cfg["optim"]["eps"] = 1e-6
    return cfg


def _adamw(ref):
    return torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _params(case):
    return [pytest.param(c, id=c, marks=() if c in DEFAULT else pytest.mark.slow) for c in case]


# slow ones: the same path as the default cases of the same kind (mixtral for qwen2_moe,
# gemma2 for mistral/gemma/phi, clip for vit)
@pytest.mark.parametrize("case", _params(CASES))
def test_model_family_trains_as_torch(engine_cfg, case):
    """Three steps: each loss as torch's (MoE auxiliary loss included), then every
    weight; the routers' jitter noise drawn the same (the engine draws no random
    numbers of its own). For SwitchTransformers, some experts get no gradient in a step
    (checked on torch's side), and the engine leaves them as torch does."""
    build, batches, loss_of, tol, skip = CASES[case]
    torch.manual_seed(0)
    ref = build()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    unrouted = 0
    try:
        for i, b in enumerate(batches(3)):
            torch.manual_seed(100 + i)
            loss = loss_of(engine.module, b)
            engine.backward(loss)
            engine.step()
            torch.manual_seed(100 + i)
            opt.zero_grad()
            ref_loss = loss_of(ref, b)
            ref_loss.backward()
            unrouted += sum(p.grad is None for p in ref.parameters())
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5), i
        assert (unrouted > 0) == case.startswith("switch")
        sd = engine.state_dict()
        want = ref.state_dict()
        assert list(sd) == list(want)
        for k, v in want.items():
            if v.is_floating_point() and not any(s in k for s in skip):
                torch.testing.assert_close(sd[k], v, atol=tol, rtol=0,
                                           msg=lambda m, k=k: f"{k}: {m}")
    finally:
        engine.close()


GENERATE = {"mixtral": _mixtral, "gemma2": _gemma2, "mistral_sliding_window": _mistral,
            "qwen2_moe": _qwen2_moe}


@pytest.mark.parametrize("case", [pytest.param(c, id=c, marks=() if c == "mixtral" else
                                               pytest.mark.slow) for c in GENERATE])
def test_generate_and_tuple_outputs_as_torch(engine_cfg, case):
    """Greedy, beam and sampled `generate` with the KV cache past the sliding window
    (prompt 5, 10 new tokens, window 4), left padding, through `engine.generate` and
    the model's own; and `return_dict=False, output_hidden_states=True` forwards.
    (slow ones: the same path as mixtral.) The MoE models' router logits are off for
    generation: transformers' auxiliary loss fails there with a padding mask, in torch
    as well."""
    torch.manual_seed(0)
    ref = GENERATE[case]()
    ref.config.output_router_logits = False
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, ("host", "host", "host")))
    x = _ids(1, seed=2, shape=(2, 5))[0]
    mask = left_padded(x)
    try:
        engine.eval(), ref.eval()
        for kw in ({}, {"num_beams": 2}, {"do_sample": True, "top_k": 0}):
            for generate in (engine.generate, engine.module.generate):
                kw = {"attention_mask": mask, "max_new_tokens": 10, "pad_token_id": 0, **kw}
                torch.manual_seed(3)
                got = generate(x, **kw)
                torch.manual_seed(3)
                assert torch.equal(got, ref.generate(x, **kw)), kw
        with torch.no_grad():
            got = engine(input_ids=x, attention_mask=mask, labels=x, use_cache=False,
                         output_hidden_states=True, return_dict=False)
            want = ref(input_ids=x, attention_mask=mask, labels=x, use_cache=False,
                       output_hidden_states=True, return_dict=False)
        assert isinstance(got, tuple) and len(got) == len(want) == 3
        torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=0)
        assert len(got[2]) == len(want[2]) == 3
        torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_a_module_the_forward_casts_to_another_dtype_is_refused_naming_it(engine_cfg):
    """SwitchTransformers' router runs `self.classifier = self.classifier.to(float32)`
    in its forward (config.router_dtype). Under bf16 compute that conversion is refused
    with an error naming the module and the fix, before anything changes (it failed
    as "used outside the forward of unit ...router", the unit that was running). The
    model configured to route in the engine's dtype trains."""
    torch.manual_seed(0)
    engine = offload.initialize(_switch(jitter=0.0), _cfg(engine_cfg, dtype="bf16"))
    x = _ids(1, shape=(2, 6))[0]
    try:
        with pytest.raises(RuntimeError, match=r"converting module 'encoder\.block\.1\.layer"
                           r"\.1\.mlp\.router\.classifier' .* to torch\.float32 .* refused"):
            _seq2seq(engine.module, x)
        with engine.full_weights() as w:  # nothing changed, nothing left in use
            assert w["encoder.block.1.layer.1.mlp.router.classifier.weight"].dtype == \
                torch.float32
    finally:
        engine.close()
    engine = offload.initialize(_switch(jitter=0.0, router_dtype="bfloat16"),
                                _cfg(engine_cfg, dtype="bf16"))
    try:
        for x in _ids(2, shape=(2, 6)):
            loss = _seq2seq(engine.module, x)
            engine.backward(loss)
            engine.step()
            assert torch.isfinite(loss)
    finally:
        engine.close()


def _deberta():
    return T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=8,
        pos_att_type=["p2c", "c2p"], max_relative_positions=16, pad_token_id=0))


def test_a_forward_reading_a_child_weight_is_named_and_whole_modules_trains_it(engine_cfg):
    """DeBERTa-v2's encoder reads `rel_embeddings.weight` in its own forward: split
    into units, the first forward raises naming the weight and `engine.whole_modules`;
    with the encoder listed there, training gives torch's numbers."""
    torch.manual_seed(0)
    ref = _deberta()
    x = _ids(2)
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    try:
        with pytest.raises(RuntimeError, match=r"'deberta\.encoder\.rel_embeddings\.weight'.*"
                           r"engine\.whole_modules"):
            engine(input_ids=x[0], labels=x[0])
    finally:
        engine.close()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg,
                                                         whole_modules=["deberta.encoder"]))
    opt = _adamw(ref)
    try:
        for b in x:
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            ref_loss = ref(input_ids=b, labels=b).loss
            ref_loss.backward()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=3e-6, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    finally:
        engine.close()
