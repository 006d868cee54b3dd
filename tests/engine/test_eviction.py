"""Eviction by next use (store.policy "next-use", offload/engine/eviction.py): with the
host tier too small for a step's parameter copies and gradients, the copy the step
needs last leaves first, and the step moves fewer bytes to and from NVMe than least
recently used, with the same numbers."""

import torch

import offload
from offload.store import Candidate, NextUsePolicy, Tier

from .test_prefetch import Stack


def _run(tmp_path, policy: str, steps: int = 3):
    """(NVMe bytes read, written) per step, and the final weights."""
    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme", "group_size": 1},
           "io": {"paths": [str(tmp_path / policy)], "buffer_budget": "8MiB"},
           "store": {"host_budget": "3MiB", "device_budget": "512KiB", "device": "cpu",
                     "policy": policy}}
    torch.manual_seed(0)
    model = Stack(layers=8)
    data = [torch.randn(8, 256) for _ in range(steps)]
    moved = []
    with offload.initialize(model, cfg) as e:
        for x in data:
            before = e.store.stats().moves
            e.backward(e(x).square().mean())
            e.step()
            after = e.store.stats().moves
            d = {k: v.bytes - (before[k].bytes if k in before else 0) for k, v in after.items()}
            moved.append((sum(v for k, v in d.items() if k.startswith("NVME->")),
                          sum(v for k, v in d.items() if k.endswith("->NVME"))))
        weights = {k: v.clone() for k, v in e.state_dict().items()}
    return moved, weights


def test_next_use_moves_fewer_bytes_than_lru_with_the_same_numbers(tmp_path):
    lru, w_lru = _run(tmp_path, "lru")
    nxt, w_nxt = _run(tmp_path, "next-use")
    # steady state (steps 2 and 3): parameter copies the step is done with leave
    # before the gradients early updates still need and the masters they are about to
    # read, which LRU writes down and reads back: next-use reads nothing and writes
    # 1,320 KiB (the new versions memory cannot keep), LRU moves 1,584-2,376 KiB
    assert all(r == 0 for r, _ in nxt[1:]), (lru, nxt)
    assert max(r + w for r, w in nxt[1:]) < 0.9 * min(r + w for r, w in lru[1:]), (lru, nxt)
    assert w_lru.keys() == w_nxt.keys()
    for k in w_lru:
        assert torch.equal(w_lru[k], w_nxt[k]), k


def _cands(*spec):
    return [Candidate(key, "param", n, clean) for key, n, clean in spec]


def test_policy_takes_the_farthest_next_use_first_and_clean_among_equals():
    p = NextUsePolicy()
    for k in ("a", "b", "c", "d"):
        p.touched(k, Tier.HOST)
    far = {"a": 5, "b": 9, "c": 9, "d": None}
    cands = _cands(("a", 10, True), ("b", 10, False), ("c", 10, True))
    assert p.choose(Tier.HOST, 10, cands) == ["a"]  # no next use known yet: LRU
    p.follow(far.get)
    assert p.choose(Tier.HOST, 10, cands) == ["c"]  # farthest, clean before dirty
    assert p.choose(Tier.HOST, 25, cands) == ["c", "b", "a"]
    # a copy the trace does not use goes first
    assert p.choose(Tier.HOST, 1, cands + _cands(("d", 1, False))) == ["d"]
    p.follow(lambda key: None)  # the step left its trace: least recently used again
    assert p.choose(Tier.HOST, 10, cands) == ["a"]


def _reads_per_step(tmp_path, depth: int) -> int:
    """NVMe bytes read by the lightest of steps 2 to 8 (they follow the recorded plan;
    a step now and then reads one layer more where a prefetch comes late, on a loaded
    host more often, where the behaviour these tests pin is lost in every step):
    parameters and optimizer on NVMe, a device tier of two layers (1 MiB each),
    `depth` groups of look-ahead."""
    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme",
                      "prefetch_depth": depth, "group_size": 1},
           "io": {"paths": [str(tmp_path / f"d{depth}")], "buffer_budget": "8MiB"},
           "store": {"host_budget": "2560KiB", "device_budget": "2304KiB", "device": "cpu"}}
    torch.manual_seed(0)
    reads = []
    with offload.initialize(Stack(dim=512, layers=6), cfg) as e:
        for _ in range(8):
            before = e.store.stats().moves
            e.backward(e(torch.randn(8, 512)).square().mean())
            e.step()
            after = e.store.stats().moves
            reads.append(sum(v.bytes - (before[k].bytes if k in before else 0)
                             for k, v in after.items() if k.startswith("NVME->")))
    return min(reads[1:])


def test_a_deeper_look_ahead_never_evicts_what_is_needed_sooner(tmp_path):
    """[Note: prefetch room]: a prefetch that would evict a copy needed before its own
    group is not issued. A step of 6 layers uses them 12 times; with two layers of
    device room, a look-ahead of 3 then reads each use at most once (unchecked, it
    evicted what the next uses needed and read about 33 layers a step)."""
    layer = 512 * 513 * 4
    reads = _reads_per_step(tmp_path, 3)
    assert reads < 13 * layer, reads / layer


def test_an_update_in_place_reads_each_partition_once_a_step(tmp_path):
    """[Note: the update in the old copy's memory] in step.py: an fp32 update of a
    partition read from NVMe this step writes over that copy instead of holding a new
    one beside it: the step reads 5 of its 6 layers (the last one's copy stays for
    the next forward), where with the new version beside the old it reads all 6."""
    layer = 512 * 513 * 4
    reads = _reads_per_step(tmp_path, 1)
    assert reads < 5.5 * layer, reads / layer


def test_a_staged_partition_takes_over_its_groups_next_use():
    """[Note: the staged copy stays]: once a group's update staged its new partition,
    the new one is needed at the group's next use and the old one never (it goes
    first); a group whose pending update will read its parameters as the master is
    needed at that update, before any other use; a gradient at the step's end."""
    from offload.engine.eviction import PendingUpdates, next_use_of, sooner_than
    from offload.planner import AccessTrace

    trace = AccessTrace([0, 1, 2, 2, 1, 0])
    for gid in (0, 1, 2, 2):  # forward, then the backward of group 2
        trace.record(gid)
    pending = PendingUpdates()
    pending.add(1, reads_master=True)
    staged = {2}
    nu = next_use_of(trace, staged, pending)
    assert nu(("p", 2)) is None                  # replaced at the commit
    assert nu(("p", 2, "staged")) == 1 + 5       # the next step's forward of group 2
    assert nu(("p", 1)) == 0                     # its update reads it first
    assert nu(("p", 0)) == 1 + 2                 # its backward, after the update
    assert nu(("g", 0)) == 1 + 3 and nu("other") is None
    plain = next_use_of(trace)
    assert plain(("p", 2)) == 5 and plain(("p", 1)) == 1
    # a prefetch of group 0 must not evict the parameters a pending update reads
    assert sooner_than(trace, 0, staged, pending)(("p", 1))
    assert not sooner_than(trace, 0, staged, pending)(("p", 2))
    pending.read_master(1)
    assert nu(("p", 1)) == 1 + 1                 # read: its next use is its backward
    # group 0's backward runs: its early update, queued once its gradient is reduced,
    # reads its parameters right after the updates queued before it
    pending.expect(0)
    assert nu(("p", 0)) == 1 and nu(("g", 0)) == 1 + 3
    pending.add(0, reads_master=True)
    assert not pending.expected(0) and nu(("p", 0)) == 1
    pending.expect(2)
    pending.clear()
    assert not pending.expected(2)


def test_the_update_loop_keeps_its_inputs_ahead_of_the_next_forward():
    """[Note: the updates' order]: after the trace finished, `step()`'s updates run in
    order; each one's fp32 master is needed at its place in that order, before the
    next forward's uses, the nearest first, and its gradient is held until it ran."""
    from offload.engine.eviction import PendingUpdates, next_use_of
    from offload.planner import AccessTrace

    trace = AccessTrace([0, 1, 2, 2, 1, 0])
    for gid in (0, 1, 2, 2, 1, 0):
        trace.record(gid)
    trace.finish()  # step(): the trace's uses now count from the next step's first
    pending = PendingUpdates()
    for gid in (0, 1, 2):
        pending.add(gid, reads_master=True)
    nu = next_use_of(trace, (), pending)
    # a pending update's gradient is held for it, as the plan holds it (a reserve)
    assert [nu(("g", g)) for g in (0, 1, 2)] == [0, 0, 0]
    assert [nu(("p", g)) for g in (0, 1, 2)] == [0, 1, 2]
    pending.done(0)
    nu0 = nu(("p", 0, "staged"))
    assert nu(("p", 1)) == 0 and nu(("p", 2)) == 1
    assert nu0 is not None and nu0 > nu(("p", 2)), "the next forward comes after the updates"


def test_the_update_loop_keeps_the_inputs_of_the_next_updates(tmp_path):
    """[Note: the updates' order]: parameters streaming, host optimizer state, memory
    for the parameters and gradients but not the staged copies beside them. The
    updates' gradients and masters stay for their update and the replaced copies
    leave instead, and no in-place attempt that the budgets cannot hold moves
    anything first: 7.2 layers moved per step (9.25 with that attempt; 16.4 while the
    update loop ranked every gradient behind the next forward's parameters, and moved
    the next update's gradient to NVMe and straight back)."""
    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "host", "group_size": 1},
           "io": {"paths": [str(tmp_path)], "buffer_budget": "8MiB"},
           "store": {"host_budget": "3MiB", "device_budget": "1MiB", "device": "cpu"}}
    torch.manual_seed(0)
    layer = 256 * 257 * 4
    with offload.initialize(Stack(layers=8), cfg) as e:
        for _ in range(3):
            before = e.store.stats().moves
            e.backward(e(torch.randn(8, 256)).square().mean())
            e.step()
        after = e.store.stats().moves
    d = {k: v.bytes - (before[k].bytes if k in before else 0) for k, v in after.items()}
    moved = sum(v for k, v in d.items() if "NVME" in k)
    assert moved <= 7.5 * layer, {k: v / layer for k, v in d.items()}


def _store_reads(e) -> int:
    """Bytes the store has read from NVMe, into HOST or (on a CPU device) DEVICE."""
    moves = e.store.stats().moves
    return moves["NVME->HOST"].bytes + moves["NVME->DEVICE"].bytes


def _param_reads(tmp_path, host_layers: int, device_layers: int) -> float:
    """Parameter partitions read from NVMe in steps 2-4, in layers: 8 layers streaming,
    optimizer state on NVMe (early updates: each group's update runs beside the
    backward of the next), a CPU device; budgets in layers."""
    footprint = 264 * 1024  # one layer's partition, aligned
    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme", "group_size": 1},
           "io": {"paths": [str(tmp_path)], "buffer_budget": "8MiB"},
           "store": {"host_budget": host_layers * footprint,
                     "device_budget": device_layers * footprint, "device": "cpu"}}
    torch.manual_seed(0)
    with offload.initialize(Stack(layers=8), cfg) as e:
        for step in range(4):
            if step == 1:
                before = _store_reads(e)
            e.backward(e(torch.randn(8, 256)).square().mean())
            e.step()
        read = _store_reads(e) - before
    return read / (256 * 257 * 4)


def test_a_running_backward_keeps_the_master_its_update_reads_next(tmp_path):
    """[Note: the updates' order]: while a group's backward runs, its early update is
    about to read its parameters as the master. Counted as needed only by the next
    step, they were evicted by the prefetch for the next backward and read straight
    back: 14.4-15.4 layers a step with two layers of each tier, 10.3-11.3 kept."""
    reads = _param_reads(tmp_path, 2, 2)
    assert reads <= 3 * 12.5, reads / 3


def test_the_new_partition_takes_the_old_ones_room(tmp_path):
    """[Note: the new copy and the old one's room]: the updates' new partitions
    (staged in HOST) move up into the DEVICE room of the clean old copies no step
    reads again, rather than HOST writing them to NVMe while DEVICE holds those:
    9.25 layers read a step with two layers of HOST and four of DEVICE before,
    5.7-6.5 now, the plan's 6 for this trace."""
    reads = _param_reads(tmp_path, 2, 4)
    assert reads <= 3 * 8, reads / 3
