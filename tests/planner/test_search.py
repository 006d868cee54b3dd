"""The tuner's search: scored by the simulator, bounded by the budgets and the disk,
and its candidates' keys are configurations the library accepts."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import load_config
from offload.planner import Rates, RecordSpec, Use, make_plan
from offload.planner.estimate import PLACEMENTS, Placement, tier_bytes
from offload.planner.search import (Budgets, Candidate, Machine, Space, StepShape, calibrate,
                                    calibration_key, candidates, chunk_elems, ModelledStep,
                                    packed_budget, plan_step, score, search, shortfall,
                                    steady_records)

MiB = 1 << 20
N = 1 << 20  # elements per group
SHAPE = StepShape(group_size=N, dtype="fp32", shards=tuple((N, True) for _ in range(8)),
                  units=tuple(((g,), 0.01) for g in range(8)),
                  minimum={p.name: (8 * MiB, 12 * MiB) for p in PLACEMENTS})
DEFAULTS = Candidate(Placement("device", "host", "host"), N, 2, 6, 64 * MiB, 4 * MiB, 32, 0, 0)


def _machine(read=2e9, write=2e9, free=1 << 40):
    return Machine({(4 * MiB, 32): Rates(read, write, min(read, write))}, adam_eps=1e9,
                   unit_overhead_s=0.0, disk_free=free)


def _peak_fits(s, budgets):
    c = s.candidate
    assert c.device_budget <= budgets.device
    tb = tier_bytes(SHAPE.model, c.placement, buffer_budget=c.buffer_budget)
    host = c.host_budget + tb.optimizer.get("host", 0) + tb.buffers.get("host", 0)
    assert host <= budgets.host, (c, host)
    # what the written config allows: io.buffer_budget counts with or without NVMe (it
    # was the whole host budget again beside store.host_budget where nothing streamed)
    assert c.host_budget + tb.optimizer.get("host", 0) + c.buffer_budget <= budgets.host, c


def test_roomy_budgets_keep_everything_in_memory():
    budgets = Budgets(host=4096 * MiB, device=4096 * MiB)
    ranked = search([SHAPE], Space(), budgets, _machine(), DEFAULTS)
    best = ranked[0]
    assert "nvme" not in best.candidate.placement.name
    assert best.bytes_read == best.bytes_written == 0
    assert best.step_s == pytest.approx(3 * 8 * 0.01 + 8 * N / 1e9)
    for s in ranked:
        _peak_fits(s, budgets)


def test_tight_budgets_put_state_on_nvme_and_a_slower_disk_costs_time():
    state = 8 * N * 12  # fp32 training: parameter, gradient and two moments: 16 B each
    budgets = Budgets(host=state // 2, device=16 * MiB)
    fast = search([SHAPE], Space(), budgets, _machine(), DEFAULTS)
    slow = search([SHAPE], Space(), budgets, _machine(read=2e8, write=2e8), DEFAULTS)
    assert fast and all("nvme" in s.candidate.placement.name for s in fast)
    for s in fast:
        _peak_fits(s, budgets)
    assert fast[0].bytes_read >= 8 * N * 8 and fast[0].bytes_written >= 8 * N * 8
    assert slow[0].step_s > fast[0].step_s
    assert slow[0].limit == "disk"


def test_a_disk_too_small_rules_out_nvme_and_shortfall_says_how_much():
    budgets = Budgets(host=8 * MiB, device=16 * MiB)
    m = _machine(free=MiB)
    assert search([SHAPE], Space(), budgets, m, DEFAULTS) == []
    miss = shortfall(SHAPE, budgets, m, 4 * MiB)
    assert miss["nvme"] == tier_bytes(SHAPE.model, Placement("nvme", "nvme", "nvme"))\
        .total["nvme"] - MiB
    assert miss["host"] == 12 * MiB + 4 * MiB - 8 * MiB  # working set and I/O buffers
    assert "device" not in miss


def test_prefetch_depth_hides_parameter_reads():
    # 24 MiB left for 32 MiB of params, beside 64 MiB of host optimizer state counted twice
    # (parameters on NVMe: the step's copy of it, [Note: what each tier holds])
    budgets = Budgets(host=172 * MiB, device=16 * MiB)
    base = dict(placement=Placement("nvme", "host", "host"), group_size=N, buffers=6,
                buffer_budget=4 * MiB, block_size=4 * MiB, queue_depth=32, host_budget=0,
                device_budget=0)
    m = _machine(read=5e8)
    got = {d: score(SHAPE, Candidate(prefetch_depth=d, **base), budgets, m) for d in (0, 1, 4)}
    assert got[0].exposed_io_s > got[1].exposed_io_s >= got[4].exposed_io_s - 1e-12  # float


def test_every_candidate_is_a_configuration_the_library_accepts(tmp_path):
    budgets = Budgets(host=512 * MiB, device=64 * MiB)
    cands = list(candidates(SHAPE, Space(), budgets, _machine().disk, DEFAULTS))
    assert len(cands) == len(set(cands)) > 18
    for c in cands:
        keys = c.keys()
        keys["store"].update(host_budget=64 * MiB, device_budget=64 * MiB)
        keys["io"]["paths"] = [str(tmp_path)]
        load_config(keys)


def test_chunk_elems_matches_the_optimizer():
    from offload.config import OptimConfig
    from offload.optim import resolve_chunk_elems

    for budget in (4 * MiB, 64 * MiB, 1024 * MiB):
        for buffers in (2, 6):
            for sd in ("fp32", "bf16", "int8"):
                for master in (True, False):
                    assert chunk_elems(budget, buffers, state_dtype=sd, master=master) == \
                        resolve_chunk_elems(OptimConfig(buffers=buffers, state_dtype=sd),
                                            budget, masters=master)


def test_calibration_scales_by_class_and_reorders():
    budgets = Budgets(host=4096 * MiB, device=4096 * MiB)
    ranked = search([SHAPE], Space(), budgets, _machine(), DEFAULTS)
    first = ranked[0]
    other = next(s for s in ranked
                 if s.candidate.placement.optimizer != first.candidate.placement.optimizer)
    factors = {calibration_key(first.candidate): 10.0, calibration_key(other.candidate): 0.5}
    got = calibrate(ranked, factors)
    moved = next(s for s in got if s.candidate == first.candidate)
    assert moved.step_s == pytest.approx(10 * first.step_s) and moved.calibration == 10.0
    assert got[0].candidate.placement == other.candidate.placement  # measured faster: first
    # a class not measured takes its placement's ratio, else that of the measured classes
    # with the optimizer state in the same tier
    seen = set()
    for s in got:
        p = s.candidate.placement
        want = 10.0 if p.optimizer == first.candidate.placement.optimizer else 0.5
        assert s.calibration == want, (p.name, s.calibration)
        seen.add(p.optimizer)
    assert seen == {"host", "nvme"}
    assert calibrate(ranked, {}) == ranked


def test_calibration_without_the_tier_takes_the_median_of_all():
    budgets = Budgets(host=4096 * MiB, device=4096 * MiB)
    ranked = search([SHAPE], Space(), budgets, _machine(), DEFAULTS)
    host = [s for s in ranked if s.candidate.placement.optimizer == "host"]
    a, b, c = (next(s for s in host if s.candidate.placement.name == n)
               for n in ("device/device/host", "host/host/host", "nvme/host/host"))
    factors = {calibration_key(x.candidate): f for x, f in ((a, 1.0), (b, 3.0), (c, 2.0))}
    got = calibrate(ranked, factors)
    for s in got:
        if s.candidate.placement.optimizer == "nvme":
            assert s.calibration == 2.0


def test_compressed_moments_move_fewer_bytes_and_win_where_the_disk_limits():
    """The search counts the moments in the candidate's optim.state_dtype: with the
    optimizer state on NVMe, int8 moments move about half the bytes of fp32 ones (fp32
    training: 8 bytes of moments per element against about 2) and, on a slow disk,
    predict a shorter step; they are searched only when the space names them, and a
    candidate sets optim.state_dtype."""
    budgets = Budgets(host=256 * MiB, device=128 * MiB)
    base = Candidate(Placement("device", "host", "nvme"), N, 2, 6, 64 * MiB, 4 * MiB, 32, 0, 0)
    m = _machine(read=2e8, write=2e8)
    m = Machine(m.disk, adam_eps=1e9, disk_free=m.disk_free,
                adam_eps_by_state={"int8": 0.8e9, "bf16": 1e9})
    got = {sd: score(SHAPE, Candidate(**{**base.__dict__, "state_dtype": sd}), budgets, m)
           for sd in ("fp32", "bf16", "int8")}
    assert got["int8"].bytes_read < 0.3 * got["fp32"].bytes_read
    assert got["bf16"].bytes_read == pytest.approx(got["fp32"].bytes_read / 2, rel=0.05)
    assert got["int8"].step_s < got["bf16"].step_s < got["fp32"].step_s
    assert got["int8"].adam_s == pytest.approx(got["fp32"].adam_s / 0.8, rel=0.01)
    assert {c.state_dtype for c in candidates(SHAPE, Space(), budgets, m.disk, base)} == {"fp32"}
    both = list(candidates(SHAPE, Space(state_dtypes=("fp32", "int8")), budgets, m.disk, base))
    assert {c.state_dtype for c in both} == {"fp32", "int8"}
    assert {c.keys()["optim"]["state_dtype"] for c in both} == {"fp32", "int8"}


def test_tune_offers_compressed_moments_where_they_win():
    from offload.cli.tune import compressed_offers

    budgets = Budgets(host=256 * MiB, device=128 * MiB)
    slow = Machine(_machine(read=2e8, write=2e8).disk, adam_eps=1e9)
    best = search([SHAPE], Space(placements=(Placement("device", "host", "nvme"),)), budgets,
                  slow, DEFAULTS)[0]
    offers = compressed_offers(best, [SHAPE], budgets, slow, Space())
    assert [o["state_dtype"] for o in offers] == ["bf16", "int8"]
    assert all(o["predicted_step_s"] < best.step_s for o in offers)
    assert compressed_offers(best, [SHAPE], budgets, slow,
                             Space(state_dtypes=("fp32", "bf16", "int8"))) == []
    roomy = search([SHAPE], Space(), Budgets(4096 * MiB, 4096 * MiB), _machine(), DEFAULTS)[0]
    assert compressed_offers(roomy, [SHAPE], Budgets(4096 * MiB, 4096 * MiB), _machine(),
                             Space()) == []  # all in memory: nothing to win


def _fits_tiers(sizes, tiers):
    """Whether records of `sizes` fit two tiers, each record whole in one."""
    d, h = tiers
    total = sum(sizes)
    return any(sum(s for s, bit in zip(sizes, bits) if bit) <= d
               and total - sum(s for s, bit in zip(sizes, bits) if bit) <= h
               for bits in itertools.product((0, 1), repeat=len(sizes)))


@st.composite
def _two_tier_steps(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=6))
    records = {f"r{k}": RecordSpec(s) for k, s in enumerate(sizes)}
    keys = st.sampled_from(sorted(records))
    uses = [Use((k,), (k,) if draw(st.booleans()) else ())
            for k in draw(st.lists(keys, min_size=1, max_size=12))]
    tiers = tuple(draw(st.integers(max(sizes), 3 * max(sizes))) for _ in range(2))
    return ModelledStep(uses, records, [], 0.0, 0.0), tiers


def _resident_at(uses, resident, ops):
    """The records resident or in flight at each use when `ops` run from `resident`
    (which ends as the step leaves it)."""
    by_at = {}
    for op in ops:
        by_at.setdefault(op.at, []).append(op)
    for i, use in enumerate(uses):
        for op in by_at.get(i, ()):
            if op.op == "evict":
                resident.discard(op.key)
            elif op.op == "fetch":
                resident.add(op.key)
        assert set(use.keys) <= resident
        yield i, set(resident)


@settings(max_examples=300, deadline=None)
@given(_two_tier_steps())
def test_a_plan_over_two_tiers_fits_them_record_by_record(case):
    """What the plan keeps in memory at every use of a loop of steps fits the device and
    host tiers with each record whole in one of them, so the store never has to evict
    what the plan keeps ([Note: two tiers, one budget])."""
    step, tiers = case
    plan = plan_step(step, tiers, prefetch_depth=len(step.uses), buffers=2)
    records = steady_records(step, plan.budget)
    size = {k: r.nbytes for k, r in step.records.items()}
    resident = {k for k, r in records.items() if r.resident}
    assert _fits_tiers([size[k] for k in resident], tiers)
    first = make_plan(step.uses, records, plan.budget)  # the step before the steady one
    for ops in (first.ops, plan.ops):
        for i, held in _resident_at(step.uses, resident, ops):
            assert _fits_tiers([size[k] for k in held], tiers), (i, held, tiers)


def test_equal_records_fill_both_tiers():
    step = ModelledStep([Use(("a",))], {k: RecordSpec(40) for k in "abc"}, [], 0.0, 0.0)
    assert packed_budget(step, (60, 60)) == 80       # two of three 40-byte records
    assert packed_budget(step, (80, 40)) == 120      # all three
    step.records["d"] = RecordSpec(10)
    assert packed_budget(step, (80, 40)) == 80       # mixed sizes: the sum less the largest


def test_the_plan_executed_as_the_engine_does_prefetch_by_units_and_evict_on_demand():
    """plan_step issues a parameter fetch when the unit `prefetch_depth` units before
    its use starts (updates' chunks between are no units), and a dirty victim's
    write-back where the fetch that needs its room is issued, not right after the
    victim's last use: that is when the engine's store evicts."""
    from offload.planner.search import ModelledStep

    p = [("p", g) for g in range(3)]
    uses = [Use((p[0],), kind="forward"), Use((p[1],), (p[1],), kind="forward"),
            Use((p[0],), kind="forward"), Use((), kind="update", lane="update"),
            Use((), kind="update", lane="update"), Use((p[0],), kind="forward"),
            Use((p[2],), kind="forward")]
    step = ModelledStep(uses, {k: RecordSpec(1) for k in p}, [], 0.0, 0.0)
    eager = make_plan(uses, step.records, 2, steady=True)
    (wb,) = [op for op in eager.ops if op.op == "write-back"]
    assert (wb.key, wb.at, wb.needed_at) == (p[1], 2, 6)   # right after its last use
    plan = plan_step(step, (2,), prefetch_depth=1, buffers=2)
    ops = {(op.op, op.key): op for op in plan.ops}
    assert ops["fetch", p[2]].at == 5                      # one unit ahead, not at use 5
    assert ops["write-back", p[1]].at == ops["write-back", p[1]].needed_at == 5
    assert ops["evict", p[1]].at == 5 and plan.held[2:5] == [2, 2, 2]
    deeper = plan_step(step, (2,), prefetch_depth=2, buffers=2)
    assert {(op.op, op.key): op.at for op in deeper.ops}["fetch", p[2]] == 2


def test_a_prefetch_makes_its_room_when_the_look_ahead_reaches_it():
    """The plan issues fetches in order, so p0's (needed at use 6) waits for p4's,
    which has no room until use 5; the engine prefetches p0 when its look-ahead of
    two units reaches it, at use 4, evicting p2 (not used again this step) then."""
    from offload.planner.search import ModelledStep

    seq = [4, 2, 5, 2, 3, 4, 0]
    uses = [Use((("p", g),), kind="forward") for g in seq]
    records = {("p", g): RecordSpec(1) for g in seq}
    eager = make_plan(uses, records, 2, steady=True)
    assert {(op.op, op.key): op.at for op in eager.ops}["fetch", ("p", 0)] == 5
    plan = plan_step(ModelledStep(uses, records, [], 0.0, 0.0), (2,), prefetch_depth=2,
                     buffers=2)
    at = {(op.op, op.key): op.at for op in plan.ops}
    assert at["fetch", ("p", 0)] == at["evict", ("p", 2)] == 4
    assert at["fetch", ("p", 4)] == 5 and max(plan.held) <= 2


def test_the_plan_as_the_engine_executes_it_keeps_the_budget():
    """Moving a prefetch earlier or an eviction later (to where the engine makes them)
    never holds more than the budget, nor evicts a record after its fetch back."""
    from offload.planner.search import ModelledStep

    p = [("p", g) for g in range(6)]
    cases = [  # (uses, records, tiers)
        ([Use((p[3], p[5]), kind="backward", reserved=2), Use((), kind="update", reserved=2),
          Use((p[1], p[4]), kind="backward", reserved=1)],
         {p[g]: RecordSpec(1) for g in (1, 3, 4, 5)}, (4,)),
        ([Use((p[5],), kind="forward"), Use((), kind="backward"), Use((p[4],), kind="update"),
          Use((p[0], p[2], ("g", 0), ("g", 2)), kind="backward")],
         {**{k: RecordSpec(1) for k in (p[0], p[2], p[4], ("g", 0), ("g", 2))},
          p[5]: RecordSpec(3)}, (6,)),
        ([Use((), kind="backward"), Use((p[4],), (p[4],), "update", previous=(p[4],)),
          Use((p[5],), (p[5],), "update", fresh=(p[5],)), Use((p[3],), kind="backward")],
         {p[3]: RecordSpec(1), p[4]: RecordSpec(3), p[5]: RecordSpec(3)}, (8,)),
    ]
    for uses, records, tiers in cases:
        plan = plan_step(ModelledStep(uses, records, [], 0.0, 0.0), tiers, 2, 2)
        assert max(plan.held) <= plan.budget, (plan.held, plan.budget)
        for op in plan.ops:  # no record leaves between its fetch and the use of it
            if op.op == "evict":
                assert not [f for f in plan.ops if f.op == "fetch" and f.key == op.key
                            and f.at < op.at <= f.needed_at], (op, plan.ops)


def test_fp32_parameters_on_a_gpu_keep_a_master_in_the_plan_and_the_estimate():
    """One rule for where the optimizer keeps an fp32 master (`keeps_master`, which the
    engine's master_is_param follows): in fp32 training the parameter is the master,
    except for parameters in a GPU's device tier, which the CPU optimizer cannot
    update in place. The estimate counts that master's bytes, and the search streams
    and sizes NVMe chunks with it (12 bytes per element of state, not 8)."""
    from offload.planner.sizes import keeps_master

    assert not keeps_master("fp32", "device", "cpu")
    assert not keeps_master("fp32", "nvme", "cuda") and not keeps_master("fp32", "host", "cuda")
    assert keeps_master("fp32", "device", "cuda")
    assert all(keeps_master(d, p, dev) for d in ("bf16", "fp16")
               for p in ("device", "host", "nvme") for dev in ("cpu", "cuda"))
    p = Placement("device", "host", "nvme")
    elems = sum(n for n, _ in SHAPE.shards)
    cpu, gpu = (tier_bytes(SHAPE.model, p, device=d).optimizer["nvme"] for d in ("cpu", "cuda"))
    assert (cpu, gpu) == (8 * elems, 12 * elems)
    budgets = Budgets(host=256 * MiB, device=128 * MiB)
    c = Candidate(p, N, 2, 6, 64 * MiB, 4 * MiB, 32, 0, 0)
    on_cpu = score(SHAPE, c, budgets, _machine())
    on_gpu = score(SHAPE, c, budgets, Machine(_machine().disk, adam_eps=1e9, copy_Bps=1e10))
    assert on_gpu.bytes_read == pytest.approx(1.5 * on_cpu.bytes_read, rel=0.01)


def test_no_candidate_needs_more_disk_than_is_free_nor_half_the_host_for_buffers():
    """With memory that fits NVMe placements, those whose swap files would not fit the
    disk's free space are left out, and no NVMe candidate's I/O buffers take more than
    half the host budget (what `shortfall` assumes)."""
    free = _machine(free=8 * MiB)
    for budgets, machine in ((Budgets(host=108 * MiB, device=16 * MiB), free),
                             (Budgets(host=300 * MiB, device=16 * MiB), _machine())):
        got = search([SHAPE], Space(), budgets, machine, DEFAULTS)
        assert got and all(s.peak["nvme"] <= machine.disk_free for s in got)
        assert all(s.candidate.buffer_budget <= budgets.host // 2 for s in got
                   if "nvme" in s.candidate.placement.name)


def test_calibration_keeps_each_classes_own_measured_ratio():
    """Two group sizes of one placement, each measured: each keeps its own ratio (the
    placement's median is for classes nobody measured)."""
    import dataclasses
    shapes = [SHAPE, dataclasses.replace(SHAPE, group_size=SHAPE.group_size * 2)]
    ranked = search(shapes, Space(), Budgets(4096 * MiB, 4096 * MiB), _machine(), DEFAULTS)
    name = ranked[0].candidate.placement.name
    keys = sorted({calibration_key(s.candidate) for s in ranked
                   if s.candidate.placement.name == name})
    factors = {keys[0]: 1.0, keys[1]: 5.0}
    got = calibrate(ranked, factors)
    for k, f in factors.items():
        assert {s.calibration for s in got if calibration_key(s.candidate) == k} == {f}
