"""What a Hugging Face + DeepSpeed/FSDP user does with `offload.initialize(model, cfg)`,
checked against plain PyTorch (`torch.optim.AdamW` on a deepcopy): masked training of
decoder, encoder and encoder-decoder models, gradient checkpointing switched on after
initialize, dropout, a frozen base, generation modes beyond greedy and sampling, bf16,
accessors, export round trips, resume, and the refusals of what is not supported.
test_model_hf.py and test_hf.py hold the plain GPT-2 / Llama cases; not repeated here."""

import copy
import datetime

import pytest
import torch

import offload

from .ranks import spawn

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _gpt2(dropout=0.0, **kw):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_pdrop=dropout, bos_token_id=None, eos_token_id=None, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=None, eos_token_id=None, **kw)
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


BUILDS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "t5": _t5}


def _ids(n, seed=1, shape=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, shape, generator=g) for _ in range(n)]


def _cfg(engine_cfg, placement=("device", "host", "host"), **engine):
    cfg = engine_cfg(*placement, group_size=5000, **engine)
    cfg["optim"]["eps"] = 1e-6  # GPT-2's key bias: see test_hf.py
    return cfg


def _adamw(ref):
    return torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                             weight_decay=0.1, eps=1e-6)


def _max_diff(engine, ref):
    sd = engine.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()
               if v.is_floating_point())


def _step_both(engine, ref, opt, loss_of, seed=None) -> float:
    """One step on both, `loss_of(model)` the loss (the engine's model, then `ref`);
    the loss difference. `seed`: the same dropout masks on both."""
    if seed is not None:
        torch.manual_seed(seed)
    loss = loss_of(engine.module)
    engine.backward(loss)
    engine.step()
    if seed is not None:
        torch.manual_seed(seed)
    opt.zero_grad()
    ref_loss = loss_of(ref)
    ref_loss.backward()
    opt.step()
    return abs(loss.item() - ref_loss.item())


def _losses(engine, batches) -> list[float]:
    """One step per batch; each step's loss."""
    out = []
    for x in batches:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _train_both(engine, ref, opt, batches, seeded=False, **kw):
    """One step per batch on both; the largest loss difference."""
    return max(_step_both(engine, ref, opt, lambda m: m(input_ids=x, labels=x, **kw).loss,
                          100 + i if seeded else None) for i, x in enumerate(batches))


# -- training ------------------------------------------------------------------------

@pytest.mark.parametrize("build", list(BUILDS))
def test_masked_training_matches_adamw(engine_cfg, build):
    """Padding masks and -100 labels (decoder, encoder, encoder-decoder; tied and untied
    heads): `outputs.loss` and the weights as in torch."""
    torch.manual_seed(0)
    ref = BUILDS[build]()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    try:
        for x in _ids(3):
            mask = torch.ones_like(x)
            mask[1, 7:] = 0
            labels = x[:, :6].clone() if build == "t5" else x.masked_fill(mask == 0, -100)
            assert _step_both(engine, ref, opt, lambda m: m(
                input_ids=x, attention_mask=mask, labels=labels).loss) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_enabled_after_initialize_with_dropout(engine_cfg, reentrant):
    """`gradient_checkpointing_enable()` on the engine's model after initialize, dropout on:
    the recomputation replays the same masks; then disabled again. Torch with the same
    switches gives the same numbers (with checkpointing, torch itself differs from
    torch without it by ~4e-6 here)."""
    torch.manual_seed(0)
    ref = _gpt2(dropout=0.3)
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    try:
        for model in (engine.module, ref):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert engine.module.is_gradient_checkpointing
        assert _train_both(engine, ref, opt, _ids(2), seeded=True) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
        engine.module.gradient_checkpointing_disable(), ref.gradient_checkpointing_disable()
        assert _train_both(engine, ref, opt, _ids(2, seed=4), seeded=True) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


def test_frozen_base_with_checkpointing_trains_and_resumes_as_torch(engine_cfg, tmp_path):
    """LoRA-style: most parameters frozen before initialize, reentrant checkpointing with
    `enable_input_require_grads()`; counts of trainable parameters as transformers gives
    them; save, resume on a meta-built model, and the same weights as without a stop."""
    def build():
        model = _llama()
        for n, p in model.named_parameters():
            p.requires_grad_("layers.1.mlp" in n)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
        return model

    torch.manual_seed(0)
    ref = build()
    cfg = _cfg(engine_cfg)
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    opt = _adamw(ref)
    batches = _ids(4)
    try:
        for only_trainable in (False, True):
            assert engine.module.num_parameters(only_trainable=only_trainable) == \
                ref.num_parameters(only_trainable=only_trainable)
        assert _train_both(engine, ref, opt, batches[:2]) < 1e-5
        engine.save_checkpoint(tmp_path / "ckpt")
        assert _train_both(engine, ref, opt, batches[2:]) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
        want = engine.state_dict()
    finally:
        engine.close()
    with torch.device("meta"):
        model = build()
    cfg["io"]["paths"] = [str(tmp_path / "swap2")]
    engine = offload.initialize(model, cfg, resume=tmp_path / "ckpt")
    try:
        for x in batches[2:]:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        got = engine.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        engine.close()


def test_frozen_weights_a_recomputation_saves_are_not_taken_for_kept_ones(engine_cfg, caplog):
    """Frozen norms under non-reentrant checkpointing: the recomputation keeps each
    frozen weight it saves (one that needs no gradient) as the view itself until the
    node that reads it runs. The engine freed the group at the next unit's backward,
    took that view for one the model kept ("still referenced after the unit"), and
    left the gathered storage with it, outside the budgets. Now the group waits for
    the node; no warning, and torch's numbers."""
    def build():
        model = _llama()
        for n, p in model.named_parameters():
            p.requires_grad_("layernorm" not in n)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False})
        return model

    torch.manual_seed(0)
    ref = build()
    cfg = engine_cfg("device", "host", "host", group_size=3000)  # norms: groups of their own
    cfg["optim"]["eps"] = 1e-6
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    try:
        with caplog.at_level("WARNING", logger="offload"):
            assert _train_both(engine, ref, _adamw(ref), _ids(2)) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()
    assert not [r for r in caplog.records if "still referenced" in r.getMessage()]


@pytest.mark.parametrize("build", ["t5", "bart"])
def test_encoder_decoder_generate_as_one_small_model_matches_transformers(engine_cfg, build):
    """[Note: modules called from outside their parent] in units.py: transformers'
    encoder-decoder `generate` calls the encoder by itself, and a model small enough
    to be one unit (the default group_size holds any under 4.19M parameters) raised
    "parameter 'shared.weight' is used outside the forward of unit '<root>'"."""
    torch.manual_seed(0)
    if build == "t5":
        ref = _t5()
    else:
        ref = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=32))
    cfg = engine_cfg("nvme", "host", "host")
    cfg["engine"].pop("group_size", None)  # the default: the whole model fits one unit
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    try:
        x = _ids(1, shape=(2, 8))[0]
        ref.eval(), engine.eval()
        want = ref.generate(x, max_new_tokens=5, do_sample=False)
        assert torch.equal(engine.generate(x, max_new_tokens=5, do_sample=False), want)
        assert torch.equal(engine.module.generate(x, max_new_tokens=5, do_sample=False), want)
    finally:
        engine.close()


def test_resume_restores_the_dropout_rng(engine_cfg, tmp_path):
    """GPT-2 with dropout: 2 steps, save, 2 steps equals resume (meta-built) and 2 steps,
    bit for bit: the RNG state travels with the checkpoint."""
    cfg = _cfg(engine_cfg)
    batches = _ids(4)
    torch.manual_seed(0)
    engine = offload.initialize(_gpt2(dropout=0.2), cfg)
    try:
        for x in batches[:2]:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        losses = _losses(engine, batches[2:])
        want = engine.state_dict()
    finally:
        engine.close()
    torch.manual_seed(123)  # whatever the new process's RNG holds
    cfg["io"]["paths"] = [str(tmp_path / "swap2")]
    engine = offload.initialize(lambda: _gpt2(dropout=0.2), cfg, resume=tmp_path / "ckpt")
    try:
        assert _losses(engine, batches[2:]) == losses
        got = engine.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        engine.close()


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_bf16_training_matches_torch_mixed_precision(engine_cfg, build):
    """bf16 compute, fp32 masters: as torch with a bf16 copy for forward and backward (its
    floating buffers kept fp32, as the engine keeps them) and AdamW on fp32 masters."""
    torch.manual_seed(0)
    ref = BUILDS[build]()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, dtype="bf16"))
    low = copy.deepcopy(ref).to(torch.bfloat16)
    for mod, ref_mod in zip(low.modules(), ref.modules()):
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = ref_mod._buffers[name].clone()
    opt = _adamw(ref)
    try:
        assert engine.module.dtype == torch.bfloat16
        for x in _ids(3):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            with torch.no_grad():
                for p, q in zip(low.parameters(), ref.parameters()):
                    p.copy_(q)
            low.zero_grad()
            ref_loss = low(input_ids=x, labels=x).loss
            ref_loss.backward()
            for p, q in zip(low.parameters(), ref.parameters()):
                q.grad = p.grad.float()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        assert _max_diff(engine, ref) < 1e-6
    finally:
        engine.close()


def test_sequence_classification_with_token_types_and_padding(engine_cfg):
    torch.manual_seed(0)
    ref = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, ("host", "host", "host")))
    opt = _adamw(ref)
    g = torch.Generator().manual_seed(3)
    try:
        for _ in range(3):
            x = torch.randint(2, VOCAB, (4, 10), generator=g)
            kw = {"attention_mask": torch.ones_like(x), "token_type_ids": torch.zeros_like(x),
                  "labels": torch.randint(0, 3, (4,), generator=g)}
            kw["attention_mask"][0, 6:] = 0
            kw["token_type_ids"][:, 5:] = 1
            engine.backward(engine(input_ids=x, **kw).loss)
            engine.step()
            opt.zero_grad()
            ref(input_ids=x, **kw).loss.backward()
            opt.step()
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


def test_inputs_embeds_and_a_loss_over_hidden_states(engine_cfg):
    """`get_input_embeddings()(ids)` called directly, `inputs_embeds=`, and a loss over
    `output_hidden_states` / eager attentions (tuples of intermediate units' outputs)."""
    torch.manual_seed(0)
    ref = _gpt2()
    ref.set_attn_implementation("eager")
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)

    def loss_of(model, x):
        out = model(inputs_embeds=model.get_input_embeddings()(x), output_hidden_states=True,
                    output_attentions=True)
        return (sum(h.pow(2).mean() for h in out.hidden_states) + out.attentions[0].mean()
                + out.logits.logsumexp(-1).mean())
    try:
        for x in _ids(3):
            assert _step_both(engine, ref, opt, lambda m: loss_of(m, x)) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


# -- evaluation and generation ----------------------------------------------------------

GENERATE = {"beam": {"num_beams": 3, "num_return_sequences": 2},
            "beam-sample": {"num_beams": 2, "do_sample": True},
            "no-cache": {"use_cache": False},
            "scores": {"return_dict_in_generate": True, "output_scores": True}}


def left_padded(x):
    """The attention mask of a batch of two prompts, the second left-padded by 2."""
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    return mask


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_generation_modes_and_kv_cache_match_torch(engine_cfg, build):
    """Beam search, beam sampling, no cache and scores, with a left-padded batch, through
    `engine.generate` and `engine.module.generate`; and a forward fed the cache of the
    one before, as a hand-written decoding loop does."""
    torch.manual_seed(0)
    ref = BUILDS[build]()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, ("host", "host", "host")))
    x = _ids(1, seed=2, shape=(2, 5))[0]
    mask = left_padded(x)
    try:
        engine.eval(), ref.eval()
        for mode, kw in GENERATE.items():
            for generate in (engine.generate, engine.module.generate):
                kw = {"attention_mask": mask, "max_new_tokens": 6, "pad_token_id": 0, **kw}
                torch.manual_seed(3)
                got = generate(x, **kw)
                torch.manual_seed(3)
                want = ref.generate(x, **kw)
                if mode == "scores":
                    assert torch.equal(got.sequences, want.sequences)
                    for s, t in zip(got.scores, want.scores):
                        torch.testing.assert_close(s, t, atol=1e-5, rtol=0)
                else:
                    assert torch.equal(got, want), mode
        with torch.no_grad():
            first, ref_first = engine(input_ids=x, use_cache=True), ref(input_ids=x, use_cache=True)
            nxt = first.logits[:, -1:].argmax(-1)
            got = engine(input_ids=nxt, past_key_values=first.past_key_values).logits
            want = ref(input_ids=nxt, past_key_values=ref_first.past_key_values).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_encoder_decoder_trains_then_generates_as_torch(engine_cfg):
    torch.manual_seed(0)
    ref = _t5()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    try:
        for x in _ids(2):
            labels = x[:, :4].clone()
            engine.backward(engine(input_ids=x, labels=labels).loss)
            engine.step()
            opt.zero_grad()
            ref(input_ids=x, labels=labels).loss.backward()
            opt.step()
        engine.eval(), ref.eval()
        x = _ids(1, seed=5, shape=(2, 8))[0]
        for kw in ({}, {"num_beams": 3}, {"do_sample": True, "top_k": 0}):
            torch.manual_seed(3)
            got = engine.module.generate(x, max_new_tokens=6, **kw)
            torch.manual_seed(3)
            assert torch.equal(got, ref.generate(x, max_new_tokens=6, **kw)), kw
    finally:
        engine.close()


def test_eval_modes_no_grad_loops_and_dropout(engine_cfg):
    """`model.eval()` on the engine's model (not the engine) turns dropout off; `no_grad`
    and `inference_mode` loops give torch's logits and losses, also between the
    micro-batches of an accumulated step; in train mode the same seed drops the same
    units as torch."""
    torch.manual_seed(0)
    ref = _gpt2(dropout=0.5)
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, grad_accum_steps=2))
    model = engine.module
    opt = _adamw(ref)
    held_out = _ids(2, seed=7)
    try:
        model.eval(), ref.eval()
        with torch.no_grad():
            for x in held_out:
                assert engine(input_ids=x, labels=x).loss.item() == \
                    ref(input_ids=x, labels=x).loss.item()
        with torch.inference_mode():
            torch.testing.assert_close(model(input_ids=held_out[0]).logits,
                                       ref(input_ids=held_out[0]).logits, atol=0, rtol=0)
        model.train(), ref.train()
        torch.manual_seed(7)
        got = engine(input_ids=held_out[0]).logits
        torch.manual_seed(7)
        torch.testing.assert_close(got, ref(input_ids=held_out[0]).logits, atol=0, rtol=0)
        opt.zero_grad()
        for i, x in enumerate(_ids(2)):  # one accumulated step of two micro-batches
            torch.manual_seed(i)
            engine.backward(engine(input_ids=x, labels=x).loss)
            stepped = engine.step()
            torch.manual_seed(i)
            (ref(input_ids=x, labels=x).loss / 2).backward()
            if stepped:
                opt.step()
            model.eval(), ref.eval()
            with torch.no_grad():
                y = held_out[1]
                assert engine(input_ids=y, labels=y).loss.item() == pytest.approx(
                    ref(input_ids=y, labels=y).loss.item(), abs=1e-6)
            model.train(), ref.train()
        assert stepped
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


# -- the model's API after initialize ---------------------------------------------------

@pytest.mark.parametrize("build,tied", [("gpt2", True), ("llama", False), ("t5", True)])
def test_model_accessors_read_as_on_the_plain_model(engine_cfg, build, tied):
    torch.manual_seed(0)
    ref = BUILDS[build]()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, dtype="bf16"))
    model = engine.module
    try:
        assert model.config is engine.module.config and model.config.vocab_size == VOCAB
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(emb, torch.nn.Embedding) and emb.weight.shape == (VOCAB, 32)
        assert (emb.weight is head.weight) == tied == (
            ref.get_input_embeddings().weight is ref.get_output_embeddings().weight)
        assert emb.weight.requires_grad and emb.weight.dtype == torch.bfloat16
        for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
            assert model.num_parameters(**kw) == ref.num_parameters(**kw), kw
        assert (model.dtype, model.device) == (torch.bfloat16, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="engine.dtype"):
            model.float()
        with pytest.raises(RuntimeError, match=r"engine\.full_weights"):
            emb.weight.sum()
    finally:
        engine.close()


@pytest.mark.parametrize("build,auto", [("bert", "AutoModelForMaskedLM"),
                                        ("t5", "AutoModelForSeq2SeqLM"),
                                        ("gpt2-untied", "AutoModelForCausalLM")])
def test_save_pretrained_round_trip_of_encoders_and_seq2seq(engine_cfg, tmp_path, build, auto):
    """After a step, `engine.save_pretrained` then `Auto*.from_pretrained`: the same weights,
    ties as in the plain model, the same logits."""
    torch.manual_seed(0)
    ref = _gpt2(tie_word_embeddings=False) if build == "gpt2-untied" else BUILDS[build]()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg, ("host", "host", "host")))
    x = _ids(1)[0]
    kw = {"labels": x[:, :4].clone() if build == "t5" else x}
    try:
        engine.backward(engine(input_ids=x, **kw).loss)
        engine.step()
        engine.save_pretrained(tmp_path / "out")
        loaded = getattr(transformers, auto).from_pretrained(tmp_path / "out")
        assert type(loaded) is type(ref)
        want, got = engine.state_dict(), loaded.state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert (loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight) \
            == (ref.get_input_embeddings().weight is ref.get_output_embeddings().weight)
        engine.eval(), loaded.eval()
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=x, **kw).logits,
                                       loaded(input_ids=x, **kw).logits, atol=0, rtol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_resize_token_embeddings_before_initialize(engine_cfg, build):
    torch.manual_seed(0)
    ref = BUILDS[build]()
    ref.resize_token_embeddings(104, mean_resizing=False)
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = _adamw(ref)
    try:
        assert engine.module.get_input_embeddings().weight.shape == (104, 32)
        assert engine.module.config.vocab_size == 104
        g = torch.Generator().manual_seed(1)
        assert _train_both(engine, ref, opt, [torch.randint(90, 104, (2, 8), generator=g)]) < 1e-5
        assert _max_diff(engine, ref) < 3e-6
    finally:
        engine.close()


# -- what changes the model's parameters after initialize is refused -----------------------

def test_resize_token_embeddings_after_initialize_is_refused_and_changes_nothing(engine_cfg):
    """Refused naming the call and the fix (resize before initialize), before anything
    changes: also inside `full_weights(writable=True)`, where the absent-weight message
    sends the user, and where transformers has already set `config.vocab_size` and
    `num_embeddings` when the engine refuses the new shape."""
    torch.manual_seed(0)
    engine = offload.initialize(_gpt2(), _cfg(engine_cfg))
    model = engine.module
    try:
        with pytest.raises(RuntimeError, match=r"resize_token_embeddings.*initialize"):
            model.resize_token_embeddings(104)
        with pytest.raises(RuntimeError, match=r"resize_token_embeddings.*nothing was changed"):
            with engine.full_weights(writable=True):
                model.resize_token_embeddings(104)
        assert model.config.vocab_size == VOCAB
        assert model.get_input_embeddings().num_embeddings == VOCAB
        x = _ids(1)[0]
        engine.backward(engine(input_ids=x, labels=x).loss)  # GPT-2's loss reads vocab_size
        assert engine.step()
    finally:
        engine.close()


def test_tie_weights_that_would_tie_anew_after_initialize_is_refused(engine_cfg):
    """An untied Llama whose config.tie_word_embeddings was set after initialize:
    tie_weights() put the embedding's stand-in in the head's place, then every forward,
    state_dict and export failed, naming torch.func, with the head's own parameter out
    of reach. The tie is undone and refused, naming it; a tied model's tie_weights()
    (which ties nothing new) goes through, and both train on."""
    torch.manual_seed(0)
    for tied in (False, True):
        engine = offload.initialize(_llama(tie_word_embeddings=tied), _cfg(engine_cfg))
        model = engine.module
        try:
            before = dict(engine.state_dict())
            model.config.tie_word_embeddings = True
            if tied:
                model.tie_weights()
            else:
                with pytest.raises(RuntimeError, match=r"tie_weights .* 'lm_head.weight' anew"):
                    model.tie_weights()
            assert set(engine.state_dict()) == set(before)
            x = _ids(1)[0]
            engine.backward(engine(input_ids=x, labels=x).loss)
            assert engine.step()
        finally:
            engine.close()


def test_state_dict_refuses_a_parameter_replaced_after_initialize(engine_cfg, tmp_path):
    """`set_input_embeddings(new)` after initialize: training never sees the new weights
    (nor updates them), so `save_pretrained` refuses naming the parameter; `state_dict`
    must too, instead of returning the new, untrained tensor under the old name."""
    torch.manual_seed(0)
    engine = offload.initialize(_llama(), _cfg(engine_cfg))
    try:
        engine.module.set_input_embeddings(torch.nn.Embedding(VOCAB, 32))
        with pytest.raises(RuntimeError, match="replaced after initialize"):
            engine.save_pretrained(tmp_path / "out")
        with pytest.raises(RuntimeError, match="replaced after initialize"):
            engine.state_dict()
    finally:
        engine.close()


class _Adapter(torch.nn.Module):
    """A LoRA-style wrapper added after initialize: trainable, not in any group."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, 4, bias=False)
        self.up = torch.nn.Linear(4, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("change", ["freeze", "adapter"])
def test_trainable_set_changed_after_initialize_is_not_silently_ignored(engine_cfg, change):
    """A new adapter's weights train in torch once given to the optimizer; the engine
    holds only what initialize saw, so the next backward raises naming the parameter,
    before any gradient or update. Everything frozen after initialize: the loss has
    no gradient, and backward raises torch's own error, changing nothing. Set back,
    training goes on."""
    torch.manual_seed(0)
    engine = offload.initialize(_llama(), _cfg(engine_cfg))
    model = engine.module
    try:
        before = engine.state_dict()
        attn = model.model.layers[0].self_attn
        base = attn.q_proj
        if change == "freeze":
            model.requires_grad_(False)
            match = r"does not require grad"
        else:
            attn.q_proj = _Adapter(base)
            match = r"parameter 'model\.layers\.0\.self_attn\.q_proj\.down\.weight' was " \
                    r"added to the model after initialize"
        x = _ids(1)[0]
        with pytest.raises(RuntimeError, match=match):
            engine.backward(engine(input_ids=x, labels=x).loss)
        assert engine.step() is False  # no backward counted
        if change == "freeze":
            model.requires_grad_(True)
        else:
            attn.q_proj = base
        after = engine.state_dict()
        assert all(torch.equal(after[n], v) for n, v in before.items())
        engine.backward(engine(input_ids=x, labels=x).loss)
        assert engine.step()
    finally:
        engine.close()


def _generate_worker(rank, world, init_file, tmp, prompts, eos, via):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    try:
        cfg = {"engine": {"params": "device", "grads": "host", "optimizer": "host",
                          "group_size": 5000},
               "optim": {"lr": 1e-2, "chunk_elems": 4096},
               "io": {"paths": [f"{tmp}/swap{rank}"], "buffer_budget": "32MiB",
                      "grow_step": "4MiB"},
               "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
        torch.manual_seed(0)
        engine = offload.initialize(_gpt2(), cfg)
        generate = engine.generate if via == "engine" else engine.module.generate
        with torch.no_grad():
            out = generate(prompts[rank], max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
        engine.state_dict(rank0_only=False)  # the next collective: ranks must be in step
        torch.save(out, f"{tmp}/out{rank}")
        engine.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("via", [pytest.param("engine", marks=pytest.mark.slow), "module"])
def test_generate_on_two_ranks_where_one_finishes_first(tmp_path, via):
    """Each rank generates from its own prompt; rank 0's first token is the EOS. Under
    DeepSpeed ZeRO-3 or FSDP transformers sets `synced_gpus` so finished ranks keep
    running forward; through the engine the ranks must stay in step as well and give
    the plain model's tokens."""
    torch.manual_seed(0)
    plain = _gpt2()
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, VOCAB, (1, 4), generator=g)
    eos = plain.generate(first, max_new_tokens=1, pad_token_id=0)[0, -1].item()
    for _ in range(50):  # a second prompt that does not meet the EOS in 6 tokens
        second = torch.randint(2, VOCAB, (1, 4), generator=g)
        if eos not in plain.generate(second, max_new_tokens=6, pad_token_id=0)[0, 4:]:
            break
    spawn(_generate_worker, str(tmp_path / "init"), str(tmp_path), [first, second], eos, via)
    for rank, prompt in enumerate((first, second)):
        want = plain.generate(prompt, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(torch.load(tmp_path / f"out{rank}"), want)
