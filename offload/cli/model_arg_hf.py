"""A Hugging Face model as the MODEL of `offload estimate` and `offload tune`
(model_arg.py): the class a config names, its eager attention, and the inputs and loss
of one forward as its head needs them.

A config builds the class its `architectures` names (the class that wrote it), else
`AutoModelForCausalLM`'s. A model is fed by its `main_input_name`: `input_ids` of batch x
seq tokens, with `labels=input_ids` where its head predicts the vocabulary's tokens (an
output embedding: causal, masked and seq2seq LMs; then its loss is the model's own), or
`pixel_values` of batch x channels x height x width from an image model's config. A head
that takes other labels (a classifier's, one per row in num_labels) gets no labels, and
its loss is the mean square of each float tensor it returns (its logits): the same
forward and backward, and no label a real step would have to draw in range. An
encoder-decoder gets `decoder_input_ids=input_ids` too.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from .args import UsageError

__all__ = ["build_from_config", "hf_batch", "image_positions", "is_hf_model", "set_eager"]

# the way out where the inputs made here do not suit a model: a wrapper fed one tensor
WRAPPER = ("give module:function returning an nn.Module whose forward makes the model's "
           "inputs from the one tensor it is fed (--batch rows of --seq token ids where its "
           "first layer is an embedding, else of its first Linear's input features) and "
           "returns the loss")


def build_from_config(path: str, eager: bool) -> Any:
    """The model a config file names: `config.architectures[0]` where transformers has that
    class, else `AutoModelForCausalLM`'s class for its model_type; `UsageError` where
    neither is (transformers' own message lists every class it knows)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    kw = dict(attn_implementation="eager") if eager else {}
    archs = getattr(cfg, "architectures", None) or [None]
    named = archs[0] if isinstance(archs[0], str) else None
    cls = getattr(transformers, named, None) if named else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        text = getattr(cfg, "sub_configs", {}).get("text_config")
        if text is not None and getattr(cls, "config_class", None) is text:
            cfg = cfg.get_text_config()  # a text model named by a multimodal config
        if named.endswith("ForSequenceClassification") and getattr(cfg, "pad_token_id",
                                                                      0) is None:
            # a decoder's classifier (a reward model) finds each row's last token by the
            # pad token, and refuses batches above 1 without one: any id serves here
            cfg.pad_token_id = 0
        return cls._from_config(cfg, **kw)  # what AutoModel*.from_config calls
    try:
        return AutoModelForCausalLM.from_config(cfg, **kw)
    except ValueError as e:
        if not str(e).startswith("Unrecognized configuration class"):
            raise
    what = (f"names {named!r} in architectures, which transformers {transformers.__version__} "
            "does not have" if named else "names no architectures")
    raise UsageError(f"MODEL: {path} {what}, and its model_type {cfg.model_type!r} has no "
                     "causal-LM class; give module:function returning the model (a function "
                     "that builds it from this config)")


def hf_base(model: Any) -> Any:
    """The transformers model: `model`, or the one a peft model wraps."""
    from ..engine.model_weights import is_peft

    return model.get_base_model() if is_peft(model) else model


def is_hf_model(model: Any) -> bool:
    """A transformers model (what a `module:function` may return as well as a config
    names), or a peft model around one: it takes keyword inputs and returns an output
    object, not a tensor."""
    transformers = sys.modules.get("transformers")  # imported by whoever built it
    return transformers is not None and isinstance(hf_base(model), transformers.PreTrainedModel)


def set_eager(model: Any) -> None:
    """[Note: eager on meta] in model_arg.py, for a model already built: transformers'
    eager attention in it and its sub-models."""
    hf_base(model).set_attn_implementation("eager")


def hf_batch(model: Any, spec: Any, seq: int, make: Callable) -> tuple[dict, Callable]:
    """(kwargs of one forward, loss of its output) for a transformers model ([module
    docstring]); `make(shape, dtype)` makes a tensor of the batch."""
    import torch

    base = hf_base(model)
    name = getattr(base, "main_input_name", "input_ids")
    if name == "pixel_values":
        shape = _image_shape(base.config)
        if shape is None:
            raise UsageError(f"MODEL: {spec.target} ({type(base).__name__}) takes "
                             "pixel_values and its config gives no int image_size and "
                             f"num_channels to shape them; {WRAPPER}")
        if spec.seq is not None:
            raise UsageError(f"--seq: {spec.target} ({type(base).__name__}) takes images "
                             f"(pixel_values of {' x '.join(map(str, shape))} from its "
                             "config), not rows of tokens; leave --seq out")
        return {"pixel_values": make((spec.batch, *shape), torch.float32)}, output_loss
    if name != "input_ids":
        raise UsageError(f"MODEL: {spec.target} ({type(base).__name__}) takes {name}, not "
                         "input_ids or pixel_values, the inputs estimate makes for a Hugging "
                         f"Face model; {WRAPPER}")
    ids = make((spec.batch, seq), torch.long)
    batch = {"input_ids": ids}
    if getattr(base.config, "is_encoder_decoder", False) \
            and "decoder_input_ids" in _forward_params(base):
        # given, not made from labels: T5's shift reads a decoder_start_token_id that
        # a config may lack, and a head without token labels makes none
        batch["decoder_input_ids"] = ids
    if _predicts_tokens(base):
        return {**batch, "labels": ids}, _own_loss
    return batch, output_loss


def image_positions(config: Any) -> int:
    """Patches per image (the rows an image model's matrices multiply), or 1 where the
    config names no int patch_size."""
    shape, patch = _image_shape(config), getattr(config, "patch_size", None)
    if shape is None or not _positive_int(patch):
        return 1
    return max(1, shape[1] // patch) * max(1, shape[2] // patch)


def _image_shape(config: Any) -> tuple[int, int, int] | None:
    """(channels, height, width) of an image model's config, or None."""
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if isinstance(size, int):
        size = (size, size)
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and isinstance(channels, int)):
        return None
    dims = (channels, *size)
    return dims if all(_positive_int(d) for d in dims) else None


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _predicts_tokens(base: Any) -> bool:
    """labels=input_ids suit it: transformers' class with an output embedding (a causal,
    masked or seq2seq LM's head over the vocabulary), or a model of the user's own (a
    PreTrainedModel subclass no transformers model class is above), fed so before."""
    import transformers

    try:
        if base.get_output_embeddings() is not None:
            return True
    except NotImplementedError:  # a class that declares it has none this way
        pass
    above = next(c for c in type(base).__mro__ if c.__module__.startswith("transformers."))
    return above is transformers.PreTrainedModel


def _forward_params(base: Any) -> set[str]:
    try:
        return set(inspect.signature(base.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _own_loss(out: Any) -> Any:
    """The model's loss of labels=input_ids, or, where its head computes none from labels
    alone (BERT's pre-training wants its next-sentence labels too), `output_loss`."""
    loss = getattr(out, "loss", None)
    return loss if loss is not None else output_loss(out)


def output_loss(out: Any) -> Any:
    """The mean square of each float tensor a forward returned (its logits, or a base
    model's hidden states), summed: a loss through every output."""
    import torch

    items = [out] if isinstance(out, torch.Tensor) else \
        list(out.to_tuple() if callable(getattr(out, "to_tuple", None)) else
             out if isinstance(out, (tuple, list)) else [])
    floats = [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise UsageError(f"MODEL: the model's forward returned {type(out).__name__} with no "
                         f"float tensor to take a loss of; {WRAPPER}")
    return sum(t.float().square().mean() for t in floats)
