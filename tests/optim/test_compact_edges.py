"""Compressed Adam moments (optim.state_dtype bf16 / int8) end to end through
`offload.initialize`: checkpoints and state dicts moved between forms and tiers,
skipped steps, loaded scales that cannot be, and the bytes the moments take on
NVMe."""

import io
import os

import pytest
import torch

import offload
from offload.config import IoConfig, OptimConfig
from offload.io import BufferPool, SwapSpace, make_engine
from offload.optim import CpuAdam
from offload.optim.codec import (QBLOCK, Moment, bound_first_moment, decode, encode, moment_bound,
                                 new_moment)
from offload.planner.sizes import state_bytes

from ..engine.models import TiedTwice, lm_batches, lm_loss, lm_train


def _cfg(tmp_path, name, state_dtype, optimizer="nvme", dtype="fp32", **optim):
    return {
        "engine": {"params": "host", "grads": "host", "optimizer": optimizer, "dtype": dtype,
                   "group_size": 3000},
        "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096,
                  "state_dtype": state_dtype, **optim},
        "io": {"paths": [str(tmp_path / name)], "buffer_budget": "32MiB", "grow_step": "4MiB"},
        "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
    }


def _decoded(engine) -> dict:
    """Each partition's committed (step, exp_avg, exp_avg_sq), decoded to fp32."""
    out = {}
    for pid in engine.optimizer.partitions:
        parts: dict[int, dict] = {}
        step = engine.optimizer.read_state_chunks(
            pid, lambda lo, n, d: parts.setdefault(lo, {k: d[k].clone()
                                                        for k in ("exp_avg", "exp_avg_sq")}))
        out[pid] = (step, *(torch.cat([parts[lo][k] for lo in sorted(parts)])
                            for k in ("exp_avg", "exp_avg_sq")))
    return out


def _recoded(x: torch.Tensor, state_dtype: str, kind: str) -> torch.Tensor:
    """`x` stored in `state_dtype`'s form on load (rounded to nearest), decoded again."""
    m = new_moment(state_dtype, kind, x.numel())
    encode(x, m, torch.empty_like(x))
    return decode(m, torch.empty_like(x))


@pytest.mark.parametrize("saved,resumed", [("int8", "bf16"), ("bf16", "int8"),
                                           ("int8", "fp32")])
def test_resume_with_another_state_dtype_encodes_the_saved_moments(tmp_path, saved, resumed):
    """An engine checkpoint holds the moments decoded to fp32, so a resume under another
    `optim.state_dtype` converts them (each encoded in the new form as a load of fp32
    moments is), rather than refusing; weights and step counts are unchanged. From
    int8 into another form, exp_avg keeps the bound the int8 update applies to it
    ([Note: the first moment's bound] in offload/optim/codec.py)."""
    batches = lm_batches(4)
    torch.manual_seed(0)
    ck = tmp_path / "ckpt"
    with offload.initialize(TiedTwice(), _cfg(tmp_path, "a", saved, dtype="bf16")) as a:
        lm_train(a, batches[:2])
        a.save_checkpoint(ck)
        want_w = {k: v.clone() for k, v in a.state_dict().items()}
        want = _decoded(a)
    with offload.initialize(TiedTwice, _cfg(tmp_path, "b", resumed, optimizer="host",
                                            dtype="bf16"), resume=ck) as b:
        got_w = b.state_dict()
        assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)
        got = _decoded(b)
        assert set(got) == set(want)
        c = moment_bound(*b.optimizer.param_groups[0]["betas"])
        for pid, (step, ea, eas) in want.items():
            assert got[pid][0] == step == 2
            if saved == "int8" and resumed != "int8":
                bound_first_moment(ea, eas.sqrt(), c)
            assert torch.equal(got[pid][1], _recoded(ea, resumed, "exp_avg"))
            assert torch.equal(got[pid][2], _recoded(eas, resumed, "exp_avg_sq"))
        assert b.optimizer.state[pid]["exp_avg"].dtype == {
            "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[resumed]
        lm_train(b, batches[2:])
        assert b.global_step == 4


@pytest.mark.parametrize("src,dst", [(("int8", "nvme"), ("bf16", "host")),
                                     (("bf16", "host"), ("int8", "nvme"))])
def test_optimizer_state_dict_through_torch_save_into_another_form_and_tier(tmp_path, src, dst):
    """`engine.optimizer.state_dict()` of compressed moments, through torch.save / load,
    loads into an engine whose moments have another form and tier: the masters (and so
    the bf16 weights) bit for bit, the moments as their values encoded again."""
    batches = lm_batches(3)
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), _cfg(tmp_path, "a", src[0], src[1], "bf16")) as a:
        lm_train(a, batches[:2])
        buf = io.BytesIO()
        torch.save(a.optimizer.state_dict(), buf)
        want_w = {k: v.clone() for k, v in a.state_dict().items()}
        want = _decoded(a)
    buf.seek(0)
    sd = torch.load(buf)
    torch.manual_seed(1)
    with offload.initialize(TiedTwice(), _cfg(tmp_path, "b", dst[0], dst[1], "bf16")) as b:
        b.optimizer.load_state_dict(sd)
        got_w = b.state_dict()
        assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)
        got = _decoded(b)
        for pid, (step, ea, eas) in want.items():
            assert got[pid][0] == step
            assert torch.equal(got[pid][1], _recoded(ea, dst[0], "exp_avg"))
            assert torch.equal(got[pid][2], _recoded(eas, dst[0], "exp_avg_sq"))
        lm_train(b, batches[2:])


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_fp16_overflow_skips_the_step_and_leaves_compressed_state_byte_identical(
        tmp_path, state_dtype):
    """fp16 training with compressed moments on NVMe: an overflowing step is skipped and
    every code, scale, master and step count stays as it was."""
    batches = lm_batches(3)
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), _cfg(tmp_path, "a", state_dtype, "nvme",
                                              "fp16")) as e:
        lm_train(e, batches[:1])
        before = {pid: {k: v.clone() for k, v in st.items()}
                  for pid, st in e.optimizer.state_dict()["state"].items()}
        x, y = batches[1]
        e.backward(lm_loss(e(x), y) * float("inf"))
        assert e.step() is False
        after = e.optimizer.state_dict()["state"]
        for pid, st in before.items():
            assert set(after[pid]) == set(st)
            for k, v in st.items():
                assert torch.equal(after[pid][k], v), (pid, k)
        lm_train(e, batches[2:])


def _int8_opt():
    opt = CpuAdam(OptimConfig(state_dtype="int8", block_elems=1024))
    master = torch.randn(3 * QBLOCK + 17)
    opt.add_partition("x", master)
    opt.step({"x": torch.randn(master.numel())})
    return opt, master


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e38])  # 1e38: finite,
@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_a_loaded_scale_no_encoding_writes_is_refused(kind, bad):
    """A state dict's int8 scale that no encoding writes (NaN, inf, negative: `encode`
    keeps every scale in [smallest normal, FLT_MAX / top]) loaded silently: a NaN, an
    inf or a finite scale above FLT_MAX / top (its top code decodes to inf) made all 256
    moments of its block NaN or inf, and the next step
    turned 256 weights to NaN (a negative one flipped exp_avg's sign). Refused now,
    before anything loads."""
    opt, master = _int8_opt()
    st = {k: v.clone() for k, v in opt.partition_state("x").items()}
    st[kind + "_scale"][1] = bad
    before = {k: v.clone() for k, v in opt.partition_state("x").items()}
    with pytest.raises(ValueError, match=kind + "_scale"):
        opt.load_partition_state("x", st)
    with pytest.raises(ValueError, match=kind + "_scale"):
        opt.load_state_dict({"state": {"x": st}, "param_groups": opt.state_dict()["param_groups"]})
    after = opt.partition_state("x")
    assert all(torch.equal(after[k], v) for k, v in before.items())
    opt.step({"x": torch.randn(master.numel())})
    assert torch.isfinite(master).all()
    # the same codes with their own scales still load, and into another form too
    good = {k: v.clone() for k, v in before.items()}
    opt.load_partition_state("x", good)
    bf = CpuAdam(OptimConfig(state_dtype="bf16", block_elems=1024))
    bf.add_partition("x", torch.zeros(master.numel()))
    bf.load_partition_state("x", good)
    want = decode(Moment(good["exp_avg"], good["exp_avg_scale"], "exp_avg"),
                  torch.empty(master.numel()))
    assert torch.equal(bf.partition_state("x")["exp_avg"], want.to(torch.bfloat16))


@pytest.mark.parametrize("bad", [float("nan"), -1e-3])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_loaded_exp_avg_sq_below_zero_or_nan_is_refused(state_dtype, bad):
    """exp_avg_sq is a mean of squares: a negative or NaN one loaded from an fp32 state
    dict made the next step's weights NaN (fp32, bf16 moments) or was coded as 0
    without a word (int8). Refused before anything loads."""
    opt = CpuAdam(OptimConfig(state_dtype=state_dtype, block_elems=1024))
    master = torch.randn(QBLOCK + 5)
    opt.add_partition("x", master)
    opt.step({"x": torch.randn(master.numel())})
    before = {k: v.clone() for k, v in opt.partition_state("x").items()}
    st = {"step": 1, "exp_avg": torch.zeros(master.numel()),
          "exp_avg_sq": torch.full((master.numel(),), 1e-4)}
    st["exp_avg_sq"][7] = bad
    with pytest.raises(ValueError, match=r"\['exp_avg_sq'\]: element 7 is .*at least 0"):
        opt.load_partition_state("x", st)
    after = opt.partition_state("x")
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("chunk", [4096, 1 << 17])
def test_nvme_bytes_are_each_chunk_rounded_to_4_kib(tmp_path, state_dtype, chunk):
    """What a partition of compressed moments takes in the swap space: each chunk's
    `state_bytes` rounded up to 4 KiB, and nothing else (the estimate's and the
    tuner's per-element figures hold for long chunks; a short int8 chunk carries up
    to 4 KiB of padding after its scales, docs/optim.md)."""
    numel = 3 * chunk + 1000
    cfg = OptimConfig(state_dtype=state_dtype, chunk_elems=chunk, buffers=2, block_elems=4096)
    eng = make_engine(IoConfig(paths=[str(tmp_path)]))
    sw = SwapSpace([str(tmp_path / "swap")], "r0-optim", eng, stripe_size=64 << 10,
                   grow_step=1 << 20)
    pool = BufferPool(16 << 20)
    opt = CpuAdam(cfg, swap=sw, pool=pool, masters=False)
    try:
        opt.add_partition("p", torch.zeros(numel), tier="nvme", master_is_param=True)
        param = torch.randn(numel)
        opt.step({"p": torch.randn(numel)}, params_out={"p": param})
        part = opt.partition("p")
        want = sum(-(-state_bytes(part.layout.chunk(i)[1], 2, state_dtype) // 4096) * 4096
                   for i in range(part.layout.n_chunks))
        assert part.nvme_bytes == want == sw.used_bytes
        per_elem = part.nvme_bytes / numel
        if state_dtype == "bf16" or chunk >= 1 << 17:
            assert per_elem < {"bf16": 4, "int8": 2.03125}[state_dtype] * 1.01
        else:  # 4096 elements: 8320 bytes in a 12288-byte extent
            assert per_elem > 2.9
        files = [f for f in (tmp_path / "swap").iterdir() if f.suffix == ".swap"]
        assert len(files) == 1 and os.path.getsize(files[0]) >= want
    finally:
        opt.close()
        pool.close(force=True)
        sw.close()
        eng.close()
