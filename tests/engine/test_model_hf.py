"""Hugging Face models through the engine as through plain PyTorch: parameters, weights
after training, evaluation and `generate()` between steps, `save_pretrained` round trip."""

import copy
import json

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")

PLACEMENTS = {"none": ("device", "host", "host"), "host": ("host", "host", "nvme"),
              "nvme": ("nvme", "nvme", "nvme")}


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=None, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


BUILDS = {"gpt2": _gpt2, "llama": _llama}


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 12), generator=g) for _ in range(n)]


def _engine(engine_cfg, build, placement, dtype="fp32"):
    torch.manual_seed(0)
    ref = BUILDS[build]()
    cfg = engine_cfg(*PLACEMENTS[placement], dtype=dtype, group_size=5000)
    cfg["optim"]["eps"] = 1e-6  # see test_hf.py
    return offload.initialize(copy.deepcopy(ref), cfg), ref


def _step(engine, ref, opt, x):
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    opt.zero_grad()
    ref(input_ids=x, labels=x).loss.backward()
    opt.step()


def _assert_params(got, ref, atol):
    """`got` (name -> tensor) holds `ref`'s parameters, within `atol`."""
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n], q.detach(), atol=atol, rtol=0,
                                   msg=lambda m: f"{n}: {m}")


def _generate(model, prompt, sample):
    torch.manual_seed(11)
    kw = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
    return model.generate(prompt, max_new_tokens=10, pad_token_id=0, **kw)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("build", list(BUILDS))
def test_parameters_weights_eval_and_generate_match_torch(engine_cfg, build, placement):
    engine, ref = _engine(engine_cfg, build, placement)
    model = engine.module
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    batches = _batches(4)
    try:
        assert [(n, p.shape) for n, p in model.named_parameters()] == [
            (n, p.shape) for n, p in ref.named_parameters()]
        assert model.num_parameters() == ref.num_parameters()
        assert list(engine.state_dict()) == list(ref.state_dict())
        for x in batches[:2]:
            _step(engine, ref, opt, x)
        with engine.full_weights() as w:
            _assert_params(w, ref, atol=3e-6)
        plan = list(engine.trace.plan)
        engine.eval(), ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=batches[2]).logits,
                                       ref(input_ids=batches[2]).logits, atol=2e-5, rtol=0)
        prompt = batches[2][:, :4]
        for sample in (False, True):
            got = _generate(model, prompt, sample)
            assert torch.equal(got, _generate(ref, prompt, sample)), sample
            assert torch.equal(engine.generate(prompt, max_new_tokens=10, pad_token_id=0,
                                               do_sample=False), _generate(ref, prompt, False))
        engine.train(), ref.train()
        assert engine.trace.plan == plan and engine.trace.position == -1
        _step(engine, ref, opt, batches[3])  # training goes on as if nothing happened
        _assert_params(engine.state_dict(), ref, atol=5e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("build", list(BUILDS))
def test_bf16_generate_matches_torch_in_bf16(engine_cfg, build):
    """bf16 compute: the tokens of a plain model cast to bf16 with the engine's weights."""
    engine, _ = _engine(engine_cfg, build, "nvme", dtype="bf16")
    try:
        low = BUILDS[build]()
        low.load_state_dict(engine.state_dict())
        low = low.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        prompt = _batches(1, seed=2)[0][:, :5]
        for sample in (False, True):
            assert torch.equal(_generate(engine.module, prompt, sample),
                               _generate(low, prompt, sample)), sample
    finally:
        engine.close()


def test_transformers_save_pretrained_needs_the_full_weights(engine_cfg, tmp_path):
    """transformers' own save_pretrained of the hollow model raises naming the way out;
    inside `full_weights()` it writes the model as from a plain one."""
    engine, ref = _engine(engine_cfg, "gpt2", "nvme")
    try:
        with pytest.raises(RuntimeError, match=r"engine\.save_pretrained\(dir\)"):
            engine.module.save_pretrained(tmp_path / "hollow")
        with engine.full_weights():
            engine.module.save_pretrained(tmp_path / "full")
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    finally:
        engine.close()


@pytest.mark.parametrize("placement,dtype", [("none", "fp32"), ("host", "bf16"),
                                             ("nvme", "fp32")])
@pytest.mark.parametrize("build", list(BUILDS))
def test_save_pretrained_round_trip_through_transformers(engine_cfg, tmp_path, build, placement,
                                                         dtype):
    engine, ref = _engine(engine_cfg, build, placement, dtype)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    try:  # first the initial weights: the plain model's, fp32 (bf16 computes from them)
        engine.save_pretrained(tmp_path / "start")
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start").state_dict()
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
        _step(engine, ref, opt, _batches(1, seed=3)[0])  # weights moved from the start
        want = engine.state_dict()
        files = engine.save_pretrained(tmp_path / "out", max_shard_size="20KB")
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert len({f.name for f in files if f.suffix == ".safetensors"}) > 1
        assert set(index["weight_map"]) <= set(want)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        assert type(loaded) is type(ref)
        got = loaded.state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype == torch.float32, k
            assert torch.equal(got[k], v), k
        with pytest.raises(FileExistsError, match="already holds safetensors"):
            engine.save_pretrained(tmp_path / "out")
    finally:
        engine.close()
