"""The tuner's modelled step, its plan and its ranking (offload/planner/search.py)."""

import pytest

from offload.planner import Rates, Use, make_plan
from offload.planner.estimate import Placement, _footprint
from offload.planner.search import (Budgets, Candidate, Machine, ModelledStep, Scored, Space,
                                    StepShape, UnitUse, commit_stages, modelled_step,
                                    plan_step, ranked, score, search, shortfall,
                                    steady_records)
from offload.planner.plan import RecordSpec

MiB = 1 << 20
N = 1 << 20
SHAPE = StepShape(group_size=N, dtype="fp32", shards=tuple((N, True) for _ in range(8)),
                  units=tuple(((g,), 0.01) for g in range(8)),
                  minimum={n: (8 * MiB, 12 * MiB) for n in
                           [f"{a}/{b}/{c}" for a in ("device", "host", "nvme")
                            for b in ("device", "host", "nvme") for c in ("host", "nvme")]})
DEFAULTS = Candidate(Placement("device", "host", "host"), N, 2, 6, 64 * MiB, 4 * MiB, 32, 0, 0)


def _machine(**kw):
    return Machine({(4 * MiB, 32): Rates(2e9, 2e9, 2e9)}, adam_eps=1e9, **kw)


def _units(groups):
    return [UnitUse("forward", (g,), 0.0) for g in groups] + \
        [UnitUse("backward", (g,), 0.0) for g in reversed(groups)]


def test_the_state_pipeline_reads_buffers_minus_one_chunks_ahead():
    """optim.buffers=2: one buffer is updated while the next chunk is read, so chunk n's
    read is issued at chunk n-1's update, not earlier."""
    step = modelled_step(_units([0]), ((4096, True),), "fp32", Placement("host", "host", "nvme"),
                         1024, 1e9, master=False)
    chunks = [i for i, _, _ in step.streams]
    assert len(chunks) == 4
    plan = plan_step(step, (1 << 30,), 1, buffers=2)
    reads = sorted(op.at for op in plan.ops if op.op == "fetch" and op.key[0] == "s")
    assert reads == [chunks[0]] + chunks[:-1]
    plan = plan_step(step, (1 << 30,), 1, buffers=3)
    reads = sorted(op.at for op in plan.ops if op.op == "fetch" and op.key[0] == "s")
    assert reads == [chunks[0], chunks[0]] + chunks[:-2]


def test_records_that_exactly_fill_the_budget_stay_resident_across_steps():
    step = ModelledStep([Use(("a",))], {"a": RecordSpec(40), "b": RecordSpec(60)}, [], 0, 0)
    assert all(r.resident for r in steady_records(step, 100).values())
    assert not any(r.resident for r in steady_records(step, 99).values())


def test_among_equal_predictions_fewer_bytes_moved_ranks_first():
    def s(moved):
        return Scored(DEFAULTS, 1.0, 1.0, 0.0, 0.0, {"nvme": 0}, moved, moved, "compute")
    assert [x.bytes_read for x in ranked([s(9), s(1), s(5)])] == [1, 5, 9]


def test_the_shortfall_keeps_the_io_buffers_to_half_the_host():
    """NVMe candidates' buffers take at most half the host budget: with buffers larger
    than the working set, the host needed is twice the buffers."""
    miss = shortfall(SHAPE, Budgets(host=8 * MiB, device=16 * MiB), _machine(), 64 * MiB)
    assert miss["host"] == 2 * 64 * MiB - 8 * MiB


def test_no_candidate_stages_less_than_one_block():
    """io.buffer_budget holds at least one block: a 1 MiB budget is no candidate at a
    4 MiB block size."""
    space = Space(buffer_budgets=(1 * MiB, 16 * MiB))
    got = search([SHAPE], space, Budgets(host=4096 * MiB, device=4096 * MiB), _machine(),
                 DEFAULTS)
    nvme = [s for s in got if "nvme" in s.candidate.placement.name]
    assert nvme and all(s.candidate.buffer_budget >= s.candidate.block_size for s in nvme)


def test_a_bf16_update_writes_its_nvme_parameters_without_reading_them():
    """With a master apart, the update writes the compute-dtype partition whole: where
    it left memory it is not read back for the update (three 4 KiB reads, not four)."""
    step = modelled_step(_units([0, 1]), ((1024, True), (1024, True)), "bf16",
                         Placement("nvme", "host", "host"), 0, 1e9, master=True)
    plan = make_plan(step.uses, step.records, 4096)
    assert plan.bytes_read == 3 * 4096, plan.ops
    assert not [op for op in plan.ops if op.op == "fetch"
                and step.uses[op.needed_at].kind == "update"]


def test_an_update_frees_its_gradients_reserve():
    """Gradients stored in memory take the budget from their backward to their update
    (offload bench plan): after group 0's update only group 1's stays reserved."""
    step = modelled_step(_units([0, 1]), ((1024, True), (2048, True)), "fp32",
                         Placement("host", "host", "host"), 0, 1e9, master=False,
                         grads_reserved=True)
    updates = [u for u in step.uses if u.kind == "update"]
    assert [u.reserved for u in updates] == [4096 + 8192, 8192]


def test_a_host_optimizer_update_pays_no_chunk_overhead():
    """chunk_overhead_s is per chunk streamed from NVMe; a host update streams none."""
    step = modelled_step(_units([0]), ((1000, True),), "fp32", Placement("host", "host", "host"),
                         0, 1e6, master=False, chunk_overhead_s=1.0)
    assert step.adam_s == pytest.approx(1000 / 1e6)


def test_updates_in_place_where_everything_they_touch_fits_exactly():
    need = _footprint(1024 * 4) * 2
    p = Placement("host", "host", "host")
    assert not commit_stages(p, "fp32", ((1024, True),), need)
    assert commit_stages(p, "fp32", ((1024, True),), need - 1)


def test_on_a_gpu_host_parameters_are_copied_up_at_every_unit_use():
    """Parameters homed on the host are copied to the device at the copy rate for each
    forward and backward: 16 uses of 4 MiB at 1 GB/s."""
    c = Candidate(Placement("host", "host", "host"), N, 2, 6, 64 * MiB, 4 * MiB, 32, 0, 0)
    budgets = Budgets(host=4096 * MiB, device=4096 * MiB)
    cpu = score(SHAPE, c, budgets, _machine())
    gpu = score(SHAPE, c, budgets, _machine(copy_Bps=1e9))
    assert gpu.compute_s - cpu.compute_s == pytest.approx(16 * 4 * MiB / 1e9)


def test_accumulation_stores_the_gradients_as_clipping_does():
    """Under NVMe optimizer state, two micro-batches a step store the gradients until
    step() as clipping does: the budgets must hold them beside the parameters (a
    budget that holds a plain step's is refused for both), and the step models both
    micro-batches' compute."""
    import dataclasses

    from offload.planner.search import _memory

    c = dataclasses.replace(DEFAULTS, placement=Placement("device", "device", "nvme"))
    budgets = Budgets(host=1 << 30, device=2 * 8 * 4 * N + 4 * MiB)  # 2P: staged updates
    plain = _memory(SHAPE, c, budgets, "cpu")
    assert plain is not None
    for shape in (dataclasses.replace(SHAPE, clipping=True),
                  dataclasses.replace(SHAPE, accum=2)):
        assert _memory(shape, c, budgets, "cpu") is None
    m = _machine()
    one = score(SHAPE, DEFAULTS, Budgets(1 << 34, 1 << 34), m)
    two = score(dataclasses.replace(SHAPE, accum=2), DEFAULTS, Budgets(1 << 34, 1 << 34), m)
    assert two.compute_s == pytest.approx(2 * one.compute_s)


def test_a_predicted_wait_for_a_gradient_read_back_is_in_the_trace():
    """Gradients homed on NVMe are read back for their update, fetches the plan adds
    beyond the use's own records: the compute's wait for one is a `wait:gather` span of
    the predicted trace, so the trace's exposed I/O is the prediction's (it was 0)."""
    from offload.planner import simulate
    from offload.planner.search import UnitUse, modelled_step, plan_step
    from offload.trace.analysis import exposed_time, parse_trace, steps_of

    units = [UnitUse("forward", (0,), 0.01, "f0"), UnitUse("backward", (0,), 0.02, "b0")]
    step = modelled_step(units, [(4096, True)], "fp32", Placement("nvme", "nvme", "host"),
                         0, 1e9, staged=True, master=False,
                         between=[Use((), (), "loss", "loss", 0.001)], commit_s=0.001)
    plan = plan_step(step, (1 << 20, 1 << 20), 2, 4)
    assert any(op.key not in step.uses[i].keys
               for i, ops in plan.fetches_by_use.items() for op in ops)
    pred = simulate(plan, step.uses, Rates(1e6, 1e6))  # a slow disk: the read is exposed
    (rank,) = parse_trace(pred.to_trace(budget=plan.budget))
    assert pred.exposed_io_s > 0.01
    assert exposed_time(rank, steps_of(rank)[0])["io"] == pytest.approx(
        pred.exposed_io_s * 1e6, rel=1e-6)
