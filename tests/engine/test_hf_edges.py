"""Tests of what a Hugging Face user does when fine-tuning with offload: LoRA done by hand
over a frozen base, tuple outputs, encoder-decoder training and generation, and loading a
`save_pretrained` directory back with `initialize(model, cfg, checkpoint=dir)`.

The xfail(strict=True) tests are known bugs: each fails on the current code
and says in its reason what to change. The others pin behaviour that works."""

import copy
import json

import pytest
import torch
from torch import nn

import offload

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from .test_hf_flows import VOCAB, _llama  # noqa: E402

def _bart():
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                  decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                  forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg)


def _bert_config(**kw):
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, **kw)


class _LoRA(nn.Module):
    """A hand-written LoRA wrapper: the frozen base Linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # not zero: the test sees it move

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0


def _with_lora(model):
    """Freezes the whole model, then wraps q_proj and v_proj of every layer (trainable)."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            setattr(layer.self_attn, name, _LoRA(getattr(layer.self_attn, name)))
    return model


def _ids(n, seed=1, shape=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, shape, generator=g) for _ in range(n)]


def _cfg(engine_cfg, placement=("device", "host", "host"), **engine):
    cfg = engine_cfg(*placement, group_size=5000, **engine)
    cfg["optim"]["eps"] = 1e-6
    return cfg


def _adamw(ref):
    return torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                             weight_decay=0.1, eps=1e-6)


def _step_both(engine, ref, opt, loss_of) -> float:
    loss = loss_of(engine.module)
    engine.backward(loss)
    engine.step()
    opt.zero_grad()
    ref_loss = loss_of(ref)
    ref_loss.backward()
    opt.step()
    return abs(loss.item() - ref_loss.item())


# -- what works ------------------------------------------------------------------------

@pytest.mark.parametrize("placement", [("device", "host", "host"), ("nvme", "nvme", "nvme")],
                         ids=["none", "nvme"])
def test_hand_written_lora_trains_as_torch_and_exports_the_adapters(engine_cfg, placement):
    """Base frozen before initialize, LoRA wrappers around q/v projections, padded batch
    with -100 labels: the losses and adapters as torch's AdamW over the adapters, the
    frozen weights bit-identical to the start, the adapters read by selecting their
    modules in `full_weights`, and the trainable count as transformers gives it."""
    torch.manual_seed(0)
    ref = _with_lora(_llama())
    start = copy.deepcopy(ref.state_dict())
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, placement))
    opt = _adamw(ref)
    try:
        assert engine.module.num_parameters(only_trainable=True) == \
            ref.num_parameters(only_trainable=True) == 2 * (256 + 192)
        for x in _ids(3):
            mask = torch.ones_like(x)
            mask[1, 7:] = 0
            labels = x.masked_fill(mask == 0, -100)
            assert _step_both(engine, ref, opt, lambda m: m(
                input_ids=x, attention_mask=mask, labels=labels).loss) < 1e-6
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            if "lora" in k:
                torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")
                assert not torch.equal(sd[k], start[k]), k
            else:
                assert torch.equal(sd[k], start[k]), k
        adapters = [m for n, m in engine.module.named_modules() if n.split(".")[-1] in
                    ("lora_A", "lora_B")]
        with engine.full_weights(adapters) as w:
            got = {k: v.clone() for k, v in w.items()}
        assert len(got) == 8 and all("lora" in k and torch.equal(v, sd[k]) for k, v in got.items())
    finally:
        engine.close()


def test_tuple_outputs_and_hidden_states_of_an_encoder_decoder(engine_cfg):
    """BART with `return_dict=False`, `output_hidden_states=True`, a padding mask and
    labels: the loss from the tuple, a term over the decoder's last hidden state, and
    beam search afterwards, as torch."""
    torch.manual_seed(0)
    ref = _bart()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    try:
        for x in _ids(2):
            mask = torch.ones_like(x)
            mask[1, 8:] = 0
            labels = x[:, :5].clone()

            def loss_of(m):
                out = m(input_ids=x, attention_mask=mask, labels=labels, return_dict=False,
                        output_hidden_states=True)
                assert isinstance(out, tuple)
                return out[0] + 0.01 * out[2][-1].pow(2).mean()  # decoder hidden states
            assert _step_both(engine, ref, opt, loss_of) < 1e-6
        engine.eval(), ref.eval()
        x = _ids(1, seed=5, shape=(2, 8))[0]
        for kw in ({}, {"num_beams": 3}, {"use_cache": False}):
            assert torch.equal(engine.module.generate(x, max_new_tokens=5, **kw),
                               ref.generate(x, max_new_tokens=5, **kw)), kw
    finally:
        engine.close()


# -- bugs ------------------------------------------------------------------------------

def test_checkpoint_dir_loads_the_persistent_buffers_save_pretrained_wrote(engine_cfg, tmp_path):
    torch.manual_seed(0)
    ref = _bart()
    with torch.no_grad():
        ref.final_logits_bias.normal_()  # a persistent buffer, in the saved file
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    try:
        want = engine.state_dict()
        engine.save_pretrained(tmp_path / "out")
    finally:
        engine.close()
    saved = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(saved["final_logits_bias"], ref.final_logits_bias)
    # transformers loads it back
    loaded = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.final_logits_bias, ref.final_logits_bias)
    cfg = _cfg(engine_cfg)
    cfg["io"]["paths"] = [str(tmp_path / "swap2")]
    engine = offload.initialize(_bart, cfg, checkpoint=tmp_path / "out")
    try:
        got = engine.state_dict()
        assert torch.equal(got["final_logits_bias"], want["final_logits_bias"])
    finally:
        engine.close()


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=11,
        max_position_embeddings=32))


def _neox():
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32))


def _nomic():
    return transformers.AutoModel.from_config(transformers.AutoConfig.for_model(
        "nomic_bert", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
        pad_token_id=0))


def _sarvam():  # a GQA qkv stored fused, split by sizes (transformers' Split)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "sarvam_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=2, num_experts_per_tok=1,
        first_k_dense_replace=1, max_position_embeddings=32))


@pytest.mark.parametrize("build", [_mixtral, _neox, _nomic, _sarvam],
                         ids=["mixtral", "gpt-neox", "nomic", "sarvam-gqa"])
def test_checkpoint_dir_in_the_layout_transformers_stores(engine_cfg, tmp_path, caplog, build):
    """[Note: transformers' conversions]: transformers 5 stores Mixtral's experts one
    tensor each, GPT-NeoX's head as `embed_out` and NomicBERT's q, k and v as one
    `Wqkv`, and converts them as it loads; `checkpoint=` does too (the experts and
    the head were left at random init, the split refused)."""
    import logging
    pytest.importorskip("transformers.conversion_mapping",
                        reason="transformers before 5 stores the modules' own names")
    torch.manual_seed(0)
    ref = build()
    ref.save_pretrained(tmp_path / "hf")
    stored = set()
    for f in (tmp_path / "hf").glob("*.safetensors"):
        stored |= set(safetensors_torch.load_file(f))
    assert not stored <= set(ref.state_dict())  # the stored layout is not the modules'
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(build, _cfg(engine_cfg), checkpoint=tmp_path / "hf") as engine:
        got = engine.state_dict()
        x = torch.randint(0, VOCAB, (2, 8))
        engine.eval()
        with torch.no_grad():
            out = engine(x)[0]
    assert "not in checkpoint" not in caplog.text and "match no" not in caplog.text
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():
        assert torch.equal(out, ref.eval()(x)[0])


@pytest.mark.xfail(strict=True, reason=(
    "Documented limitation (docs/model.md, 'Freezing'): with engine.dtype bf16/fp16 a "
    "frozen group has no fp32 master and keeps only its compute-dtype partition, so "
    "full_weights(), state_dict(), save_pretrained() and checkpoints give an fp32 base "
    "frozen for LoRA rounded to bf16 (max error ~2e-4 here). Keeping it exact would need "
    "an fp32 record per frozen group (read_group/_write_param and the training checkpoint "
    "reading it), at twice the frozen base's bytes."))
def test_bf16_engine_keeps_frozen_fp32_weights_exact(engine_cfg):
    torch.manual_seed(0)
    ref = _with_lora(_llama())
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, dtype="bf16"))
    try:
        sd = engine.state_dict()
        changed = [k for k, v in ref.state_dict().items() if not torch.equal(sd[k], v)]
        assert changed == [], changed
    finally:
        engine.close()


def test_checkpoint_dir_of_a_pretrained_body_with_a_new_head(engine_cfg, tmp_path, caplog):
    """[Note: weights a checkpoint lacks] The standard fine-tuning start: a pretrained
    body and a new task head. The head (and the pooler the masked-LM lacks) raised
    KeyError; now they keep the model's init (CPU-built) or get it (built on meta),
    named in one warning, as from_pretrained does. A checkpoint of another model,
    holding none of the parameters, is refused."""
    import logging
    torch.manual_seed(0)
    transformers.BertForMaskedLM(_bert_config()).save_pretrained(tmp_path / "pre")
    model = transformers.BertForSequenceClassification(_bert_config(num_labels=3))
    head = model.classifier.weight.detach().clone()
    saved = safetensors_torch.load_file(tmp_path / "pre" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine = offload.initialize(model, _cfg(engine_cfg), checkpoint=tmp_path / "pre")
    try:
        sd = engine.state_dict()
        assert torch.equal(sd["bert.embeddings.word_embeddings.weight"],
                           saved["bert.embeddings.word_embeddings.weight"])
        assert torch.equal(sd["classifier.weight"], head)
    finally:
        engine.close()
    (warning,) = [r.getMessage() for r in caplog.records if "not in checkpoint" in r.getMessage()]
    assert "classifier.weight" in warning and "bert.pooler.dense.weight" in warning, warning
    with torch.device("meta"):
        meta = transformers.BertForSequenceClassification(_bert_config(num_labels=3))
    with offload.initialize(meta, _cfg(engine_cfg), checkpoint=tmp_path / "pre") as engine:
        sd = engine.state_dict()
        assert torch.equal(sd["bert.encoder.layer.0.attention.self.query.weight"],
                           saved["bert.encoder.layer.0.attention.self.query.weight"])
        w = sd["classifier.weight"]  # _init_weights: normal(0, initializer_range), bias 0
        assert torch.isfinite(w).all() and 0 < w.std() < 0.1 and not sd["classifier.bias"].any()
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"holds none of the model's parameters"):
        offload.initialize(transformers.BertForSequenceClassification(_bert_config()),
                           _cfg(engine_cfg), checkpoint=tmp_path / "other")


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_that_are_whole_units_train_as_torch(engine_cfg, reentrant):
    """transformers' checkpointed decoder layers recompute by calling their forward
    themselves, running no module hook: where a layer is one unit (group_size at
    least its parameters) the recomputation found the weights absent and the
    backward raised. The unit's backward hook now binds what it gathers
    ([Note: recomputation without the unit's hooks]); training matches torch."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                                   max_position_embeddings=32)
    ref = transformers.LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    per_layer = sum(p.numel() for p in ref.model.layers[0].parameters())
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    model.gradient_checkpointing_enable(**kwargs)
    ref.gradient_checkpointing_enable(**kwargs)
    c = engine_cfg("host", group_size=per_layer)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    with offload.initialize(model, c) as engine:
        assert "model.layers.0" in [u.name for u in engine.units]
        for k in range(3):
            x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(k))
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            opt.zero_grad()
            ref(input_ids=x, labels=x).loss.backward()
            opt.step()
        sd = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def test_an_export_in_another_dtype_leaves_the_models_config(engine_cfg, tmp_path):
    """save_pretrained(dir, dtype="bf16") wrote bf16 into the live model's config (its
    own object), where only the exported config.json should say it."""
    engine = offload.initialize(_bart(), _cfg(engine_cfg))
    try:
        before = engine.module.config.to_dict().get("dtype")
        engine.save_pretrained(tmp_path / "out", dtype="bf16")
        assert engine.module.config.to_dict().get("dtype") == before
    finally:
        engine.close()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == "bfloat16", written


def test_the_models_public_attributes_are_the_engines(engine_cfg):
    """engine.config (generation_config, can_generate(), main_input_name): the wrapped
    model's, as DeepSpeed's and FSDP's wrappers give them; a name neither has is an
    AttributeError naming both, and private names are never looked up in the model."""
    model = _bart()
    engine = offload.initialize(model, _cfg(engine_cfg))
    try:
        assert engine.config is model.config and engine.main_input_name == "input_ids"
        assert engine.generation_config is model.generation_config and engine.can_generate()
        with pytest.raises(AttributeError, match="nor has the model it wraps"):
            engine.no_such_attribute
        model._only_the_models = 1
        assert not hasattr(engine, "_only_the_models")
    finally:
        engine.close()
