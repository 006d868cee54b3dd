"""The optimizer's state loads and reads: a state dict in another form of the moments
loaded into host int8 state, refusals that change nothing, reads during an open round
that see the committed state ([Note: rounds] in offload/optim/optimizer.py)."""

import copy

import pytest
import torch

from offload.config import OptimConfig
from offload.optim import CpuAdam
from offload.optim.codec import QBLOCK, decode, encode, new_moment

N = 2 * QBLOCK + 88  # a tail block


def _trained(state_dtype: str = "fp32", steps: int = 2, pids=("x",)) -> CpuAdam:
    g = torch.Generator().manual_seed(0)
    opt = CpuAdam(OptimConfig(state_dtype=state_dtype))
    for pid in pids:
        opt.add_partition(pid, torch.randn(N, generator=g))
    for _ in range(steps):
        opt.step({pid: torch.randn(N, generator=g) for pid in pids})
    return opt


def test_fp32_moments_load_into_host_int8_state_as_their_codes():
    """An fp32 optimizer's state dict loaded by an int8 optimizer whose state is in host
    memory: each moment is encoded (rounded to nearest, one scale per block), so it
    decodes to within half a code step of the saved value, as `codec.encode` gives it."""
    sd = _trained("fp32").state_dict()
    dst = CpuAdam(OptimConfig(state_dtype="int8"))
    dst.add_partition("x", torch.zeros(N))
    dst.load_state_dict(sd)
    st = dst.partition_state("x")
    assert float(st["step"]) == 2
    assert torch.equal(st["master"], sd["state"]["x"]["master"])
    for kind, top in (("exp_avg", 127.0), ("exp_avg_sq", 255.0)):
        x = sd["state"]["x"][kind]
        want = new_moment("int8", kind, N)
        encode(x, want, torch.empty(N))
        assert torch.equal(st[kind], want.data)
        assert torch.equal(st[kind + "_scale"], want.scale)
        got = decode(new_moment("int8", kind, N)._replace(data=st[kind],
                                                          scale=st[kind + "_scale"]),
                     torch.empty(N))
        # within half a step of the block's code (sqrt-coded for exp_avg_sq)
        src = x.sqrt() if kind == "exp_avg_sq" else x
        dec = got.sqrt() if kind == "exp_avg_sq" else got
        for b in range(0, N, QBLOCK):
            blk = slice(b, min(N, b + QBLOCK))
            step = float(src[blk].abs().max()) / top
            assert float((dec[blk] - src[blk]).abs().max()) <= step / 2 * (1 + 1e-5)


def test_a_negative_step_in_a_state_dict_is_refused_and_changes_nothing():
    """A step below 0 is damage (the next update's bias correction would divide by
    1 - beta**0 = 0): refused, the partition's state as before."""
    opt = _trained("fp32")
    before = {k: v.clone() for k, v in opt.partition_state("x").items()}
    st = {**copy.deepcopy(opt.partition_state("x")), "step": torch.tensor(-1.0)}
    st.pop("segment_steps")
    with pytest.raises(ValueError, match="negative"):
        opt.load_partition_state("x", st)
    after = opt.partition_state("x")
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_load_partition_state_of_a_partition_updated_in_the_open_round_is_refused(state_dtype):
    """`load_partition_state` (called on its own, as `engine.full_weights` does) refuses a
    partition the open round has updated; a rollback then gives the committed state."""
    opt = _trained(state_dtype)
    committed = {k: v.clone() for k, v in opt.partition_state("x").items()}
    st = copy.deepcopy(committed)
    st["master"] = torch.zeros(N)
    opt.update({"x": torch.randn(N)})
    with pytest.raises(ValueError, match="open round"):
        opt.load_partition_state("x", st)
    opt.rollback()
    after = opt.partition_state("x")
    assert all(torch.equal(after[k], v) for k, v in committed.items())


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_read_state_chunks_of_a_host_partition_in_an_open_round_reads_the_committed_state(
        state_dtype):
    """[Note: rounds]: an update in the open round is not seen by `read_state_chunks`
    (engine checkpoints): it streams the committed step and moments, the same values
    `partition_state` gives, not those of the pending update."""
    opt = _trained(state_dtype)
    committed = opt.read_state_chunks("x", lambda lo, n, d: None)
    want = {}
    opt.read_state_chunks("x", lambda lo, n, d: want.setdefault(lo, {k: v.clone()
                                                                     for k, v in d.items()}))
    opt.update({"x": torch.randn(N, generator=torch.Generator().manual_seed(5))})
    got = {}
    step = opt.read_state_chunks("x", lambda lo, n, d: got.setdefault(lo, {k: v.clone()
                                                                          for k, v in d.items()}))
    assert step == committed == 2
    assert sorted(got) == sorted(want)
    for lo in want:
        assert set(got[lo]) == set(want[lo])
        for k in want[lo]:
            assert torch.equal(got[lo][k], want[lo][k]), (lo, k)
    opt.commit()
    after = {}
    step = opt.read_state_chunks("x", lambda lo, n, d: after.setdefault(lo, d["exp_avg"].clone()))
    assert step == 3
    assert not all(torch.equal(after[lo], want[lo]["exp_avg"]) for lo in want)


def test_read_master_of_a_host_partition_in_an_open_round_reads_the_committed_master():
    """`read_master` (the engine rebuilds compute-dtype parameters from it) reads the
    committed master while an update waits in the open round: the pending update shows
    only after commit()."""
    opt = _trained("fp32")
    committed = opt.partition_state("x")["master"].clone()
    opt.update({"x": torch.randn(N, generator=torch.Generator().manual_seed(5))})
    out = torch.empty(N, dtype=torch.bfloat16)
    assert torch.equal(opt.read_master("x", out), committed.to(torch.bfloat16))
    opt.commit()
    new = opt.partition_state("x")["master"]
    assert not torch.equal(new, committed)
    assert torch.equal(opt.read_master("x", out), new.to(torch.bfloat16))


def test_read_state_chunks_of_a_partition_updated_in_place_in_the_open_round_is_refused():
    """An update with final=True keeps no committed version: `read_state_chunks` (an
    engine checkpoint) refuses the partition rather than stream the new moments and
    master under the committed step."""
    opt = _trained("fp32")
    opt.update({"x": torch.randn(N, generator=torch.Generator().manual_seed(5))}, final=True)
    seen = []
    with pytest.raises(RuntimeError, match="final=True"):
        opt.read_state_chunks("x", lambda lo, n, d: seen.append(lo))
    assert not seen
    opt.commit()
    assert opt.read_state_chunks("x", lambda lo, n, d: seen.append(lo)) == 3
