"""The simulated disk's rates and the exposed I/O (offload/planner/simulate.py)."""

import pytest

from offload.planner import Rates, RecordSpec, Use, make_plan, simulate
from offload.planner.plan import Plan, PlanOp


def _read_then_write():
    """A write-back and a fetch of 10 bytes each, queued together at use 0."""
    uses = [Use((), compute_s=0.0)]
    ops = [PlanOp("write-back", "w", 10, 0), PlanOp("fetch", "r", 10, 0, 0)]
    return Plan(ops, 100, [0], 10, 10, {0: [ops[1]]}), uses


def test_reads_and_writes_move_at_their_own_rates():
    """Reads at read_Bps, writes at write_Bps: 10 bytes read at 20 B/s take 0.5 s, 10
    written at 10 B/s take 1 s."""
    rates = Rates(read_Bps=20.0, write_Bps=10.0)
    uses = [Use(("a",), compute_s=0.0)]
    read = simulate(make_plan(uses, {"a": RecordSpec(10)}, 10), uses, rates)
    assert read.step_s == pytest.approx(0.5) and read.exposed_io_s == pytest.approx(0.5)
    ops = [PlanOp("write-back", "w", 10, 0)]
    write = simulate(Plan(ops, 100, [0], 0, 10, {}), [Use(())], rates)
    assert write.step_s == pytest.approx(1.0) and write.exposed_io_s == 0.0


def test_interleaved_traffic_moves_at_the_mixed_rate():
    """Both kinds queued: the first moves at mixed_Bps, and the second, following one of
    the other kind without a pause, too: 2 s + 2 s at 5 B/s (not 1 + 0.5 s)."""
    plan, uses = _read_then_write()
    pred = simulate(plan, uses, Rates(read_Bps=20.0, write_Bps=10.0, mixed_Bps=5.0))
    assert pred.step_s == pytest.approx(4.0)
    assert pred.exposed_io_s == pytest.approx(4.0)  # the fetch arrives last


def test_a_mixed_rate_not_measured_is_the_slower_of_the_two():
    plan, uses = _read_then_write()
    pred = simulate(plan, uses, Rates(read_Bps=20.0, write_Bps=10.0))
    assert pred.step_s == pytest.approx(2.0)  # 10 B + 10 B at 10 B/s


def test_waits_off_the_compute_lane_are_not_exposed_io_and_compute_adds_up():
    """An update on its own lane that waits a second for its read delays the step, but
    exposed I/O counts only the compute lane's waits; compute_s is the uses' sum."""
    records = {"a": RecordSpec(10)}
    uses = [Use((), compute_s=0.25), Use(("a",), ("a",), "update", compute_s=0.5,
                                        lane="update")]
    pred = simulate(make_plan(uses, records, 10), uses, Rates(10.0, 10.0))
    assert pred.exposed_io_s == 0.0
    assert pred.compute_s == pytest.approx(0.75)
    waits = [e for e in pred.events if e[0] == "optim:wait_read"]
    assert len(waits) == 1 and waits[0][4] == pytest.approx(1.0)
    assert pred.step_s == pytest.approx(1.5)
