"""The tuner's arithmetic at its edges: bad inputs say what is wrong (no KeyError or
ZeroDivisionError), and candidates that move nothing need no disk rates."""

import pytest

from offload.planner import Rates
from offload.planner.estimate import ModelBytes, Placement, kind_bytes
from offload.planner.search import Budgets, Candidate, Machine, Space, score, search
from offload.planner.sizes import auto_chunk_elems

from .test_search import SHAPE

MiB = 1 << 20


def test_an_unknown_dtype_is_a_value_error_that_lists_the_known_ones():
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of"):
        kind_bytes(ModelBytes(((10, True),), "fp8"))


@pytest.mark.parametrize("buffers", [0, -1])
def test_chunk_elems_without_buffers_is_a_value_error(buffers):
    with pytest.raises(ValueError, match="buffers"):
        auto_chunk_elems(64 * MiB, buffers)


def test_placements_in_memory_are_scored_without_the_disk_rates_of_the_default_io_keys():
    """A candidate that keeps everything in memory moves no bytes to or from NVMe, so
    the defaults' (block size, queue depth) need not be among those probed; one that
    uses NVMe at a key not probed is a ValueError naming it, not a KeyError."""
    machine = Machine({(1 * MiB, 8): Rates(2e9, 2e9)}, adam_eps=1e9)
    defaults = Candidate(Placement("device", "host", "host"), SHAPE.group_size, 2, 6,
                         64 * MiB, 4 * MiB, 32, 0, 0)
    roomy = Budgets(host=4096 * MiB, device=4096 * MiB)
    memory = Space(placements=(Placement("device", "host", "host"),
                               Placement("host", "host", "host")))
    got = search([SHAPE], memory, roomy, machine, defaults)
    assert len(got) == 2 and all(s.bytes_read == s.bytes_written == 0 for s in got)
    nvme = Candidate(Placement("nvme", "host", "host"), SHAPE.group_size, 2, 6, 64 * MiB,
                     4 * MiB, 32, 0, 0)
    with pytest.raises(ValueError, match=r"block size 4194304, queue depth 32.*\(1048576, 8\)"):
        score(SHAPE, nvme, roomy, machine)


@pytest.mark.parametrize("kw, match", [
    (dict(adam_eps=0.0), "adam_eps"), (dict(adam_eps=float("nan")), "adam_eps"),
    (dict(adam_eps=1e9, copy_Bps=-1.0), "copy_Bps"),
    (dict(adam_eps=1e9, unit_overhead_s=float("nan")), "unit_overhead_s"),
    (dict(adam_eps=1e9, chunk_overhead_s=-1.0), "chunk_overhead_s"),
    (dict(adam_eps=1e9, adam_eps_by_state={"int8": 0.0}), "int8"),
])
def test_a_machine_whose_rates_are_no_rates_is_refused(kw, match):
    """Measured rates of zero or NaN would divide by zero or predict NaN steps deep in
    the search; the machine is refused where it is built, naming the rate."""
    with pytest.raises(ValueError, match=match):
        Machine({(4 * MiB, 32): Rates(2e9, 2e9)}, **kw)


def test_a_modelled_staged_step_moves_no_more_than_lru():
    """An fp32 step with parameters and optimizer state on NVMe and a staged commit:
    farthest-next-use kept two updated parameter partitions dirty in memory to the
    step's end, so each next update kept a dirty previous version and wrote one back
    for room, 45056 bytes a steady step where LRU, which writes them back and reads
    them again, moves 32768 (`plan_step` 190592 where `lru_step_bytes` is 178304;
    [Note: the plan against LRU's victims] in offload/planner/plan.py)."""
    from offload.planner import Use, lru_bytes, make_plan
    from offload.planner.search import (UnitUse, lru_step_bytes, modelled_step,
                                        packed_budget, plan_step, steady_records)

    shards = [(1024, True), (2048, True), (1024, True), (5000, True)]
    units = [UnitUse("forward", (g,), 0.01) for g in (2, 3, 0, 1)] + \
            [UnitUse("backward", (g,), 0.02) for g in (1, 0, 3, 2)]
    step = modelled_step(units, shards, "fp32", Placement("nvme", "host", "nvme"), 1024, 1e8,
                         update_lane="update", between=[Use((), (), "loss", "loss", 0.001)],
                         commit_s=0.001, grads_reserved=True, staged=True, master=False)
    tiers = (28286, 39191)
    budget = packed_budget(step, tiers)
    records = steady_records(step, budget)
    plan = make_plan(step.uses, records, budget, steady=True)
    assert plan.bytes_moved == sum(lru_bytes(step.uses, records, budget, steady=True)) == 32768
    assert max(plan.held) <= budget
    planned = plan_step(step, tiers, 4, 2)
    assert planned.bytes_moved == sum(lru_step_bytes(step, tiers)) == 178304
