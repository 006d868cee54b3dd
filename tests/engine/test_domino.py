"""Tensor parallelism with Domino slicing (tp.size, domino.pieces) against one process
of plain torch: the GPT-style decoder of `offload demo` and Hugging Face Llama and
GPT-2 models, TP = 2 and DP = 2 x TP = 2 (gloo), weights in host memory or on
NVMe; and the trace shows each piece's all-reduce running behind the next piece.

Each test spawns its ranks once and runs several cases in them (starting processes
is most of the time on a small machine).

[Note: Adam's eps in these tests]
A key projection's bias has a zero gradient in exact arithmetic (softmax is
shift-invariant), so what it gets is rounding noise, different for any change of
summation order (tensor-parallel matmuls, a world of 1 against torch alike), and
Adam with eps 1e-8 turns that noise into steps of the learning rate's size. These
tests use eps 1e-3 (a gradient element near zero then moves its weight by at most
lr x g / eps): rounding noise stays below 1e-7, and every weight is compared at
1e-6.
"""

import os

import pytest
import torch

import offload
from offload.config import ConfigError
from offload.trace import TraceRecorder
from offload.trace.analysis import parse_trace
from offload.trace.chrome import to_chrome_trace

from .models import lm_loss
from .ranks import process_group, spawn


STEPS = 5
EPS = 1e-3  # [Note: Adam's eps in these tests]
VOCAB = 32


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from offload.cli.gpt import GPT, GPTConfig
        return GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab=VOCAB, max_seq=16))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32,
            attn_implementation="sdpa"))
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="sdpa"))


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _batches(batch: int = 8, seq: int = 12) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g),
             torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(STEPS)]


def _reference(name: str, clip: float = 0.0) -> dict:
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    for x, y in _batches():
        opt.zero_grad()
        lm_loss(_logits(model(x)), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def _config(swap: str, tp: int, placement: str, pieces: int = 2, clip: float = 0.0) -> dict:
    """`placement` device (no offload: the CPU is the device here), host or nvme."""
    return {"engine": {"params": placement, "grads": placement,
                       "optimizer": "nvme" if placement == "nvme" else "host",
                       "group_size": 3000},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "eps": EPS, "chunk_elems": 4096,
                      "max_grad_norm": clip},
            "io": {"paths": [swap], "buffer_budget": "32MiB", "grow_step": "4MiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
            "tp": {"size": tp}, "domino": {"pieces": pieces}}


def _train(rank: int, world: int, tp: int, name: str, cfg: dict,
           rec: TraceRecorder | None = None) -> dict:
    """Trains `name` on this rank's DP share of the global batches; the full weights."""
    import offload
    from offload.engine import full_state_dict
    dp, me = world // tp, rank // tp
    kw = {} if rec is None else {"recorder": rec}
    with offload.initialize(_model(name), cfg, **kw) as engine:
        for step, (x, y) in enumerate(_batches()):
            if rec is not None and step == STEPS - 1:
                rec.clear()  # one step in steady state
            x, y = (t.chunk(dp)[me].to(engine.device) for t in (x, y))
            engine.backward(lm_loss(_logits(engine(x)), y))
            engine.step()
        return full_state_dict(engine)


def _spans(rec: TraceRecorder) -> list:
    (rt,) = parse_trace(to_chrome_trace(rec))
    return [(s.name, s.cat, s.start, s.end, (s.args or {}).get("group")) for s in rt.spans]


def _worker(rank: int, world: int, init_file: str, out: str, tp: int, cases: list,
            gpu: bool) -> None:
    with process_group(rank, world, init_file, "nccl" if gpu else "gloo"):
        results = {}
        for case in cases:
            swap = os.path.join(os.path.dirname(init_file), "swap-" + "-".join(map(str, case)))
            cfg = _config(swap, tp, *case[1:])
            if gpu:
                cfg["store"]["device"] = f"cuda:{rank}"
            rec = TraceRecorder(enabled=True, rank=rank)
            sd = _train(rank, world, tp, case[0], cfg, rec)
            results[case] = {"sd": sd, "spans": _spans(rec)}
        if rank == 0:
            torch.save(results, out)


def _run(tmp_path, world: int, tp: int, cases: list, gpu: bool = False) -> dict:
    out = str(tmp_path / "out.pt")
    spawn(_worker, str(tmp_path / "init"), out, tp, cases, gpu, world=world)
    return torch.load(out)


def _compare(got: dict, want: dict, what, atol: float = 1e-6) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        torch.testing.assert_close(got[k].cpu(), v, atol=atol, rtol=0,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


def _behind(spans: list, compute: str) -> int:
    """TP all-reduces in flight (issue to the wait that saw them done) while a
    `compute` span ended: compute ran behind them."""
    comms = [(a, b) for name, cat, a, b, group in spans if cat == "comm" and group == "tp"]
    ends = [d for name, _cat, _c, d, _g in spans if name.startswith(compute)]
    return sum(any(a < d < b for d in ends) for a, b in comms)


@pytest.mark.distributed
@pytest.mark.parametrize("cases", [
    pytest.param([("gpt", "nvme", 2), ("gpt", "host", 1)], id="gpt"),
    # the default suite's time (3 s): the "gpt" case runs the same TP code on the
    # GPT-style decoder; this one adds transformers' blocks (matched by name)
    pytest.param([("llama", "host", 2), ("gpt2", "host", 2)], id="hf",
                 marks=pytest.mark.slow)])
def test_tensor_parallel_matches_one_process(tmp_path, cases):
    """TP = 2: the GPT-style decoder (no offload, NVMe), Llama and GPT-2 match torch's AdamW
    after 5 steps; with 2 pieces a forward all-reduce runs behind the next piece's
    compute, with 1 none does; in backward each column layer's input-gradient
    all-reduce runs behind its weight gradient either way."""
    got = _run(tmp_path, 2, 2, cases)
    refs = {name: _reference(name) for name in {case[0] for case in cases}}
    for case, r in got.items():
        _compare(r["sd"], refs[case[0]], case)
    for case, r in got.items():
        forward = _behind(r["spans"], "domino:")
        backward = _behind(r["spans"], "tp:weight-grad")
        assert backward >= 2, (case, backward)
        if case[2] == 1:
            assert forward == 0, (case, forward)
        else:
            assert forward >= 4, (case, forward)  # per block: 1 attention, 1 MLP at least


@pytest.mark.distributed
@pytest.mark.parametrize("cases", [
    pytest.param([("gpt", "host", 2, 0.05)], id="clipped"),
    pytest.param([("gpt", "nvme", 2, 0.0), ("llama", "host", 2, 0.0)], id="nvme-llama",
                 marks=pytest.mark.slow)])  # 4 ranks on 2 cores: the default suite's time
def test_data_and_tensor_parallel_match_one_process(tmp_path, cases):
    """DP = 2 x TP = 2 (4 ranks): ZeRO-3 over the DP pairs, TP inside each pair; with
    gradient-norm clipping (a norm of 0.05 clips every step here), each weight
    counted once: sliced weights over all ranks, replicated ones over DP."""
    got = _run(tmp_path, 4, 2, cases)
    for case, r in got.items():
        _compare(r["sd"], _reference(case[0], case[3]), case)


@pytest.mark.parametrize("section,value", [
    ({"tp": {"size": 0}}, "tp.size"), ({"domino": {"pieces": 0}}, "domino.pieces"),
    ({"domino": {"pieces": 65}}, "domino.pieces"), ({"tp": {"sizes": 2}}, "tp.sizes"),
    ({"domino": {"pieces": "2"}}, "domino.pieces")])
def test_bad_keys_are_named(section, value):
    with pytest.raises(ConfigError, match=value.replace(".", r"\.")):
        offload.load_config(section)


def test_tensor_parallel_needs_ranks(tmp_path):
    """Without torch.distributed (or a world tp.size does not divide) initialize refuses,
    naming tp.size, before it makes anything."""
    cfg = _config(str(tmp_path / "swap"), 2, "host")
    with pytest.raises(ConfigError, match=r"tp\.size.*torchrun"):
        offload.initialize(_model("gpt"), cfg)
    assert not (tmp_path / "swap").exists()


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_on_nccl(tmp_path):
    """The same code on 2 GPUs (NCCL, a CUDA device mesh): TP = 2 matches one CPU process
    of torch (1e-5: GPU kernels sum in other orders), and the forward all-reduces run
    behind the next piece."""
    got = _run(tmp_path, 2, 2, [("gpt", "device", 2), ("llama", "host", 2)], gpu=True)
    for case, r in got.items():
        _compare(r["sd"], _reference(case[0]), case, atol=1e-5)
        assert _behind(r["spans"], "domino:") >= 4, case


def _generate_worker(rank: int, world: int, init_file: str, out: str) -> None:
    from offload.engine import full_state_dict
    with process_group(rank, world, init_file, "gloo"):
        swap = os.path.join(os.path.dirname(init_file), f"swap-generate-{rank}")
        with offload.initialize(_model("llama"), _config(swap, 2, "host")) as engine:
            ref = _model("llama")
            ref.load_state_dict(full_state_dict(engine))
            prompt = torch.tensor([[1, 2, 3]])
            got = {}
            with torch.no_grad():
                for how in ("engine", "model"):
                    call = engine.generate if how == "engine" else engine.module.generate
                    try:
                        call(prompt, max_new_tokens=5, do_sample=False)
                    except ValueError as e:
                        got[how] = str(e)
                got["tokens"] = engine.generate(prompt, max_new_tokens=5, do_sample=False,
                                                use_cache=False).tolist()
                got["torch"] = ref.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
        if rank == 0:
            torch.save(got, out)


@pytest.mark.distributed
def test_generate_under_tensor_parallelism_needs_the_cache_off(tmp_path):
    """The cut blocks keep no KV cache: generate in training mode (which transformers
    keeps) ran each step after the first without the past tokens, other tokens than
    torch's, silently. With the cache on it is refused (the engine's and the model's
    own); with use_cache=False it gives torch's tokens."""
    out = str(tmp_path / "out.pt")
    spawn(_generate_worker, str(tmp_path / "init"), out, world=2)
    got = torch.load(out)
    for how in ("engine", "model"):
        assert "use_cache=False" in got.get(how, ""), got
    assert got["tokens"] == got["torch"], got
