"""What the engine's model says when it is handled as a plain model's would be: a torch
optimizer built over its parameters, and transformers' (or peft's) own save_pretrained
outside a full_weights block."""

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg)


def _engine(engine_cfg, build=_gpt2):
    torch.manual_seed(0)
    cfg = engine_cfg("host", "host", "host", group_size=5000)
    cfg["optim"]["eps"] = 1e-6
    return offload.initialize(build(), cfg)


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


# what a loop written for torch builds over model.parameters()
OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "Adam(foreach=False)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
    "Adam(foreach=True)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW(foreach=False)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "SGD(momentum, weight_decay, foreach=False)": lambda ps: torch.optim.SGD(
        ps, lr=1e-3, momentum=0.9, weight_decay=0.01, foreach=False),
    "SGD(momentum, weight_decay, foreach=True)": lambda ps: torch.optim.SGD(
        ps, lr=1e-3, momentum=0.9, weight_decay=0.01, foreach=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
    "Adafactor (transformers)": lambda ps: transformers.optimization.Adafactor(
        ps, lr=1e-3, relative_step=False, scale_parameter=False),
}


def test_a_torch_optimizer_over_the_parameters_names_engine_step(engine_cfg):
    """docs/model.md: a torch optimizer over the parameters raises at its step()
    (Adagrad's as it is made) naming engine.step(). Adam's and AdamW's step touch the
    weight before its gradient (the moments' zeros_like(p), the decoupled weight
    decay), and raised the weight's message instead, pointing to full_weights; SGD got
    the gradient's. Every one now names engine.step(), engine.optimizer and
    optim.max_grad_norm, and changes no weight; a plain read of a weight outside a
    block still names full_weights."""
    engine = _engine(engine_cfg)
    model = engine.module
    try:
        before = engine.state_dict()
        x = _ids()
        for name, make in OPTIMIZERS.items():
            engine.backward(engine(input_ids=x, labels=x).loss)
            with pytest.raises(RuntimeError) as got:  # Adagrad's: as it is made
                make(model.parameters()).step()
            said = str(got.value)
            assert "gradient of parameter 'transformer.wte.weight'" in said, (name, said)
            for part in ("call engine.step(), not a torch optimizer over model.parameters()",
                         "the engine's optimizer is engine.optimizer", "optim.max_grad_norm"):
                assert part in said, (name, part, said)
            assert "full_weights" not in said, (name, said)
            with pytest.raises(RuntimeError, match=r"parameter 'transformer\.h\.0\.mlp\.c_fc\."
                               r"weight' is used outside the forward.*full_weights"):
                model.transformer.h[0].mlp.c_fc.weight * 2  # the weight's message, as before
            engine.zero_grad()
        after = engine.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        engine.backward(engine(input_ids=x, labels=x).loss)
        assert engine.step()  # training goes on
    finally:
        engine.close()


def test_transformers_save_pretrained_outside_full_weights_writes_nothing(engine_cfg,
                                                                        tmp_path):
    """transformers' save_pretrained of the engine's model outside a full_weights block
    wrote config.json and generation_config.json, then failed at the first weight,
    leaving a directory without weights. It is refused before anything is written,
    naming engine.save_pretrained(dir) and the block, for the model, a submodule and a
    block that holds only some weights; inside a block it saves as a plain model, a
    copy made there saves as one after it, and after close() it names the closing."""
    engine = _engine(engine_cfg)
    model = engine.module
    try:
        want = engine.state_dict()
        for call, where in ((model.save_pretrained, "model"),
                            (model.transformer.save_pretrained, "transformer")):
            with pytest.raises(RuntimeError, match=r"save_pretrained\(dir\) outside .*nothing "
                               r"was written.*engine\.save_pretrained\(dir\).*`with "
                               r"engine\.full_weights\(\): model\.save_pretrained\(dir\)`"):
                call(tmp_path / where)
            assert not (tmp_path / where).exists()
        with engine.full_weights(["transformer.wte", "transformer.h.0"]):
            with pytest.raises(RuntimeError, match=r"block that holds all its weights"):
                model.save_pretrained(tmp_path / "part")
        assert not (tmp_path / "part").exists()
        with engine.full_weights():
            model.save_pretrained(tmp_path / "full")
            twin = copy.deepcopy(model)
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        twin.save_pretrained(tmp_path / "twin")  # a plain model: its class's own method
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin").state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        # given its tensors (transformers' Trainer._save), it reads no weight: as before
        model.save_pretrained(tmp_path / "given", state_dict=engine.state_dict())
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "given").state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match=r"OffloadEngine that is closed.*nothing was written"):
        model.save_pretrained(tmp_path / "closed")
    assert not (tmp_path / "closed").exists()


def test_peft_save_pretrained_outside_full_weights_writes_nothing(engine_cfg, tmp_path):
    """peft's save_pretrained outside a block is refused as transformers' is, naming
    peft's own save inside the block (engine.save_pretrained refuses a peft model);
    inside the block it writes the adapters."""
    peft = pytest.importorskip("peft")

    def lora():
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                               lora_dropout=0.0, fan_in_fan_out=True)
        return peft.get_peft_model(_gpt2(), lora)
    engine = _engine(engine_cfg, lora)
    try:
        with pytest.raises(RuntimeError, match=r"PeftModel\.save_pretrained\(dir\) "
                           r"outside .*nothing was written.*adapters with `with "
                           r"engine\.full_weights\(\): model\.save_pretrained\(dir\)`"):
            engine.module.save_pretrained(tmp_path / "outside")
        assert not (tmp_path / "outside").exists()
        with engine.full_weights():
            engine.module.save_pretrained(tmp_path / "adapters")
        assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()
        # a block of the adapters alone (the base model stays out of host memory)
        lora_names = [n for n, _ in engine.module.named_modules() if n.endswith("lora_A")
                      or n.endswith("lora_B")]
        with engine.full_weights(lora_names):
            engine.module.save_pretrained(tmp_path / "only")
        from safetensors.torch import load_file
        assert load_file(tmp_path / "only" / "adapter_model.safetensors").keys() == \
            load_file(tmp_path / "adapters" / "adapter_model.safetensors").keys()
    finally:
        engine.close()
