"""`offload checkpoint export --config`: a training checkpoint of a transformers model
becomes a directory that `from_pretrained` loads, with the weights `save_pretrained` of
the engine writes."""

import pytest
import torch

import offload
from offload.cli.main import main

transformers = pytest.importorskip("transformers")


def test_export_with_config_loads_in_transformers(tmp_path, capsys):
    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "host",
                      "group_size": 5000},
           "optim": {"lr": 1e-2},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    hf = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    with offload.initialize(transformers.GPT2LMHeadModel(hf), cfg) as e:
        x = torch.randint(0, 96, (2, 8))
        e.backward(e(input_ids=x, labels=x).loss)
        e.step()
        e.save_checkpoint(tmp_path / "ck")
        e.save_pretrained(tmp_path / "engine-out")
        e.save_pretrained(tmp_path / "engine-bf16", dtype=torch.bfloat16)
        want = e.state_dict()
    argv = ["checkpoint", "export", str(tmp_path / "ck"), "--to", str(tmp_path / "out"),
            "--shard-size", "40KB", "--config", str(tmp_path / "engine-out")]
    assert main(argv) == 0, capsys.readouterr().err
    assert "config.json" in capsys.readouterr().out
    for path in (tmp_path / "out", tmp_path / "engine-out"):
        got = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), (path.name, k)
    # --dtype bf16: config.json names bfloat16, as save_pretrained(dtype=...) writes it, so
    # from_pretrained builds the model in bf16 (was the --config file's float32)
    argv = ["checkpoint", "export", str(tmp_path / "ck"), "--to", str(tmp_path / "out16"),
            "--dtype", "bf16", "--config", str(tmp_path / "engine-out")]
    assert main(argv) == 0, capsys.readouterr().err
    for path in (tmp_path / "out16", tmp_path / "engine-bf16"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        assert model.dtype == torch.bfloat16, path.name
        got = model.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v), \
                (path.name, k)


def test_export_of_a_peft_checkpoint_is_refused_naming_peft_s_save(tmp_path, capsys):
    """A LoRA model's checkpoint exported under peft's names beside the base model's
    config.json: from_pretrained loaded it as a fresh model, every weight new, without a
    word. It is refused, naming how to save the adapters, and nothing is written."""
    peft = pytest.importorskip("peft")
    cfg = {"engine": {"group_size": 5000},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    hf = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(hf),
                                peft.LoraConfig(r=4, target_modules=["c_attn"]))
    with offload.initialize(model, cfg) as e:
        e.save_checkpoint(tmp_path / "ck")
    hf.save_pretrained(tmp_path / "base")
    argv = ["checkpoint", "export", str(tmp_path / "ck"), "--to", str(tmp_path / "out"),
            "--config", str(tmp_path / "base")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds a peft model" in err and "model.save_pretrained(dir)" in err, err
    assert not (tmp_path / "out").exists()
