"""Small transformers models (GPT-2, Llama) built from a config with random weights."""

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 12), generator=g) for _ in range(n)]


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-ckpt"])
def test_hf_matches_adamw(engine_cfg, build, checkpointing):
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    if checkpointing:  # activation checkpointing re-runs forward (and our hooks) in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    cfg = engine_cfg("nvme", "host", "host", group_size=5000)
    # GPT-2's key bias has an analytically zero gradient; its rounding noise (~1e-10)
    # becomes steps of lr * noise / eps, so eps = 1e-6 keeps that noise below 1e-6.
    cfg["optim"]["eps"] = 1e-6
    engine = offload.initialize(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    try:
        for x in _batches(5):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            ref_loss = ref(input_ids=x, labels=x).loss
            opt.zero_grad()
            ref_loss.backward()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            if k in sd:
                torch.testing.assert_close(sd[k], v, atol=3e-6, rtol=0, msg=lambda m: f"{k}: {m}")
        assert set(n for n, _ in ref.named_parameters()) <= set(sd)
    finally:
        engine.close()


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.Qwen2ForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


BUILDS = [_gpt2, _llama, _qwen2, _bert]
BUILD_IDS = ["gpt2", "llama", "qwen2", "bert"]


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_meta_built_hf_model_starts_from_its_own_init(engine_cfg, build):
    """`initialize(lambda: Model(cfg))`: built on meta (buffers too), materialised with
    the model's own `_init_weights`: the same distribution, parameter by parameter,
    as the model built normally (N(0, 0.02) embeddings, zero biases, unit norms)."""
    torch.manual_seed(0)
    want = build().state_dict()
    engine = offload.initialize(build, engine_cfg("nvme", "host", "host", group_size=5000))
    try:
        sd = engine.state_dict()
        for k, v in sd.items():
            w = want[k]
            if torch.all(w == 0) or torch.all(w == 1):
                assert torch.equal(v, w), k
            elif w.numel() >= 512:
                assert 0.8 < v.std() / w.std() < 1.25, (k, v.std(), w.std())
                assert abs(v.mean()) < 0.2 * w.std() + abs(w.mean()) * 1.5, (k, v.mean())
    finally:
        engine.close()


@pytest.mark.parametrize("params,grads,optimizer", [
    ("device", "host", "host"), ("host", "host", "host"), ("nvme", "nvme", "nvme")],
    ids=["none", "host", "nvme"])
@pytest.mark.parametrize("build", [_qwen2, _bert], ids=["qwen2", "bert"])
def test_meta_built_hf_model_trains_like_torch(engine_cfg, build, params, grads, optimizer):
    """Qwen2 and BERT built on meta (their rotary inv_freq, position_ids on meta too)
    train as torch trains the same weights built normally."""
    cfg = engine_cfg(params, grads, optimizer, group_size=5000)
    cfg["optim"]["eps"] = 1e-6
    engine = offload.initialize(build, cfg)
    ref = build()
    ref.load_state_dict(engine.state_dict(), strict=False)  # the engine's initial weights
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6, fused=True)
    try:
        for x in _batches(3, seed=1):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            ref_loss = ref(input_ids=x, labels=x).loss
            opt.zero_grad()
            ref_loss.backward()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        sd = engine.state_dict()
        for k, v in ref.named_parameters():
            torch.testing.assert_close(sd[k], v.detach(), atol=3e-6, rtol=0,
                                       msg=lambda m: f"{k}: {m}")
    finally:
        engine.close()
