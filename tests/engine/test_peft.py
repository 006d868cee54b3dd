"""A peft LoRA model under the engine, against the same model trained by torch's AdamW:
the numbers, saving the adapters, and what the engine refuses of it (an export in the
base model's layout, a change of structure inside a full_weights block)."""

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=None, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


def _lora_llama():
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    return peft.get_peft_model(_llama(), lora)


def _ids(seed):
    return torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def _cfg(engine_cfg):
    cfg = engine_cfg("host", "host", "host", group_size=3000)
    cfg["optim"]["eps"] = 1e-6
    return cfg


def _pair(engine_cfg):
    """A LoRA model under the engine, its torch twin and the twin's AdamW."""
    torch.manual_seed(0)
    ref = _lora_llama()
    engine = offload.initialize(copy.deepcopy(ref), _cfg(engine_cfg))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1, eps=1e-6)
    return engine, ref, opt


def _step(engine, ref, opt, x):
    engine.backward(engine(input_ids=x, labels=x).loss)
    assert engine.step()
    opt.zero_grad()
    ref(input_ids=x, labels=x).loss.backward()
    opt.step()


def _max_diff(engine, ref):
    sd = engine.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_lora_trains_as_torch_and_its_adapters_save_as_peft_does(engine_cfg, tmp_path):
    """Only the adapters train (the base frozen by peft), to torch's numbers; peft's own
    save_pretrained inside a full_weights block writes the trained adapters. The
    engine's save_pretrained wrote the wrapper's names beside the base model's
    config.json, which from_pretrained loaded as a new model without a word: it is
    refused, naming peft's save, before anything is written."""
    engine, ref, opt = _pair(engine_cfg)
    try:
        for i in range(3):
            _step(engine, ref, opt, _ids(i))
        assert _max_diff(engine, ref) < 1e-5
        with pytest.raises(ValueError, match=r"peft PeftModel.*full_weights.*"
                                             r"nothing was written"):
            engine.save_pretrained(tmp_path / "export")
        assert not (tmp_path / "export").exists()
        with engine.full_weights():
            engine.module.save_pretrained(tmp_path / "adapters")
    finally:
        engine.close()
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "adapters")
    want = {k: v for k, v in ref.state_dict().items() if "lora_" in k}
    got = loaded.state_dict()
    assert want and all(torch.allclose(got[k], v, atol=1e-5) for k, v in want.items())


def test_a_block_that_changes_the_models_modules_is_refused_and_puts_them_back(engine_cfg):
    """merge_and_unload() inside full_weights(writable=True) replaced the LoRA layers with
    their base layers: the block passed, wrote the merged weights, and every later
    forward and state_dict raised, naming the wrong cause. The modules are put back,
    nothing is written, and training goes on as torch's."""
    engine, ref, opt = _pair(engine_cfg)
    try:
        _step(engine, ref, opt, _ids(0))
        layers = engine.module.get_base_model().model.layers
        before = [layer.self_attn.q_proj for layer in layers]
        with pytest.raises(ValueError, match=r"changed the model's modules .*layers.0."
                                             r"self_attn.q_proj'.*nothing was written"):
            with engine.full_weights(writable=True):
                engine.module.merge_and_unload()
        assert [layer.self_attn.q_proj for layer in layers] == before
        assert _max_diff(engine, ref) < 1e-5
        _step(engine, ref, opt, _ids(1))
        assert _max_diff(engine, ref) < 1e-5
    finally:
        engine.close()
