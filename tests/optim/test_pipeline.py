"""State on NVMe: the pipelined step against host state, failures, prefetch, checkpoints."""

import os
import threading

import pytest
import torch

from offload.config import OptimConfig
from offload.io import IoError, SwapFullError, SwapSpace
from offload.optim import CpuAdam, OptimStepError, resolve_chunk_elems

from .conftest import grads_for, make_opt, random_numels

CHUNK = 4096


def _cfg(buffers: int = 3, **kw) -> OptimConfig:
    return OptimConfig(chunk_elems=CHUNK, buffers=buffers, block_elems=1024, lr=1e-2,
                       weight_decay=0.1, **kw)


def _masters(seed: int, count: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"p{k}": torch.randn(n, generator=g)
            for k, n in enumerate(random_numels(seed, count, CHUNK))}


def _assert_same_state(a: CpuAdam, b: CpuAdam, pids) -> None:
    for pid in pids:
        sa, sb = a.partition_state(pid), b.partition_state(pid)
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k], sb[k]), (pid, k)


@pytest.mark.parametrize("buffers", [1, 2, 3, 5])
def test_nvme_state_is_bit_identical_to_host_state(swap, pool, buffers):
    masters = _masters(buffers)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(buffers, max_grad_norm=5.0)
    host = make_opt(cfg, masters)
    nvme = make_opt(cfg, masters, "nvme", swap, pool)
    assert swap.used_bytes >= 12 * sum(numels.values())
    for step in range(3):
        grads = grads_for(numels, step, scale=128.0)
        out_h = {p: torch.empty(n, dtype=torch.bfloat16) for p, n in numels.items()}
        out_n = {p: torch.empty(n, dtype=torch.bfloat16) for p, n in numels.items()}
        rh = host.step(grads, params_out=out_h, loss_scale=128.0)
        rn = nvme.step(grads, params_out=out_n, loss_scale=128.0)
        assert rh.grad_norm == rn.grad_norm and rn.bytes_read == rn.bytes_written == \
            12 * sum(numels.values())
        for p in numels:
            assert torch.equal(out_h[p], out_n[p])
    _assert_same_state(host, nvme, numels)
    used = swap.used_bytes
    nvme.step(grads_for(numels, 9))
    assert swap.used_bytes == used  # old extents freed at each commit
    assert pool.stats().held_bytes <= buffers * (12 * CHUNK + 4096)  # a fixed set of buffers
    nvme.close()
    assert swap.used_bytes == 0


def test_prefetch_reads_early_and_changes_nothing(swap, pool):
    masters = _masters(11, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    host = make_opt(_cfg(), masters)
    nvme = make_opt(_cfg(), masters, "nvme", swap, pool)
    for step in range(2):
        grads = grads_for(numels, step)
        last = list(numels)[-1]
        assert nvme.prefetch(last) == 2  # buffers - 1 chunks, into idle slots
        assert nvme.prefetch("p0") == 1  # the one idle slot left
        assert nvme.prefetch("p1") == 0  # none left: nothing waits
        host.step(grads)
        res = nvme.step(grads)
        assert res.updated[0] == last and res.bytes_read == 12 * sum(numels.values())
    _assert_same_state(host, nvme, numels)
    h = CpuAdam(_cfg())
    h.add_partition("x", torch.randn(10))
    assert h.prefetch("x") == 0
    # While a step runs (here: another thread holds the optimizer), prefetch never waits.
    held, release = threading.Event(), threading.Event()

    def hold():
        with nvme._lock:
            held.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert nvme.prefetch("p0") == 0
    finally:
        release.set()
        t.join()
    assert nvme.prefetch("p0") >= 1


def test_an_update_that_needs_buffers_drops_the_prefetch_needed_last(swap, pool):
    """Prefetches are issued in the order they will be needed. When an update of a
    partition nobody prefetched finds every buffer holding one, it takes the newest
    first: the reads needed soonest stay, and the next update finds them done."""
    g = torch.Generator().manual_seed(5)
    masters = {pid: torch.randn(3 * CHUNK, generator=g) for pid in ("p0", "p1", "p2")}
    numels = {pid: m.numel() for pid, m in masters.items()}
    host = make_opt(_cfg(), masters)
    nvme = make_opt(_cfg(), masters, "nvme", swap, pool)
    grads = grads_for(numels, 0)
    assert nvme.prefetch("p2") == 2 and nvme.prefetch("p0") == 1  # every buffer holds one
    nvme.update({"p1": grads["p1"]})
    assert nvme._pipeline.prefetched() == ["p2"]  # p0's read (issued last) gave way first
    nvme.update({"p2": grads["p2"]})
    nvme.update({"p0": grads["p0"]})
    nvme.commit()
    host.step(grads)
    _assert_same_state(host, nvme, numels)


def _fail_writes_after(opt: CpuAdam, swap: SwapSpace, n_updates: int):
    """After `n_updates` chunk updates, every further write fails for real (EBADF):
    the swap file's fd is swapped for a read-only one, as tests/io/test_swap.py does."""
    f = swap._files[0]
    state = {"calls": 0, "rw_fd": f.fd}
    inner = opt.kernel.update

    def update(*a, **kw):
        inner(*a, **kw)
        state["calls"] += 1
        if state["calls"] == n_updates:
            f.fd = os.open(f.path, os.O_RDONLY | os.O_DIRECT)
    opt.kernel.update = update

    def restore():
        if f.fd != state["rw_fd"]:
            os.close(f.fd)
            f.fd = state["rw_fd"]
        opt.kernel.update = inner
    return restore


@pytest.mark.parametrize("buffers", [1, 2, 3])
@pytest.mark.parametrize("fail_after", [1, 6])
def test_failed_write_mid_step_leaves_every_partition_at_its_previous_version(
        swap, pool, buffers, fail_after):
    masters = _masters(20 + buffers, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(buffers, max_grad_norm=1.0)
    old = make_opt(cfg, masters)                           # the previous version
    new = make_opt(cfg, masters)                           # this step's version
    nvme = make_opt(cfg, masters, "nvme", swap, pool)
    grads = grads_for(numels, 0)
    new.step(grads)
    used = swap.used_bytes
    restore = _fail_writes_after(nvme, swap, fail_after)
    try:
        with pytest.raises(OptimStepError) as err:
            nvme.step(grads, params_out={p: torch.empty(n) for p, n in numels.items()})
    finally:
        restore()
    e = err.value
    assert isinstance(e.__cause__, IoError)
    assert e.updated == [] and sorted(e.unchanged) == sorted(numels)  # all or nothing
    _assert_same_state(nvme, old, numels)
    assert all(nvme.partition(p).step == 0 for p in numels) and nvme.round == []
    assert swap.used_bytes == used == sum(nvme.partition(p).nvme_bytes for p in numels)
    # The disk works again: the same step again gives the version of a run that never failed.
    nvme.step(grads)
    _assert_same_state(nvme, new, numels)


def test_full_swap_mid_step_leaves_every_partition_at_its_previous_version(engine, pool,
                                                                          tmp_path):
    masters = {"a": torch.randn(3 * CHUNK), "b": torch.randn(3 * CHUNK)}
    numels = {p: m.numel() for p, m in masters.items()}
    state_bytes = 12 * sum(numels.values())
    # Room for the state and one partition's rewrite, not for the whole round's.
    with SwapSpace([str(tmp_path)], "full", engine, stripe_size=64 << 10, grow_step=64 << 10,
                   max_size=state_bytes + 12 * CHUNK * 4) as sw:
        nvme = make_opt(_cfg(2), masters, "nvme", sw, pool)
        old = make_opt(_cfg(2), masters)
        new = make_opt(_cfg(2), masters)
        grads = grads_for(numels, 1)
        new.step(grads)
        with pytest.raises(OptimStepError) as err:
            nvme.step(grads)
        e = err.value
        assert isinstance(e.__cause__, SwapFullError)
        assert e.updated == [] and sorted(e.unchanged) == ["a", "b"]
        _assert_same_state(nvme, old, numels)
        sw.max_size = 0  # room again
        nvme.step(grads)
        _assert_same_state(nvme, new, numels)
        nvme.close()


def test_state_dict_round_trip(swap, pool):
    masters = _masters(30, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    src = make_opt(_cfg(), masters, "nvme", swap, pool)
    for step in range(2):
        src.step(grads_for(numels, step))
    sd = src.state_dict()
    assert sd["param_groups"][0]["params"] == list(numels)
    assert all(float(s["step"]) == 2 for s in sd["state"].values())
    fresh = {pid: torch.zeros(n) for pid, n in numels.items()}
    dst_host = make_opt(_cfg(), fresh)
    dst_nvme = make_opt(_cfg(), fresh, "nvme", swap, pool)
    dst_host.load_state_dict(sd)
    dst_nvme.load_state_dict(sd)
    for opt in (src, dst_host, dst_nvme):
        opt.step(grads_for(numels, 5))
    _assert_same_state(src, dst_host, numels)
    _assert_same_state(src, dst_nvme, numels)
    out = torch.empty(numels["p0"], dtype=torch.bfloat16)
    assert torch.equal(dst_nvme.read_master("p0", out),
                       src.partition_state("p0")["master"].to(torch.bfloat16))
    # Without "master" (a torch optimizer's state), the current master stays.
    before = dst_nvme.partition_state("p1")["master"]
    st = {k: v for k, v in sd["state"]["p1"].items() if k != "master"}
    dst_nvme.load_partition_state("p1", st)
    assert torch.equal(dst_nvme.partition_state("p1")["master"], before)
    assert torch.equal(dst_nvme.partition_state("p1")["exp_avg"], sd["state"]["p1"]["exp_avg"])
    with pytest.raises(ValueError, match="param groups"):
        dst_nvme.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="elements"):
        dst_nvme.load_partition_state("p0", {"step": 1, "exp_avg": torch.zeros(3),
                                             "exp_avg_sq": torch.zeros(3)})


def test_chunk_size_follows_the_host_budget():
    cfg = OptimConfig(buffers=3)
    assert resolve_chunk_elems(cfg, 1 << 30) == 1 << 23  # capped
    assert resolve_chunk_elems(cfg, 64 << 20) == 1 << 19  # 32 MiB / 3 / 12 B, to a power of 2
    assert resolve_chunk_elems(OptimConfig(), 1 << 30) == 1 << 22  # 512 MiB / 6 / 12 B
    with pytest.raises(ValueError, match="buffer_budget"):
        resolve_chunk_elems(cfg, 1 << 16)
    with pytest.raises(ValueError, match="chunk_elems"):
        resolve_chunk_elems(OptimConfig(chunk_elems=1 << 20), 1 << 20)
    # without masters (fp32 training) a chunk is 8 B/element: the same budget, twice the chunk
    assert resolve_chunk_elems(cfg, 64 << 20, masters=False) == 1 << 20  # 32 MiB / 3 / 8 B
    explicit = OptimConfig(buffers=3, chunk_elems=1 << 20)  # 3 x 8 MiB fit 30 MiB, 3 x 12 do not
    assert resolve_chunk_elems(explicit, 30 << 20, masters=False) == 1 << 20
    with pytest.raises(ValueError, match="chunk_elems"):
        resolve_chunk_elems(explicit, 30 << 20)


def test_an_optimizer_without_masters_sizes_its_buffers_for_the_moments(swap, pool):
    """masters=False: chunk buffers hold the moments alone (larger chunks from the same
    budget), the update matches a host optimizer keeping the master, and a partition
    that would keep its own master on NVMe is refused before anything is written."""
    cfg = OptimConfig(buffers=2, block_elems=1024, lr=1e-2, weight_decay=0.1)
    lean = CpuAdam(cfg, swap=swap, pool=pool, masters=False, buffer_budget=1 << 20)
    full = CpuAdam(cfg, swap=swap, pool=pool, buffer_budget=1 << 20)
    assert lean.chunk_elems == 2 * full.chunk_elems == 1 << 15  # 512 KiB / 2 / 8 B
    assert lean._pipeline.slot_bytes == 8 * lean.chunk_elems
    used = swap.used_bytes
    with pytest.raises(ValueError, match="master_is_param"):
        lean.add_partition("own", torch.zeros(100), tier="nvme")
    assert lean.partitions == [] and swap.used_bytes == used
    numels = {"p": 3 * lean.chunk_elems + 17, "q": 1000}
    masters = {k: torch.randn(n, generator=torch.Generator().manual_seed(1))
               for k, n in numels.items()}
    ref = make_opt(cfg, masters)
    params = {k: m.clone() for k, m in masters.items()}
    for k, p in params.items():
        lean.add_partition(k, p, tier="nvme", master_is_param=True)
    for step in range(3):
        grads = grads_for(numels, step, scale=4.0)
        ref.step(grads)
        lean.step(grads, params_out=params)
    for k in numels:
        want, got = ref.partition_state(k), lean.partition_state(k)
        assert torch.equal(params[k], want["master"])
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[name], want[name]), (k, name)


def test_mixed_tiers_in_one_optimizer(swap, pool):
    masters = _masters(40, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    host = make_opt(_cfg(), masters)
    mixed = CpuAdam(_cfg(), swap=swap, pool=pool)
    kept = {}
    for k, (pid, m) in enumerate(masters.items()):
        kept[pid] = m.clone()
        mixed.add_partition(pid, kept[pid], tier="host" if k % 2 else "nvme")
    ptr = {pid: t.data_ptr() for pid, t in kept.items()}
    for step in range(2):
        grads = grads_for(numels, step)
        host.step(grads, loss_scale=4.0)
        mixed.step(grads, loss_scale=4.0)
    _assert_same_state(host, mixed, numels)
    for k, pid in enumerate(numels):
        if k % 2:  # host state: the caller's tensor, updated in place, no copy
            assert kept[pid].data_ptr() == ptr[pid]
            assert torch.equal(kept[pid], host.partition_state(pid)["master"])


def test_corrupt_chunk_mid_step_leaves_every_partition_at_its_previous_version(swap, pool):
    masters = {"a": torch.randn(2 * CHUNK), "b": torch.randn(2 * CHUNK + 5)}
    numels = {p: m.numel() for p, m in masters.items()}
    nvme = make_opt(_cfg(1), masters, "nvme", swap, pool)
    old = make_opt(_cfg(1), masters)
    ext = nvme.partition("b").extents[1]
    with open(swap.paths[0], "r+b") as f:  # flip a byte of b's last chunk behind our back
        f.seek(ext.offset + 100)
        byte = f.read(1)
        f.seek(ext.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    used = swap.used_bytes
    with pytest.raises(OptimStepError) as err:
        nvme.step(grads_for(numels, 0))
    assert type(err.value.__cause__).__name__ == "CorruptionError"
    assert err.value.updated == [] and sorted(err.value.unchanged) == ["a", "b"]
    assert nvme.partition("b").step == 0 and nvme.partition("a").step == 0
    _assert_same_state(nvme, old, ["a"])
    assert swap.used_bytes == used


def _flip(swap: SwapSpace, offset: int) -> None:
    with open(swap.paths[0], "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_read_ahead_that_failed_is_read_again_where_it_is_taken(swap, pool):
    """[Note: a read ahead that failed] A read prefetch() started that failed (bytes
    corrupted for a moment) is read again by the call that takes it: the state reads
    and the step work, as the host state's. One that fails again is that call's."""
    masters = {"a": torch.randn(2 * CHUNK), "b": torch.randn(CHUNK + 7)}
    numels = {p: m.numel() for p, m in masters.items()}
    host = make_opt(_cfg(), masters)
    nvme = make_opt(_cfg(), masters, "nvme", swap, pool)
    offset = nvme.partition("a").extents[0].offset + 100
    for take in ("partition_state", "step"):
        _flip(swap, offset)
        assert nvme.prefetch("a") == 2
        while not all(s.read.done() for s in nvme._pipeline._reads.values()):
            pass  # the reads of the corrupted bytes are over
        _flip(swap, offset)  # the disk holds the right bytes again
        if take == "step":
            host.step(grads_for(numels, 0))
            nvme.step(grads_for(numels, 0))
        _assert_same_state(host, nvme, numels)
    _flip(swap, nvme.partition("a").extents[0].offset + 100)
    assert nvme.prefetch("a") == 2
    with pytest.raises(OptimStepError) as err:  # corrupted on disk: the read again fails
        nvme.step(grads_for(numels, 1))
    assert type(err.value.__cause__).__name__ == "CorruptionError"


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_prefetches_filling_every_buffer_do_not_stall_the_step(swap, pool, buffers):
    masters = {k: torch.randn(2 * CHUNK + 7) for k in "abcd"}
    numels = {p: m.numel() for p, m in masters.items()}
    host = make_opt(_cfg(buffers), masters)
    nvme = make_opt(_cfg(buffers), masters, "nvme", swap, pool)
    for step in range(2):
        for pid in "dcba":  # backward order: every buffer ends up holding a prefetch
            nvme.prefetch(pid)
        grads = grads_for(numels, step)
        host.step(grads)
        if step == 0:
            res = nvme.step(grads)
        else:  # prefetched partitions outside an update keep or give up their buffers
            nvme.update({"a": grads["a"], "b": grads["b"]})
            res = nvme.step({"c": grads["c"], "d": grads["d"]})
        assert res.bytes_read == res.bytes_written
    _assert_same_state(host, nvme, numels)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_master_is_param_keeps_moments_only_and_matches(swap, pool, tier):
    """fp32 training: the caller's parameter partition is the master; the optimizer
    stores and moves only the moments (8 B/element) and the results are bit-identical."""
    masters = _masters(7)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(3, max_grad_norm=5.0)
    ref = make_opt(cfg, masters)
    opt = CpuAdam(cfg, swap=swap if tier == "nvme" else None,
                  pool=pool if tier == "nvme" else None)
    params = {pid: m.clone() for pid, m in masters.items()}
    for pid, p in params.items():
        opt.add_partition(pid, p, tier=tier, master_is_param=True)
        assert not opt.has_master(pid)
    if tier == "nvme":
        assert 8 * sum(numels.values()) <= swap.used_bytes < 12 * sum(numels.values())
    with pytest.raises(ValueError, match="master_is_param"):
        opt.step(grads_for(numels, 0))  # the parameters must come along
    for step in range(3):
        grads = grads_for(numels, step, scale=4.0)
        ref.step(grads)
        res = opt.step(grads, params_out=params)
        if tier == "nvme":
            assert res.bytes_read == res.bytes_written == 8 * sum(numels.values())
    for pid in numels:
        want, got = ref.partition_state(pid), opt.partition_state(pid)
        assert "master" not in got and torch.equal(params[pid], want["master"])
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[k], want[k]), (pid, k)
    with pytest.raises(ValueError, match="keeps no master"):
        opt.read_master("p0", torch.empty(numels["p0"]))
    sd = opt.state_dict()
    opt.load_state_dict(sd)  # round trip: the moments come back, no master expected
    for pid in numels:
        assert torch.equal(opt.partition_state(pid)["exp_avg"], sd["state"][pid]["exp_avg"])
    opt.close()
    ref.close()


def test_update_reads_the_next_partition_ahead(swap, pool):
    """update(next_pid=...) leaves the next partition's first chunks reading; using
    them changes no result."""
    masters = _masters(11, count=2)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(4)
    ahead = make_opt(cfg, masters, "nvme", swap, pool)
    plain = make_opt(cfg, masters)
    first, second = list(numels)[:2]
    for step in range(2):
        grads = grads_for(numels, step)
        ahead.update({first: grads[first]}, next_pid=second)
        assert ahead._pipeline.prefetched() == [second]
        ahead.update({second: grads[second]})
        ahead.step({}, skip=[p for p in numels if p not in (first, second)])
        plain.step({p: grads[p] for p in (first, second)},
                   skip=[p for p in numels if p not in (first, second)])
    _assert_same_state(ahead, plain, [first, second])
    ahead.close()
    plain.close()


@pytest.mark.parametrize("buffers", [1, 3])
def test_a_round_commits_as_a_whole_and_reads_see_the_committed_version(swap, pool, buffers):
    """update() one partition at a time, as the engine's early updates do: the same
    state as one step; until the round commits, every partition keeps its previous
    version (step, reads, prefetch), and a rollback returns exactly to it."""
    masters = _masters(40 + buffers, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(buffers)
    ref = make_opt(cfg, masters, "nvme", swap, pool)
    nvme = make_opt(cfg, masters, "nvme", swap, pool)
    pids = list(numels)
    for step in range(3):
        grads = grads_for(numels, step)
        before = {pid: ref.partition_state(pid) for pid in pids}
        ref.step(grads)
        for k, pid in enumerate(pids):
            nxt = pids[k + 1] if k + 1 < len(pids) else None
            nvme.update({pid: grads[pid]}, next_pid=nxt)
        assert nvme.round == pids and nvme._pipeline.pending() == pids
        for pid in pids:
            assert nvme.partition(pid).step == step   # not committed: the old version
            assert nvme.prefetch(pid) == 0            # would read the old extents
            got = nvme.partition_state(pid)
            for k in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[k], before[pid][k]), (pid, k)
        nvme.commit()
        assert nvme._pipeline.pending() == [] and nvme.round == []
        assert all(nvme.partition(p).step == step + 1 for p in pids)
        _assert_same_state(ref, nvme, pids)
    # a rollback: the previous version, whole, and the swap space as it was
    used = swap.used_bytes
    grads = grads_for(numels, 7)
    nvme.update({pids[0]: grads[pids[0]]})
    nvme.update({pids[1]: grads[pids[1]]})
    assert swap.used_bytes > used
    assert nvme.rollback() == pids[:2]
    assert swap.used_bytes == used
    _assert_same_state(ref, nvme, pids)
    ref.step(grads)
    nvme.step(grads)
    _assert_same_state(ref, nvme, pids)
    nvme.close()


def test_host_state_round_rolls_back_unless_final():
    """Host state: the round keeps a copy of each partition's previous state; final
    updates keep none and a rollback says so."""
    masters = _masters(45, count=2)
    numels = {pid: m.numel() for pid, m in masters.items()}
    ref = make_opt(_cfg(), masters)
    opt = make_opt(_cfg(), masters)
    grads = grads_for(numels, 0)
    before = {pid: ref.partition_state(pid) for pid in numels}
    before = {pid: {k: v.clone() for k, v in st.items()} for pid, st in before.items()}
    opt.update(grads)
    for pid in numels:  # reads see the committed version while the round is open
        got = opt.partition_state(pid)
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[k], before[pid][k]), (pid, k)
    opt.rollback()
    _assert_same_state(ref, opt, numels)
    first = next(iter(numels))
    opt.update({first: grads[first]}, final=True)
    with pytest.raises(RuntimeError, match="final=True"):
        opt.rollback()
    assert opt.partition(first).step == 1


def test_failed_write_in_a_later_update_undoes_the_whole_round(swap, pool):
    """A write fails in the round's second update: the error comes from the call
    that finds it (the update itself, or the commit); every partition, the first
    one too, is at its previous version, and the step run again gives the new one."""
    masters = _masters(50, count=3)
    numels = {pid: m.numel() for pid, m in masters.items()}
    cfg = _cfg(3)
    old = make_opt(cfg, masters)
    new = make_opt(cfg, masters)
    nvme = make_opt(cfg, masters, "nvme", swap, pool)
    grads = grads_for(numels, 0)
    new.step(grads)
    pids = list(numels)
    used = swap.used_bytes
    nvme.update({pids[0]: grads[pids[0]]})
    # from the second partition's last chunk on, every write fails
    restore = _fail_writes_after(nvme, swap, nvme.partition(pids[1]).layout.n_chunks)
    try:
        with pytest.raises(OptimStepError) as err:
            nvme.update({pids[1]: grads[pids[1]]})
            nvme.step({p: grads[p] for p in pids[2:]})
    finally:
        restore()
    e = err.value
    assert isinstance(e.__cause__, IoError)
    assert pids[0] in e.unchanged and pids[1] in e.unchanged and e.updated == []
    _assert_same_state(nvme, old, pids)
    assert swap.used_bytes == used  # no leak
    nvme.step(grads)  # the disk works again
    _assert_same_state(nvme, new, pids)
    nvme.close()


def test_lr_schedule_sees_the_committed_step(swap, pool):
    """Each round schedules and bias-corrects from the committed step; a rolled-back
    round does not count."""
    masters = {"p0": torch.randn(3 * CHUNK + 100, generator=torch.Generator().manual_seed(61))}
    numels = {pid: m.numel() for pid, m in masters.items()}
    seen = []
    nvme = make_opt(_cfg(3), masters, "nvme", swap, pool,
                    lr_lambda=lambda s: seen.append(s) or 1.0)
    ref = make_opt(_cfg(3), masters, lr_lambda=lambda s: 1.0)
    pid = next(iter(numels))
    g = grads_for(numels, 0)
    nvme.update({pid: g[pid]})
    with pytest.raises(ValueError, match="open round"):
        nvme.load_state_dict(nvme.state_dict())
    nvme.rollback()
    for step in range(2):
        g = grads_for(numels, step)
        ref.step(g)
        nvme.update({pid: g[pid]})
        nvme.commit()
    assert seen == [0, 0, 1]
    _assert_same_state(ref, nvme, numels)
    nvme.close()


def test_host_rounds_copy_into_the_last_rounds_buffers_and_still_roll_back():
    """[Note: the copies' buffers]: each round's rollback copy of the host state goes
    into the buffers of the round before (committed or rolled back), and a rollback
    after several rounds still gives the last committed state exactly."""
    masters = _masters(46, count=2)
    numels = {pid: m.numel() for pid, m in masters.items()}
    ref = make_opt(_cfg(), masters)
    opt = make_opt(_cfg(), masters)

    from offload.optim.codec import Moment

    def buffers() -> set[int]:
        return {t.data_ptr() for _, copies in opt._backups.values() for c in copies
                for t in ((c.data, c.scale) if isinstance(c, Moment) else (c,))
                if t is not None}
    seen = []
    for k in range(3):
        grads = grads_for(numels, k)
        ref.step(grads)
        opt.update(grads)
        seen.append(buffers())
        opt.commit()
    assert seen[1] == seen[0] == seen[2], "a round's copies took fresh memory"
    opt.update(grads_for(numels, 9))
    assert buffers() == seen[0]
    opt.rollback()
    _assert_same_state(ref, opt, numels)
    ref.step(grads_for(numels, 4))
    opt.step(grads_for(numels, 4))
    _assert_same_state(ref, opt, numels)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_round_uses_one_set_of_values_per_group(swap, pool, tier):
    """[Note: one set of values per round]: an lr written between two updates of one
    round is refused before the second changes anything, and one written after the
    round's updates fails its commit, which rolls the whole round back."""
    masters = _masters(71, 2)
    numels = {pid: m.numel() for pid, m in masters.items()}
    opt = make_opt(_cfg(3), masters, tier, swap, pool)
    ref = make_opt(_cfg(3), masters)
    p0, p1 = list(numels)[:2]
    g = grads_for(numels, 0)
    opt.update({p0: g[p0]})
    opt.param_groups[0]["lr"] = 3e-3
    with pytest.raises(ValueError, match=r"param_groups\[0\] changed within one step "
                                         r"\(lr 0.01 -> 0.003\)"):
        opt.update({p1: g[p1]})
    _assert_same_state(opt, ref, [p1])
    with pytest.raises(OptimStepError, match="changed within one step"):
        opt.commit()
    _assert_same_state(opt, ref, numels)  # the round was rolled back, p0 included
    assert opt.steps == 0
    opt.step(g)  # one set of values: steps as torch would at the new rate
    ref.param_groups[0]["lr"] = 3e-3
    ref.step(g)
    _assert_same_state(opt, ref, numels)
    opt.close()
    ref.close()


def test_torch_schedulers_take_the_optimizer():
    """[Note: what torch sees]"""
    masters = _masters(72, 1)
    opt = make_opt(_cfg(3), masters)
    ref = torch.optim.AdamW([torch.nn.Parameter(m.clone()) for m in masters.values()],
                            lr=1e-2, weight_decay=0.1)
    s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    s_ref = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.1, total_steps=4)
    numels = {pid: m.numel() for pid, m in masters.items()}
    for k in range(3):
        g = grads_for(numels, k)
        for p, gg in zip(ref.param_groups[0]["params"], g.values()):
            p.grad = gg.clone()
        ref.step()
        opt.step(g)
        s.step()
        s_ref.step()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
        assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
    for p, pid in zip(ref.param_groups[0]["params"], numels):
        torch.testing.assert_close(opt.partition_state(pid)["master"], p.detach(),
                                   atol=1e-6, rtol=0)
    opt.close()
