"""Tests of tensor parallelism's refusals and of what they leave behind (tp.size = 2 on
two gloo ranks): a model that cannot be cut is left as it was, with a ConfigError
naming tp.size and the layer; an initialize that fails after the cut does not turn
the retry into a TypeError; export under TP.

The two ranks are spawned once (module fixture) and run every case; each test
reads its case's outcome (starting processes is most of the time on 2 cores)."""

import copy
import glob
import os

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError

from .ranks import process_group, run_cases, spawn_cases
from .models import lm_loss
from .test_domino import EPS, VOCAB, _batches, _config, _logits, _model

pytestmark = pytest.mark.distributed


def _llama(intermediate: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=intermediate, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
        max_position_embeddings=32, attn_implementation="sdpa"))


class _Wrapped(nn.Module):
    """A Linear behind a wrapper (as LoRA adapters put it): no layer TP can cut."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at which
        return {"error": type(e).__name__, "config_error": isinstance(e, ConfigError),
                "message": str(e)}
    return {"error": None}


def _unchanged(model: nn.Module, before: dict) -> dict:
    from offload.comm.domino import DominoBlock
    from offload.comm.tensor_parallel import ColumnParallel, RowParallel
    after = model.state_dict()
    return {"cut": any(isinstance(m, (DominoBlock, ColumnParallel, RowParallel))
                       for m in model.modules()),
            "same": set(after) == set(before) and all(
                after[k].shape == v.shape and (v.is_meta or torch.equal(after[k], v))
                for k, v in before.items())}


def _init_and_close(model: nn.Module, cfg: dict) -> None:
    with offload.initialize(model, cfg):
        pass


def _case_uncuttable_width(d: str) -> dict:
    """Llama whose MLP width (63) does not split over 2 ranks: before the fix its
    attention layers were already cut when the MLP's refusal came."""
    model = _llama(63)
    before = _state(model)
    out = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "w"), 2, "host")))
    return out | _unchanged(model, before)


def _case_not_a_linear(d: str) -> dict:
    """The second block's MLP input layer is wrapped: a TypeError traceback from the
    middle of the cut before the fix, the first block already cut."""
    model = _model("gpt")
    model.blocks[1].mlp.fc = _Wrapped(model.blocks[1].mlp.fc)
    before = _state(model)
    out = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "l"), 2, "host")))
    return out | _unchanged(model, before)


def _budget_failure(d: str, model: nn.Module, name: str) -> dict:
    """initialize refused after the cut: a host budget below the working set."""
    cfg = _config(os.path.join(d, name), 2, "host")
    cfg["store"]["host_budget"] = "8KiB"
    return _outcome(lambda: _init_and_close(model, cfg))


def _case_retry(d: str) -> dict:
    """A ConfigError for the budget, then the same model with the budget fixed."""
    model = _model("gpt")
    first = _budget_failure(d, model, "r1")
    second = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "r2"), 2, "host")))
    return {"first": first, "second": second}


def _case_restored(d: str) -> dict:
    """A ConfigError for the budget: the model as it was, and a retry that trains."""
    model = _model("gpt")
    before = _state(model)
    first = _budget_failure(d, model, "s1")
    state = _unchanged(model, before)
    second = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "s2"), 2, "host")))
    return {"first": first, "second": second} | state


def _case_undo(d: str) -> dict:
    """TensorParallel.setup(keep_undo=True) then plan.undo(), for GPT-2 (whose attention
    `prepare` changes): the model as it was, and its forward the original's."""
    from offload.engine.tensor_parallel import TensorParallel
    model, ref = _model("gpt2"), _model("gpt2")
    before = _state(model)
    tp = TensorParallel.setup(model, offload.load_config(_config(os.path.join(d, "u"), 2,
                                                                  "host")),
                              restored=False, keep_undo=True)
    cut = _unchanged(model, before)["cut"]
    tp.plan.undo()
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_output = torch.equal(model(x).logits, ref(x).logits)
    return {"cut_before_undo": cut, "same_output": same_output} | _unchanged(model, before)


def _case_save_pretrained(d: str, rank: int) -> dict:
    """save_pretrained under tp.size = 2: what every rank did, and (rank 0) the shapes
    of what was written against the full model's."""
    out_dir = os.path.join(d, "export")
    cfg = _config(os.path.join(d, "e"), 2, "host")
    written: dict = {}

    def run() -> None:
        with offload.initialize(_model("gpt2"), cfg) as engine:
            engine.save_pretrained(out_dir)

    out = _outcome(run)
    torch.distributed.barrier()
    want = _model("gpt2").state_dict()
    out["max_diff"] = None
    if rank == 0:
        from safetensors.torch import load_file
        from transformers import GPT2LMHeadModel
        for f in glob.glob(os.path.join(out_dir, "*.safetensors")):
            written.update({k: tuple(v.shape) for k, v in load_file(f).items()})
        if out["error"] is None:  # what from_pretrained reads is the model that was saved
            got = GPT2LMHeadModel.from_pretrained(out_dir).state_dict()
            out["max_diff"] = max((got[k] - v).abs().max().item() for k, v in want.items())
    full = {k: tuple(v.shape) for k, v in want.items()}
    out["wrong_shapes"] = sorted(k for k, s in written.items() if k in full and full[k] != s)
    out["written"] = len(written)
    return out


def _case_checkpointing(d: str) -> dict:
    """GPT-2 under tp.size = 2 trained with transformers' gradient checkpointing, turned
    on before initialize and after it, against training without: the same weights, and
    a block's MLP run again in backward (its recomputation)."""
    from offload.engine import full_state_dict
    out: dict = {}
    funcs = []  # calls of the checkpoint function transformers set on the blocks
    for when in ("off", "before", "after"):
        model = _model("gpt2")
        if when == "before":
            model.gradient_checkpointing_enable()
            for block in model.transformer.h:  # the block's own function, not a default
                func = block._gradient_checkpointing_func
                block._gradient_checkpointing_func = \
                    lambda *a, func=func, **k: (funcs.append(1), func(*a, **k))[1]
        with offload.initialize(model, _config(os.path.join(d, f"ck-{when}"), 2,
                                               "host")) as engine:
            if when == "after":
                model.gradient_checkpointing_enable()
            calls = []
            model.transformer.h[0].mlp.register_forward_hook(lambda *a: calls.append(1))
            for x, y in _batches()[:2]:
                engine.backward(lm_loss(_logits(engine(x)), y))
                engine.step()
            out[when] = {"calls": len(calls), "weights": full_state_dict(engine)}
    off = out["off"]["weights"]
    return {"calls": {k: v["calls"] for k, v in out.items()}, "funcs": len(funcs),
            "diff": {k: max((v["weights"][n] - off[n]).abs().max().item() for n in off)
                     for k, v in out.items()}}


def _case_refusals(d: str) -> dict:
    """Models tensor parallelism cannot run, refused at initialize naming what and left
    as they were: heads that do not split over the ranks, GPT-2 with cross-attention,
    weights from a checkpoint (a rank holds slices, a checkpoint whole tensors), and
    tp.size 4 on 2 ranks."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from offload.cli.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    models = {
        "gpt_heads": GPT(GPTConfig(n_layer=1, d_model=48, n_head=3, vocab=VOCAB, max_seq=16)),
        "llama_kv_heads": LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
            num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=32)),
        "cross_attention": GPT2LMHeadModel(GPT2Config(
            n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=32,
            add_cross_attention=True)),
        "checkpoint": _model("gpt"), "world": _model("gpt")}
    ckpt = os.path.join(d, f"ck-{torch.distributed.get_rank()}")
    os.makedirs(ckpt)
    save_file(_state(models["checkpoint"]), os.path.join(ckpt, "model.safetensors"))
    out = {}
    for name, model in models.items():
        before = _state(model)
        cfg = _config(os.path.join(d, f"refused-{name}"), 4 if name == "world" else 2, "host")

        def run(model=model, cfg=cfg, name=name):
            with offload.initialize(model, cfg,
                                    checkpoint=ckpt if name == "checkpoint" else None):
                pass
        out[name] = _outcome(run) | _unchanged(model, before)
    return out


def _case_ranks_apart(d: str) -> dict:
    """The ranks' models differ (seeded apart: rank 0's weights are the ones trained);
    an initialize that fails after that leaves each rank's model as it was."""
    model = _model("gpt")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.distributed.get_rank())
    before = _state(model)
    return {"first": _budget_failure(d, model, "apart")} | _unchanged(model, before)


def _case_frozen(d: str) -> dict:
    """Weights frozen before initialize in layers tensor parallelism cuts stay as they
    were through training (a LoRA-style run)."""
    from offload.engine import full_state_dict
    model = _model("gpt")
    frozen = ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight")
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    before = _state(model)
    with offload.initialize(model, _config(os.path.join(d, "frozen"), 2, "host")) as engine:
        for x, y in _batches()[:2]:
            engine.backward(lm_loss(_logits(engine(x)), y))
            engine.step()
        after = full_state_dict(engine)
    return {"frozen_same": all(torch.equal(after[n], before[n]) for n in frozen),
            "trained": not torch.equal(after["blocks.1.mlp.fc.weight"],
                                       before["blocks.1.mlp.fc.weight"])}


def _case_modes(d: str) -> dict:
    """GPT-2 with residual dropout: a training forward drops (and every TP rank drops the
    same elements, its output the same); Llama in eval with its KV cache on (what
    generate does) is refused naming use_cache=False, and runs without it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                      n_positions=32, resid_pdrop=0.5, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="sdpa"))
    x = _batches()[0][0]
    out: dict = {}
    ref = copy.deepcopy(gpt2).train()
    with offload.initialize(gpt2, _config(os.path.join(d, "drop"), 2, "host")) as engine:
        torch.manual_seed(5)
        with torch.no_grad():
            train = _logits(engine(x, use_cache=False))
            engine.eval()
            evaluated = _logits(engine(x, use_cache=False))
        out["dropped"] = (train - evaluated).abs().max().item()
        out["train_sum"] = train.double().sum().item()
    # in one piece the block draws torch's masks in torch's order (after the attention,
    # then after the MLP), each over the whole output: its training forward is torch's
    one = copy.deepcopy(ref)
    with offload.initialize(one, _config(os.path.join(d, "drop1"), 2, "host", pieces=1)) as e:
        torch.manual_seed(5)
        with torch.no_grad():
            got = _logits(e(x, use_cache=False))
        torch.manual_seed(5)
        with torch.no_grad():
            want = _logits(ref(x, use_cache=False))
        out["as_torch"] = (got - want).abs().max().item()
    with offload.initialize(_model("llama"), _config(os.path.join(d, "kv"), 2, "host")) as engine:
        engine.eval()
        with torch.no_grad():
            out["cache"] = _outcome(lambda: engine(x))
            out["no_cache"] = _outcome(lambda: engine(x, use_cache=False))
            # [Note: per-layer outputs under tensor parallelism]: they came back empty or
            # one per batch piece with this rank's heads; now refused on every rank
            for key in ("output_hidden_states", "output_attentions"):
                out[key] = _outcome(lambda: engine(x, use_cache=False, **{key: True}))
        out["trains_after"] = _outcome(lambda: engine.backward(
            engine(x, use_cache=False).logits.float().square().mean()))
    return out


def _case_uneven_batch(d: str) -> dict:
    """domino.pieces = 2 and batches of 1 and 3 rows: the block runs in as many pieces as
    divide the batch (one); logits and one AdamW step as torch's."""
    from offload.engine import full_state_dict
    g = torch.Generator().manual_seed(3)
    x1 = torch.randint(0, VOCAB, (1, 12), generator=g)
    x3, y3 = (torch.randint(0, VOCAB, (3, 12), generator=g) for _ in range(2))
    ref = _model("gpt")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    with torch.no_grad():
        want1 = _logits(ref(x1))
    with offload.initialize(_model("gpt"), _config(os.path.join(d, "uneven"), 2, "host",
                                                   pieces=2)) as engine:
        with torch.no_grad():
            got1 = _logits(engine(x1))
        engine.backward(lm_loss(_logits(engine(x3)), y3))
        engine.step()
        weights = full_state_dict(engine)
    lm_loss(_logits(ref(x3)), y3).backward()
    opt.step()
    return {"logits": (got1 - want1).abs().max().item(),
            "weights": max((weights[k] - v).abs().max().item()
                           for k, v in ref.state_dict().items())}


def _gpt2_dropout() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                      n_positions=32, resid_pdrop=0.5, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="sdpa"))


def _case_eval_no_dropout(d: str) -> dict:
    """GPT-2 with residual dropout 0.5 in eval mode: no dropout, torch's eval logits."""
    x = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = _logits(_gpt2_dropout().eval()(x, use_cache=False))
    with offload.initialize(_gpt2_dropout(), _config(os.path.join(d, "eval"), 2,
                                                     "host")) as engine:
        engine.eval()
        with torch.no_grad():
            got = _logits(engine(x, use_cache=False))
    return {"diff": (got - want).abs().max().item()}


def _case_no_block(d: str) -> dict:
    """A model with no transformer block: refused, not trained whole on every TP rank
    as if tp.size were 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = _state(model)
    out = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "nb"), 2, "host")))
    return out | _unchanged(model, before)


def _case_meta(d: str) -> dict:
    """The GPT-style decoder built on the meta device: its weights cannot be cut."""
    from offload.cli.gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab=VOCAB, max_seq=16))
    before = _state(model)
    out = _outcome(lambda: _init_and_close(model, _config(os.path.join(d, "m"), 2, "host")))
    return out | _unchanged(model, before)


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    d = os.path.dirname(init_file)
    with process_group(rank, world, init_file):
        cases = {"width": lambda: _case_uncuttable_width(d),
                 "linear": lambda: _case_not_a_linear(d),
                 "retry": lambda: _case_retry(d),
                 "restored": lambda: _case_restored(d),
                 "undo": lambda: _case_undo(d),
                 "save_pretrained": lambda: _case_save_pretrained(d, rank),
                 "checkpointing": lambda: _case_checkpointing(d),
                 "refusals": lambda: _case_refusals(d),
                 "ranks_apart": lambda: _case_ranks_apart(d),
                 "frozen": lambda: _case_frozen(d),
                 "modes": lambda: _case_modes(d),
                 "uneven": lambda: _case_uneven_batch(d),
                 "eval": lambda: _case_eval_no_dropout(d),
                 "no_block": lambda: _case_no_block(d),
                 "meta": lambda: _case_meta(d)}
        run_cases(cases, f"{out}.{rank}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list:
    return spawn_cases(_worker, str(tmp_path_factory.mktemp("comm-edges")))


def test_uncuttable_width_leaves_model_as_it_was(outcomes):
    """Before: ConfigError 'cannot cut ... (63, 32)' naming no layer, and the model left
    with its attention cut (ColumnParallel slices in place of q/k/v)."""
    for r in outcomes:
        got = r["width"]
        assert got["config_error"], got
        assert "tp.size" in got["message"] and "mlp.gate_proj" in got["message"], got
        assert not got["cut"] and got["same"], got


def test_layer_that_is_no_linear_is_a_config_error(outcomes):
    """Before: TypeError 'is not an nn.Linear or a Conv1D' from the middle of the cut,
    no tp.size in it, and the first block already cut."""
    for r in outcomes:
        got = r["linear"]
        assert got["config_error"], got
        assert "tp.size" in got["message"] and "blocks.1.mlp.fc" in got["message"], got
        assert not got["cut"] and got["same"], got


def test_retry_after_failed_initialize_is_a_clear_error(outcomes):
    """An initialize refused after the cut (a ConfigError the user fixes), then the
    same model again: before, TypeError 'ColumnParallel is not an nn.Linear or a
    Conv1D'. Now the retry works or is a ConfigError naming tp.size saying what to
    do."""
    for r in outcomes:
        first, second = r["retry"]["first"], r["retry"]["second"]
        assert first["config_error"] and "store.host_budget" in first["message"], first
        if second["error"] is not None:
            assert second["config_error"], second
            assert "tp.size" in second["message"] and "build the model" in second["message"]


def test_plan_undo_puts_the_model_back(outcomes):
    """What the fix of the next test needs: the cut can be undone (layers, blocks and
    GPT-2's local head counts), and the model then computes what it did."""
    for r in outcomes:
        got = r["undo"]
        assert got["cut_before_undo"], got
        assert not got["cut"] and got["same"] and got["same_output"], got


def test_failed_initialize_puts_the_model_back(outcomes):
    """A failed initialize leaves the user's model as it found it (as without TP), so
    the model still runs in plain torch and the retry with the fixed config works."""
    for r in outcomes:
        got = r["restored"]
        assert got["first"]["config_error"], got
        assert not got["cut"] and got["same"], got
        assert got["second"]["error"] is None, got


def test_save_pretrained_under_tensor_parallel(outcomes):
    """What save_pretrained writes under tp.size = 2 is the whole model: transformers'
    from_pretrained reads back the weights it was given, and one rank writes. Before:
    the q/k/v, MLP and projection weights were written at half their width, and rank 1
    raced rank 0 for the directory."""
    got = outcomes[0]["save_pretrained"]
    assert got["written"] > 0 and got["wrong_shapes"] == [], got
    assert got["max_diff"] == 0.0, got
    assert outcomes[1]["save_pretrained"]["error"] is None, outcomes[1]


def test_gradient_checkpointing_under_tensor_parallelism(outcomes):
    """transformers' gradient_checkpointing_enable() set its flag on GPT-2's blocks, which
    tensor parallelism replaces: it was silently off. The blocks now recompute in
    backward, whether it is turned on before initialize or after, with the weights of
    training without it."""
    for r in outcomes:
        got = r["checkpointing"]
        assert "crash" not in got, got
        # more MLP calls: the recomputation's (torch's may stop early, before the last piece)
        assert got["calls"]["before"] == got["calls"]["after"] > got["calls"]["off"], got
        assert got["funcs"] == 4, got  # 2 blocks x 2 steps
        assert max(got["diff"].values()) < 1e-6, got


def test_models_tensor_parallelism_cannot_run_are_refused_as_they_were(outcomes):
    """Heads that do not split over tp.size (GPT's n_head, Llama's key-value heads),
    GPT-2 with cross-attention, weights from a checkpoint and a tp.size that does not
    divide the ranks: a ConfigError at initialize naming what, the model unchanged (not
    a reshape error mid-forward)."""
    want = {"gpt_heads": "attn.n_head = 3 is not a multiple of tp.size = 2",
            "llama_kv_heads": "num_key_value_heads = 1 is not a multiple of tp.size = 2",
            "cross_attention": "cross-attention",
            "checkpoint": "not supported with tensor parallelism",
            "world": "tp.size = 4 does not divide the 2 ranks"}
    for r in outcomes:
        for name, text in want.items():
            got = r["refusals"][name]
            assert got["config_error"] and text in got["message"], (name, got)
            assert not got["cut"] and got["same"], (name, got)


def test_failed_initialize_puts_each_ranks_own_model_back(outcomes):
    """Rank 0's weights are copied to every rank before the cut; a failure after it
    puts back each rank's own (the ranks' models differ here)."""
    for r in outcomes:
        got = r["ranks_apart"]
        assert got["first"]["config_error"], got
        assert not got["cut"] and got["same"], got


def test_frozen_weights_in_cut_layers_stay_frozen(outcomes):
    for r in outcomes:
        assert r["frozen"] == {"frozen_same": True, "trained": True}, r["frozen"]


def test_dropout_and_the_kv_cache_under_tensor_parallelism(outcomes):
    for r in outcomes:
        got = r["modes"]
        assert got["dropped"] > 1e-3 and got["as_torch"] < 1e-5, got
        assert got["cache"]["error"] == "ValueError" and "use_cache=False" in \
            got["cache"]["message"], got
        assert got["no_cache"]["error"] is None, got
        for key in ("output_hidden_states", "output_attentions"):
            assert got[key]["error"] == "ValueError" and f"{key}=True with tp.size > 1" in \
                got[key]["message"], got
        assert got["trains_after"]["error"] is None, got
    assert outcomes[0]["modes"]["train_sum"] == outcomes[1]["modes"]["train_sum"]


def test_dp_groups_hold_the_ranks_of_one_tp_index():
    """[Note: mesh layout]: rank r is at (r // tp, r % tp); the gather thread's second
    communicator is made from these groups, and pairing a TP group's ranks instead
    trained DP x TP = 2 x 2 silently off torch (0.07 after 5 steps)."""
    from types import SimpleNamespace

    from offload.comm.mesh import ParallelMesh
    for dp, tp, want in ((2, 2, [[0, 2], [1, 3]]), (3, 2, [[0, 2, 4], [1, 3, 5]]),
                         (2, 3, [[0, 3], [1, 4], [2, 5]])):
        mesh = ParallelMesh(dp=SimpleNamespace(world=dp), tp=SimpleNamespace(world=tp),
                            world=None, control=None)
        assert mesh.dp_groups == want


def test_a_batch_the_pieces_do_not_divide_runs_as_torch(outcomes):
    for r in outcomes:
        got = r["uneven"]
        assert "crash" not in got, got
        assert got["logits"] < 1e-5 and got["weights"] < 1e-6, got


def test_an_eval_forward_applies_no_residual_dropout(outcomes):
    for r in outcomes:
        got = r["eval"]
        assert "crash" not in got, got
        assert got["diff"] < 1e-5, got


@pytest.mark.parametrize("case,words", [("no_block", "no transformer block"),
                                        ("meta", "meta")])
def test_a_model_tensor_parallelism_cannot_cut_is_refused_as_it_was(outcomes, case, words):
    """A model with no block it knows, or built on the meta device: a ConfigError naming
    tp.size and why, the model as it was."""
    for r in outcomes:
        got = r[case]
        assert got["config_error"], got
        assert "tp.size" in got["message"] and words in got["message"], got
        assert not got["cut"] and got["same"], got
