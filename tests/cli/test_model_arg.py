"""How MODEL and --hf-config name a model, and how a config's context bounds --seq."""

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from offload.cli.args import UsageError
from offload.cli.model_arg import model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64,
        "bos_token_id": 0, "eos_token_id": 0}


def _spec(model, seq=None, hf_config=None):
    return model_spec(argparse.Namespace(model=model, hf_config=hf_config, batch=1, seq=seq,
                                         dtype="bf16"))


def test_model_and_hf_config_together_are_refused(tmp_path, offload_cli):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**GPT2, "n_positions": 64}))
    rc, out, err = offload_cli(["estimate", str(cfg), "--hf-config", str(cfg), "--json"])
    assert rc == 2 and out == "", (rc, err)
    assert err == "offload estimate: MODEL and --hf-config: give one of them, not both\n", err


def test_a_json_file_without_model_type_is_refused_before_building(tmp_path, offload_cli):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"n_layer": 2, "n_embd": 32}))
    rc, out, err = offload_cli(["estimate", str(cfg)])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and f"MODEL: {cfg} has no model_type; give a Hugging Face " \
        "config.json" in err, err


def test_a_config_nested_past_the_recursion_limit_is_refused_in_one_line(tmp_path, offload_cli):
    cfg = tmp_path / "config.json"  # a RecursionError's traceback, before
    cfg.write_text('{"model_type": ' + "[" * 100_000)
    rc, out, err = offload_cli(["estimate", str(cfg)])
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, err[-2000:])
    assert f"MODEL: {cfg} cannot be read as JSON (nested deeper" in err, err


def test_seq_equal_to_the_models_context_is_accepted(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**GPT2, "n_positions": 64}))
    assert _spec(str(cfg), seq=64).seq == 64
    with pytest.raises(UsageError, match=r"--seq: 65 is above the model's n_positions \(64\)"):
        _spec(str(cfg), seq=65)


def test_whispers_and_robertas_contexts_are_the_rows_they_can_run(tmp_path):
    """Whisper's decoder names its context max_target_positions (no key was read, so
    the default 512 ran past a table of 64); RoBERTa numbers positions from
    pad_token_id + 1, so max_position_embeddings 130 runs rows of 128 (129 and 130
    were accepted and failed at the first step)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "whisper", "max_target_positions": 64,
                               "max_source_positions": 1500}))
    assert _spec(str(cfg)).seq == 64
    with pytest.raises(UsageError, match=r"above the model's max_target_positions \(64\)"):
        _spec(str(cfg), seq=65)
    cfg.write_text(json.dumps({"model_type": "roberta", "max_position_embeddings": 130,
                               "pad_token_id": 1}))
    assert _spec(str(cfg)).seq == 128 and _spec(str(cfg), seq=128).seq == 128
    with pytest.raises(UsageError, match=r"--seq: 129 is above the model's "
                       r"max_position_embeddings \(130\) less its positions' offset \(2, "
                       r"after pad_token_id\): a longer row cannot run; give at most 128"):
        _spec(str(cfg), seq=129)


@pytest.mark.parametrize("bad", [0, -1, True])
def test_a_context_key_that_is_not_a_positive_integer_is_passed_over(tmp_path, bad):
    # max_position_embeddings comes first; where it is no context, n_positions is read
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**GPT2, "max_position_embeddings": bad, "n_positions": 64}))
    assert _spec(str(cfg)).seq == 64


@pytest.mark.parametrize("text", [":build", "somemod:", "a:b:c"])
def test_text_that_is_not_module_function_says_what_to_give(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "somemod.py").write_text("def build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=rf"^MODEL: {text!r} is neither an existing config "
                                         "file or directory nor module:function"):
        _spec(text)


def test_a_directory_path_without_py_names_the_module_to_give():
    text = os.path.join("mymodels", "tiny") + ":build"
    with pytest.raises(UsageError, match=r"is a file's path, not a module's name; give "
                                         r"tiny:build with PYTHONPATH=mymodels"):
        _spec(text)


def test_a_name_that_is_not_a_function_is_refused(tmp_path, monkeypatch):
    (tmp_path / "propmodels_const.py").write_text("SIZE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"module 'propmodels_const' has no function 'SIZE'"):
        _spec("propmodels_const:SIZE")


def test_a_module_in_the_current_directory_is_found_from_a_console_script(tmp_path):
    # the `offload` console script's sys.path[0] is its bin directory, not the current
    # one (python -m puts the current directory first): module:function must still import
    # from where the user runs it, as `python -m` would
    work, bin_ = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_.mkdir()
    (work / "propmodels_cwd.py").write_text(textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        """))
    script = bin_ / "offload"
    script.write_text("import sys\nfrom offload.cli.main import main\nsys.exit(main())\n")
    out = subprocess.run([sys.executable, str(script), "estimate", "propmodels_cwd:build",
                          "--batch", "2", "--json"], cwd=work, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"] == 16 * 16 + 16 + 16 * 4 + 4
