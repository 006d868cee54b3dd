"""The prefetch plan's checks, tie-breaks and round trips (offload/planner/plan.py)."""

import pytest

from offload.planner import RecordSpec, Use, lru_bytes, make_plan


def test_a_use_that_writes_a_record_it_does_not_use_is_refused():
    records = {"a": RecordSpec(1), "b": RecordSpec(1)}
    uses = [Use(("a",), ("b",))]
    with pytest.raises(ValueError, match=r"use 0 writes \['b'\], which it does not use"):
        make_plan(uses, records, 2)
    with pytest.raises(ValueError, match="which it does not use"):
        lru_bytes(uses, records, 2)


def test_records_resident_at_the_start_beyond_the_budget_are_refused():
    """Resident records of 4 bytes under a budget of 3: refused before any plan, not a
    plan that holds more than the budget from its first use."""
    records = {"a": RecordSpec(2, resident=True), "b": RecordSpec(2, resident=True)}
    with pytest.raises(ValueError, match="resident at the start hold 4 bytes, more than "
                                         "the budget of 3"):
        make_plan([Use(("a",))], records, 3)
    with pytest.raises(ValueError, match="resident at the start"):
        lru_bytes([Use(("a",))], records, 3)
    make_plan([Use(("a",))], records, 4)  # exactly the budget fits


def test_of_two_clean_records_needed_equally_late_the_first_in_records_order_leaves():
    """[Note: the plan]: among equals, the first in `records`' order is the victim."""
    records = {"a": RecordSpec(1), "b": RecordSpec(1), "c": RecordSpec(1)}
    plan = make_plan([Use(("a", "b")), Use(("c",))], records, 2)
    assert [op.key for op in plan.ops if op.op == "evict"] == ["a"], plan.ops
    records = {"b": RecordSpec(1), "a": RecordSpec(1), "c": RecordSpec(1)}
    plan = make_plan([Use(("a", "b")), Use(("c",))], records, 2)
    assert [op.key for op in plan.ops if op.op == "evict"] == ["b"], plan.ops


def test_a_clean_record_that_fits_once_later_evictions_freed_room_stays():
    """r1 leaves at use 1 (r3 and a reserve of 3); r2's and r0's later evictions free
    room from their last uses on, so by use 3 r1 fits beside everything held from use
    1: _hoist keeps it instead of reading it back (18 bytes read, not 20)."""
    records = {"r0": RecordSpec(4), "r1": RecordSpec(2), "r2": RecordSpec(4),
               "r3": RecordSpec(4)}
    uses = [Use(("r1", "r2"), reserved=1), Use(("r3",), ("r3",), reserved=3),
            Use(("r0",), reserved=1), Use(("r1", "r2"), ("r1",), reserved=3)]
    plan = make_plan(uses, records, 9)
    assert plan.bytes_read == 18, plan.ops
    assert [op.needed_at for op in plan.ops if op.op == "fetch" and op.key == "r1"] == [0]
    assert max(plan.held) <= 9


def test_a_record_written_out_is_not_read_back_at_the_same_point():
    """A dirty record that leaves (write-back issued at use 3) is read back no earlier
    than the use after it left (docstring of _hoist): not at the point of its write.
    Use 5 updates r0 keeping its previous version, so r0 cannot stay dirty instead."""
    records = {"r0": RecordSpec(1), "r1": RecordSpec(4), "r2": RecordSpec(3),
               "r3": RecordSpec(2), "r4": RecordSpec(1)}
    uses = [Use(("r1", "r3"), ("r1", "r3")), Use(("r1",), ("r1",), reserved=1),
            Use(("r0", "r2"), ("r0", "r2")), Use(("r1", "r4"), ("r1", "r4"), reserved=2),
            Use(("r1", "r3"), ("r3",), reserved=3),
            Use(("r0", "r2"), ("r2", "r0"), previous=("r0",))]
    plan = make_plan(uses, records, 10)
    writes = [op for op in plan.ops if op.op == "write-back"]
    assert any(w.key == "r0" for w in writes), plan.ops
    for f in (op for op in plan.ops if op.op == "fetch"):
        for w in writes:
            if w.key == f.key and w.at <= f.needed_at and (w.follows or -1) < f.needed_at:
                assert f.at > w.at, (f, w)
