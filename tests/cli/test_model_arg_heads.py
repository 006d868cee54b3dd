"""What MODEL builds and feeds for a Hugging Face model that is not a causal LM: the class
a config's architectures names (an encoder-decoder, a classifier, an image model), the
inputs its head takes, eager attention for a function's model, and refusals that say
what was fed. Tiny models from configs, nothing downloaded."""

import json
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload.cli import tune as tune_cli  # noqa: E402
from offload.cli import tune_probe  # noqa: E402
from offload.cli.tune_probe import DiskRates, MachineProbe  # noqa: E402

TINY = {
    "bart": ("BartForConditionalGeneration", transformers.BartConfig, dict(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32)),
    "bert_cls": ("BertForSequenceClassification", transformers.BertConfig, dict(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=3)),
    "t5": ("T5ForConditionalGeneration", transformers.T5Config, dict(
        vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)),
    "vit": ("ViTForImageClassification", transformers.ViTConfig, dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=32, patch_size=8, num_labels=3)),
    "swin": ("SwinForImageClassification", transformers.SwinConfig, dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=2, num_labels=3)),
    "llama_cls": ("LlamaForSequenceClassification", transformers.LlamaConfig, dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        num_labels=2, pad_token_id=None)),
}
MODELS = textwrap.dedent("""
    import torch
    import transformers
    from torch import nn
    from transformers.modeling_outputs import SequenceClassifierOutput

    def bart():
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32))

    def bert_cls():
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32, num_labels=3))

    class Classifier(transformers.PreTrainedModel):
        # a user's own head: one label per row, as labels=input_ids does not fit
        config_class = transformers.BertConfig

        def __init__(self, config):
            super().__init__(config)
            self.emb = nn.Embedding(config.vocab_size, 8)
            self.out = nn.Linear(8, 3)
            self.post_init()

        def forward(self, input_ids, labels=None):
            logits = self.out(self.emb(input_ids).mean(1))
            loss = nn.functional.cross_entropy(logits, labels)
            return SequenceClassifierOutput(loss=loss, logits=logits)

    def own_classifier():
        return Classifier(transformers.BertConfig(vocab_size=64, max_position_embeddings=16))

    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x.view(-1, 3, 8))

    def pairs():
        return Pairs()
    """)


@pytest.fixture
def models(user_module):
    return user_module("headmodels", MODELS)


def _model_dir(root, name, architectures=True):
    """A model directory's config.json as `save_pretrained` of the class writes it (the
    weights are not read); the count of the class's parameters."""
    cls_name, config_cls, kw = TINY[name]
    cfg = config_cls(**kw)
    if architectures:
        cfg.architectures = [cls_name]
    cfg.save_pretrained(root / name)
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config_cls(**kw))
    return str(root / name), sum(p.numel() for p in model.parameters())


def _estimate(offload_cli, model, *extra):
    return offload_cli(["estimate", model, "--batch", "2", *extra, "--dtype", "fp32",
                        "--placement", "host/host/host", "--json"])


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("name,tokens", [("bart", 2 * 32), ("bert_cls", 2 * 32), ("t5", 2 * 16),
                                         ("vit", 2 * 16)])
def test_a_model_directory_is_measured_as_the_class_its_architectures_name(
        models, offload_cli, name, tokens):
    """It was always AutoModelForCausalLM: BART's directory measured as BartForCausalLM
    (its decoder alone), a BERT classifier as BertLMHeadModel, silently; T5 and ViT
    refused in transformers' 3,500 characters. Each is built as the class its config
    names and fed what its head takes: labels=input_ids to a seq2seq LM (with
    decoder_input_ids), input_ids alone to a classifier, pixel_values from an image
    model's config (its patches counted as its tokens)."""
    path, want = _model_dir(models, name)
    rc, out, err = _estimate(offload_cli, path, *(["--seq", "16"] if name == "t5" else []))
    assert rc == 0, err
    res = json.loads(out)
    assert res["params"] == want, (res["params"], want)
    assert res["tokens_per_batch"] == tokens and res["activations"]["bytes"] > 0
    assert res["model_class"] == TINY[name][0]  # said: a config's class changed silently
    rc, out, err = offload_cli(["estimate", path, "--batch", "2", "--dtype", "fp32",
                                *(["--seq", "16"] if name == "t5" else [])])
    assert rc == 0 and f"({TINY[name][0]})" in out, out


def test_a_config_without_a_class_to_build_is_refused_in_a_short_line(models, offload_cli):
    """T5's config without architectures has no causal-LM class: transformers' refusal
    lists every class it knows; one short line names the file and the way out."""
    path, _ = _model_dir(models, "t5", architectures=False)
    rc, out, err = _estimate(offload_cli, path)
    line = _one_line(err)
    assert rc == 2 and out == "" and len(line) < 400, line
    assert f"MODEL: {path}/config.json names no architectures, and its model_type 't5' has " \
        "no causal-LM class; give module:function returning the model" in line, line


def test_a_causal_lm_named_by_architectures_is_measured_as_before(tmp_path):
    """The class a causal LM's config names is AutoModelForCausalLM's own: same figures."""
    from offload.cli.model_arg import ModelSpec, measure_model

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    cfg.save_pretrained(tmp_path / "plain")
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path / "named")
    got = [measure_model(ModelSpec("hf", str(tmp_path / d / "config.json"), 2, 32, "fp32"),
                         1 << 20) for d in ("plain", "named")]
    assert [(m.params, m.activations, m.activations_checkpointed, m.unit_flops, m.tokens)
            for m in got] == [(got[0].params, got[0].activations,
                               got[0].activations_checkpointed, got[0].unit_flops, 64)] * 2


def test_a_functions_bart_is_measured_with_eager_attention(models, offload_cli):
    """BART's SDPA mask calls .item(), which meta refuses: a config's BART was measured
    with eager attention, a function's failed ("Tensor.item() cannot be called on meta
    tensors")."""
    rc, out, err = _estimate(offload_cli, "headmodels:bart", "--seq", "16")
    assert rc == 0, err
    res = json.loads(out)
    assert res["params"] == _model_dir(models, "bart")[1] and res["activations"]["bytes"] > 0


def test_a_functions_classifier_is_fed_no_token_labels(models, offload_cli):
    """labels=input_ids of shape (batch, seq) failed the classifier's loss ("Expected
    input batch_size (8) to match target batch_size (512)"), blamed on --batch/--seq."""
    rc, out, err = _estimate(offload_cli, "headmodels:bert_cls", "--seq", "8")
    assert rc == 0, err
    assert json.loads(out)["params"] == _model_dir(models, "bert_cls")[1]


@pytest.mark.parametrize("model,fed,fix", [
    ("headmodels:own_classifier", "it was fed input_ids (2, 16) int64 and labels=input_ids: "
     "check --batch/--seq against the model, or give module:function returning an "
     "nn.Module whose forward makes the model's inputs from the one tensor it is fed",
     "--batch rows of --seq token ids where its first layer is an embedding"),
    ("headmodels:pairs", "it was fed one tensor (2, 8) float32: check --batch/--seq against "
     "the model, or give module:function returning a wrapper whose forward takes that one "
     "tensor", "MODEL: a forward pass of headmodels:pairs on the meta device at batch 2 "
     "failed (RuntimeError: "),
])
def test_a_failed_forward_says_what_the_model_was_fed(models, offload_cli, model, fed, fix):
    """The refusal blamed --batch/--seq alone, where the inputs were the trouble."""
    rc, out, err = _estimate(offload_cli, model)
    line = _one_line(err)
    assert rc == 2 and fed in line and fix in line, line


def test_a_model_that_takes_neither_tokens_nor_images_is_refused_naming_its_input(
        models, offload_cli):
    cfg = transformers.WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    cfg.architectures = ["WhisperForConditionalGeneration"]
    cfg.save_pretrained(models / "whisper")
    rc, out, err = _estimate(offload_cli, str(models / "whisper"))
    line = _one_line(err)
    assert rc == 2 and "(WhisperForConditionalGeneration) takes input_features, not input_ids " \
        "or pixel_values" in line and "give module:function returning an nn.Module" in line, line


def test_seq_is_refused_for_an_image_model(models, offload_cli):
    path, _ = _model_dir(models, "vit")
    rc, out, err = _estimate(offload_cli, path, "--seq", "16")
    line = _one_line(err)
    assert rc == 2 and "takes images (pixel_values of 3 x 32 x 32 from its config), not rows " \
        "of tokens; leave --seq out" in line, line


def _fixed_probe(args, spec, mm, device, progress) -> MachineProbe:
    disk = [DiskRates(bs, qd, 1e9, 1e9, 1e9, "fixed") for bs, qd in tune_probe.IO_GRID]
    return MachineProbe(disk, 1 << 40, 0.0, 1e9, 1e10)


@pytest.mark.parametrize("model,dtype", [("bart", "fp32"), ("vit", "fp32"),
                                         ("headmodels:bert_cls", "fp32"), ("swin", "bf16"),
                                         ("llama_cls", "fp32")])
def test_the_inputs_made_train_in_real_steps(models, offload_cli, monkeypatch, model, dtype):
    """One calibration run of tune on the CPU: the batch its real steps draw (token ids
    anywhere in the vocabulary, floats for pixels in the compute dtype: Swin, which does
    not cast its input, failed every bf16 step) suits each head; a decoder's classifier
    without a pad token (a reward model's config) is given one (transformers refuses
    batches above 1 without it)."""
    monkeypatch.setattr(tune_cli, "probe_machine", _fixed_probe)
    target = model if ":" in model else _model_dir(models, model)[0]
    rc, out, err = offload_cli(["tune", target, "--batch", "2", "--dtype", dtype, "--device",
                                "cpu", "--swap", str(models / "swap"), "--host-budget",
                                "64MiB", "--device-budget", "8MiB", "--calibrate", "1",
                                "--finalists", "0", "--group-sizes", "8192", "--minutes", "1",
                                "--json"] + ([] if model in ("vit", "swin") else ["--seq", "16"]))
    assert rc == 0, err
    runs = json.loads(out)["calibration_runs"]
    assert len(runs) == 1 and runs[0]["measured_step_s"] > 0, runs
