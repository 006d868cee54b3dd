"""Tensor parallelism (tp.size = 2, two gloo ranks) as a user meets it: ranks that
seed each their own way before building the model, a block with the layers' names
of a known kind that is another model's (nanoGPT's), a forward that raises in the
middle of a Domino block, and a Llama batch with padding in eval mode, each
against one process of plain torch.

The two ranks are spawned once (module fixture) and run every case; each test
reads its case's outcome (starting processes is most of the time on 2 cores)."""

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.config import ConfigError

from .models import lm_loss
from .ranks import process_group, run_cases, spawn_cases
from .test_domino import EPS, VOCAB, _batches, _config, _logits, _model

pytestmark = pytest.mark.distributed


def _gpt(seed: int) -> nn.Module:
    from offload.cli.gpt import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab=VOCAB, max_seq=16))


def _reference(steps: int) -> dict:
    """The GPT of `_model("gpt")` after `steps` steps of torch's AdamW on the full batches."""
    model = _model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    for x, y in _batches()[:steps]:
        opt.zero_grad()
        lm_loss(_logits(model(x)), y).backward()
        opt.step()
    return model.state_dict()


def _max_diff(got: dict, want: dict) -> float:
    """The largest difference of `got` from `want` over `want`'s tensors (all in `got`)."""
    return max((got[k].cpu() - v).abs().max().item() for k, v in want.items())


class _NanoAttention(nn.Module):
    """nanoGPT's attention: GPT-2's layer names, as nn.Linear, and `n_head`."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.n_head, self.n_embd = heads, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class _NanoMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class _NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _NanoAttention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), _NanoMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, 32)
        self.h = nn.ModuleList(_NanoBlock(32, 4) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        for block in self.h:
            h = block(h)
        return self.head(h)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _case_seeded(d: str, rank: int) -> dict:
    """Each rank seeds with its rank before building the model (and makes a buffer of
    its own): before the fix each rank cut its slices from its own weights and kept
    its own embeddings and norms, and trained a model no rank built."""
    from offload.engine import full_state_dict
    model = _gpt(rank)
    model.register_buffer("marker", torch.full((4,), float(rank)))
    handler = _Warnings()
    logging.getLogger("offload").addHandler(handler)
    try:
        with offload.initialize(model, _config(os.path.join(d, "seed"), 2, "host")) as engine:
            marker = model.marker.clone()
            for x, y in _batches()[:2]:
                engine.backward(lm_loss(_logits(engine(x)), y))
                engine.step()
            weights = full_state_dict(engine)
            mine = {k: v.clone() for k, v in engine.state_dict(rank0_only=False).items()}
    finally:
        logging.getLogger("offload").removeHandler(handler)
    replicated = {k: v for k, v in mine.items() if v.shape == weights[k].shape}
    others = [None, None]
    torch.distributed.all_gather_object(others, replicated)
    return {"diff": _max_diff(weights, _reference(2)), "marker": marker.tolist(),
            "replicated_equal": all(torch.equal(others[0][k], others[1][k]) for k in replicated),
            "warned": any("tensor-parallel group" in m for m in handler.messages)}


def _case_nano(d: str) -> dict:
    """nanoGPT's block matches the GPT-2 kind by its layers' names; it has no
    `attn.num_heads`: before the fix an AttributeError from inside the cut's checks."""
    model = _NanoGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with offload.initialize(model, _config(os.path.join(d, "nano"), 2, "host")):
            pass
    except Exception as e:  # noqa: BLE001 - the test looks at which
        error = {"type": type(e).__name__, "config_error": isinstance(e, ConfigError),
                 "message": str(e)}
    else:
        error = None
    after = model.state_dict()
    return {"error": error, "same": set(after) == set(before)
            and all(torch.equal(after[k], v) for k, v in before.items())}


def _case_refused(d: str, rank: int, how: str) -> dict:
    """A model `parallelize` cannot cut on one rank or on both: "meta", rank 1 builds it
    on the meta device (rank 0 waited for good in the first weights' broadcast, or got
    gloo's "Connection closed by peer"); "shared", one block at two depths (it trained
    a model torch does not: the second depth ran the cut layers without their
    all-reduce); "hooks", a forward hook on a layer the cut replaces (it stopped
    running without a word). Every rank raises a ConfigError; the model is as it was."""
    if how == "meta" and rank == 1:
        with torch.device("meta"):
            model = _gpt(0)
    else:
        model = _gpt(0)
    if how == "shared":
        model.blocks[1] = model.blocks[0]
    if how == "hooks":
        model.blocks[0].mlp.fc.register_forward_hook(lambda *_: None)
    before = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    try:
        with offload.initialize(model, _config(os.path.join(d, how), 2, "host")):
            error = None
    except Exception as e:  # noqa: BLE001 - the test looks at which
        error = {"config_error": isinstance(e, ConfigError), "message": str(e)}
    after = model.state_dict()
    return {"error": error, "same": all(torch.equal(after[k], v) for k, v in before.items())}


def _case_raise_mid_block(d: str) -> dict:
    """A forward hook that raises on every rank in the second piece's MLP of the second
    block, with the first piece's all-reduce in flight: the weights stay exactly as
    before the step, and training on continues as torch's."""
    from offload.engine import full_state_dict
    model = _model("gpt")
    armed, calls = [False], [0]

    def hook(*_):
        calls[0] += 1
        if armed[0] and calls[0] == 2:
            raise RuntimeError("raised by the model")

    raised = None
    with offload.initialize(model, _config(os.path.join(d, "raise"), 2, "host")) as engine:
        model.blocks[1].mlp.fc.register_forward_hook(hook)
        for step, (x, y) in enumerate(_batches()[:2]):
            if step == 1:
                before = full_state_dict(engine)
                armed[0], calls[0] = True, 0
                try:
                    engine.backward(lm_loss(_logits(engine(x)), y))
                    engine.step()
                except RuntimeError as e:
                    raised = str(e)
                armed[0] = False
                unchanged = _max_diff(full_state_dict(engine), before)
            engine.backward(lm_loss(_logits(engine(x)), y))
            engine.step()
        weights = full_state_dict(engine)
    return {"raised": raised, "unchanged": unchanged, "diff": _max_diff(weights, _reference(2))}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32,
        attn_implementation="sdpa", attention_bias=True, mlp_bias=True))


def _case_llama_padding(d: str) -> dict:
    """Llama with q/k/v and row biases, a padded batch cut into 2 pieces (the 4-d mask
    with it), in eval mode without a cache and in training mode: torch's logits."""
    x, _ = _batches(batch=8, seq=8)[0]
    mask = torch.ones(8, 8, dtype=torch.long)
    mask[::2, :3] = 0
    with offload.initialize(_llama(), _config(os.path.join(d, "llama"), 2, "host")) as engine:
        engine.eval()
        with torch.no_grad():
            evaluated = engine(x, attention_mask=mask, use_cache=False).logits
        engine.train()
        trained = engine(x, attention_mask=mask).logits.detach()
    with torch.no_grad():
        want = _llama().eval()(x, attention_mask=mask, use_cache=False).logits
    return {"eval": (evaluated - want).abs().max().item(),
            "train": (trained - want).abs().max().item()}


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    d = os.path.dirname(init_file)
    with process_group(rank, world, init_file):
        cases = {"seeded": lambda: _case_seeded(d, rank),
                 "nano": lambda: _case_nano(d),
                 "raise": lambda: _case_raise_mid_block(d),
                 "llama": lambda: _case_llama_padding(d),
                 **{f"refused-{how}": lambda how=how: _case_refused(d, rank, how)
                    for how in ("meta", "shared", "hooks")}}
        run_cases(cases, f"{out}.{rank}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list:
    return spawn_cases(_worker, str(tmp_path_factory.mktemp("parallel-edges")))


def test_ranks_seeded_apart_train_rank_0s_model(outcomes):
    """As under DDP (and as without tensor parallelism), every rank trains from rank 0's
    initial weights and buffers, with a warning on the rank whose differed. Before:
    the weights were 0.3 off torch's, the embeddings differed between the TP
    ranks, and so did the buffer."""
    for rank, r in enumerate(outcomes):
        got = r["seeded"]
        assert "crash" not in got, got
        assert got["diff"] < 1e-6, got
        assert got["replicated_equal"], got
        assert got["marker"] == [0.0] * 4, got
        assert got["warned"] == (rank == 1), got


def test_block_of_another_model_is_a_config_error(outcomes):
    """Before: AttributeError "'_NanoAttention' object has no attribute 'num_heads'"."""
    for r in outcomes:
        got = r["nano"]
        assert got["error"] is not None and got["error"]["config_error"], got
        message = got["error"]["message"]
        assert "tp.size" in message and "h.0" in message and "attn.num_heads" in message, got
        assert got["same"], got


@pytest.mark.parametrize("how, says", [
    ("meta", "blocks.0.attn.qkv: tensor parallelism slices real weights"),
    ("shared", "blocks.0 is also 'blocks.1' in the model: a block or layer used at two "
     "places cannot be cut"),
    ("hooks", "blocks.0.mlp.fc has hooks (forward_hooks: _case_refused.<locals>.<lambda>) "
     "that would not run once it is cut")])
def test_a_model_one_rank_cannot_cut_is_refused_on_every_rank(outcomes, how, says):
    for rank, r in enumerate(outcomes):
        got = r[f"refused-{how}"]
        assert got.get("error") and got["error"]["config_error"], got
        assert "tp.size" in got["error"]["message"] and says in got["error"]["message"], got
        if how == "meta" and rank == 0:
            assert "rank 1 refused" in got["error"]["message"], got
        assert got["same"], got


def test_forward_that_raises_mid_block_leaves_the_weights(outcomes):
    for r in outcomes:
        got = r["raise"]
        assert "crash" not in got, got
        assert got["raised"] == "raised by the model", got
        assert got["unchanged"] == 0.0, got
        assert got["diff"] < 1e-6, got


def test_llama_padded_batch_in_pieces_matches_torch(outcomes):
    for r in outcomes:
        got = r["llama"]
        assert "crash" not in got, got
        assert got["eval"] < 1e-5 and got["train"] < 1e-5, got


def test_transformers_output_capturing_hooks_do_not_stop_the_cut():
    """A forward with output_hidden_states leaves transformers' capturing hooks on every
    decoder layer for good: the hooks check refused such a model ("model.layers.0 has
    hooks"), though its user registered none and what they capture is refused under
    tensor parallelism anyway. A hook of the user's is still refused, named."""
    from offload.comm.domino import tp_blocks
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 8)), output_hidden_states=True)
    assert model.model.layers[0]._forward_hooks  # transformers' own
    assert len(tp_blocks(model, 2)) == 2

    def mine(*_):
        pass
    model.model.layers[1].mlp.up_proj.register_forward_pre_hook(mine)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj has hooks "
                                         r"\(forward_pre_hooks: .*mine\)"):
        tp_blocks(model, 2)
