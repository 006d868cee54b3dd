"""The prefetch plan against brute force and LRU, its budgets at every point, and the
simulator's prediction of a step."""

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.planner import (PlanOp, Rates, RecordSpec, Use, lru_bytes, make_plan,
                             previous_key, simulate)
from offload.trace import write_trace_dict
from offload.trace.analysis import (bytes_moved, exposed_time, parse_trace, prefetch_outcomes,
                                    steps_of)


def _replay(uses, records, plan):
    """Checks the plan by executing it: every use finds its records resident, the
    bytes held never exceed the budget, a dirty record is written before it is
    dropped; returns (read, written)."""
    size = {k: r.nbytes for k, r in records.items()}
    resident = {k for k, r in records.items() if r.resident}
    dirty = {k for k, r in records.items() if r.resident and r.dirty}
    by_at = {}
    for op in plan.ops:
        by_at.setdefault(op.at, []).append(op)
    read = written = 0
    in_flight = set()
    for i, use in enumerate(uses):
        for op in by_at.get(i, ()):
            if op.op == "write-back":
                assert op.key in dirty, op
                dirty.discard(op.key)
                written += op.nbytes
            elif op.op == "evict":
                assert op.key in resident and op.key not in dirty, op
                assert op.key not in use.keys, op
                resident.discard(op.key)
            else:
                assert op.key not in resident and op.needed_at >= i, op
                in_flight.add(op.key)
                resident.add(op.key)
                read += op.nbytes
        for k in use.previous:  # the version before this use stays beside the new one
            if k not in resident and k in use.fresh:
                continue  # written whole; the old version is on NVMe only
            if k not in use.fresh and k not in dirty:
                continue  # clean: updated in place, the old version is on NVMe
            size[previous_key(k)] = size[k]
            resident.add(previous_key(k))
            if k in dirty:
                dirty.add(previous_key(k))
        resident.update(use.fresh)
        held = sum(size[k] for k in resident) + use.reserved
        assert held <= plan.budget, (i, held, plan.budget)
        assert held == plan.held[i], (i, held, plan.held[i])
        assert set(use.keys) <= resident, (i, set(use.keys) - resident)
        dirty.update(use.writes)
        for pk in use.drops:
            resident.discard(pk)
            dirty.discard(pk)
    return read, written


def _optimum(uses, records, budget):
    """Fewest bytes (read + written) any eviction choice achieves over one pass of the
    trace with on-demand fetches (exhaustive search; tiny traces only)."""
    size = {k: r.nbytes for k, r in records.items()}

    @functools.lru_cache(maxsize=None)
    def best(i, resident, dirty):
        if i == len(uses):
            return 0
        use = uses[i]
        if sum(size[r] for r in resident) > budget - use.reserved:  # the reserve grew
            return min(size[v] * (v in dirty) + best(i, resident - {v}, dirty - {v})
                       for v in resident - set(use.keys))
        missing = [k for k in dict.fromkeys(use.keys) if k not in resident]
        return fill(i, resident, dirty, tuple(missing))

    @functools.lru_cache(maxsize=None)
    def fill(i, resident, dirty, missing):
        if not missing:
            return best(i + 1, resident, dirty | frozenset(uses[i].writes))
        k = missing[0]
        if sum(size[r] for r in resident) + size[k] <= budget - uses[i].reserved:
            return size[k] + fill(i, resident | {k}, dirty, missing[1:])
        out = float("inf")
        for v in resident - set(uses[i].keys):
            cost = size[v] if v in dirty else 0
            out = min(out, cost + fill(i, resident - {v}, dirty - {v}, missing))
        return out
    start = frozenset(k for k, r in records.items() if r.resident)
    return best(0, start, frozenset(k for k in start if records[k].dirty))


@st.composite
def traces(draw, writes=True, equal=False, max_records=5, max_uses=9, reserve=False):
    n = draw(st.integers(2, max_records))
    sizes = [1] * n if equal else draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    records = {f"r{k}": RecordSpec(sizes[k]) for k in range(n)}
    uses = []
    for _ in range(draw(st.integers(1, max_uses))):
        keys = tuple(sorted(set(draw(st.lists(st.sampled_from(sorted(records)), min_size=1,
                                              max_size=2)))))
        w = tuple(k for k in keys if writes and draw(st.booleans()))
        uses.append(Use(keys, w, reserved=draw(st.integers(0, 3)) if reserve else 0))
    need = max(sum(records[k].nbytes for k in u.keys) + u.reserved for u in uses)
    budget = draw(st.integers(need, max(need, sum(sizes))))
    return uses, records, budget


@st.composite
def committed_traces(draw):
    """`traces` whose updates keep their records' previous versions, a commit at the
    end dropping them ([Note: previous versions])."""
    uses, records, _ = draw(traces())
    kept, out = [], []
    for u in uses:
        prev = tuple(k for k in u.writes if k not in kept and draw(st.booleans()))
        kept.extend(prev)
        fresh = tuple(k for k in u.writes if draw(st.booleans()))
        out.append(Use(u.keys, u.writes, previous=prev, fresh=fresh))
    out.append(Use((), (), "commit", drops=tuple(previous_key(k) for k in kept)))
    need = max(sum(records[k].nbytes for k in (*u.keys, *u.previous)) for u in out)
    total = sum(r.nbytes for r in records.values())
    budget = draw(st.integers(need, max(need, 2 * total)))
    return out, records, budget


@settings(max_examples=300, deadline=None)
@given(committed_traces())
def test_previous_versions_hold_their_bytes_until_the_commit(case):
    """Executed, a plan whose updates keep previous versions holds at most the budget
    at every point with those versions counted, writes a previous version only where
    its record was dirty, and never reads one back."""
    uses, records, budget = case
    plan = make_plan(uses, records, budget)
    assert _replay(uses, records, plan) == (plan.bytes_read, plan.bytes_written)
    assert not [op for op in plan.ops if op.op == "fetch" and op.key[-1:] == ("previous",)]
    clean = {k for k, r in records.items() if not r.dirty}
    for op in plan.ops:  # a record never written before its update leaves no dirty copy
        if op.op == "write-back" and op.key[-1:] == ("previous",):
            assert op.key[0] not in clean or any(
                op.key[0] in u.writes for u in uses[:op.at]), op


def test_the_steady_step_writes_the_previous_versions_memory_cannot_keep():
    """Three layers, memory for three records, each update keeping the layer's
    previous version until the commit. From a cold start the layers read are clean and
    a previous version that must leave is dropped; in the steady state every layer
    was rewritten by the step before and is dirty, so the one that leaves is written
    (the plan of a loop, `steady=True`, counts what the engine's steps move)."""
    records = {k: RecordSpec(1) for k in "abc"}
    uses = [Use(("a",)), Use(("b",)), Use(("c",))]
    uses += [Use((k,), (k,), "update", previous=(k,)) for k in "abc"]
    uses.append(Use((), (), "commit", drops=tuple(previous_key(k) for k in "abc")))
    cold = make_plan(uses, records, 3)
    steady = make_plan(uses, records, 3, steady=True)
    assert not [op for op in cold.ops if op.op == "write-back" and op.key[-1:] == ("previous",)]
    written = [op.key for op in steady.ops if op.op == "write-back"]
    assert steady.bytes_written >= 2 and previous_key("a") in written, steady.ops
    assert max(steady.held) <= 3
    flat = [Use(u.keys, u.writes, u.kind) for u in uses]  # updated in place
    assert make_plan(flat, records, 3, steady=True).bytes_moved == 0
    assert lru_bytes(uses, records, 3, steady=True)[1] >= steady.bytes_written


@settings(max_examples=300, deadline=None)
@given(traces(), st.booleans())
def test_budget_holds_at_every_point_and_every_use_finds_its_records(case, steady):
    """Also: fetches are issued in the order the plan lists them, none before the one
    ahead of it ([Note: the plan]: the disk serves them in that order)."""
    uses, records, budget = case
    plan = make_plan(uses, records, budget, steady=steady)
    if not steady:  # `_replay` starts from the records' own residency, not the step's end
        assert _replay(uses, records, plan) == (plan.bytes_read, plan.bytes_written)
    assert max(plan.held) <= budget
    issued = [op.at for op in plan.ops if op.op == "fetch"]
    assert issued == sorted(issued), [(op.key, op.at) for op in plan.ops if op.op == "fetch"]


def test_of_two_records_needed_equally_late_the_clean_one_leaves():
    """Farthest next use ties (a and b are next used together, never again): the clean
    b is dropped for free, where the dirty a would be written back first."""
    records = {"a": RecordSpec(100), "b": RecordSpec(100), "c": RecordSpec(100)}
    uses = [Use(("a", "b"), writes=("a",)), Use(("c",))]
    for steady in (False, True):
        plan = make_plan(uses, records, budget=200, steady=steady)
        assert plan.bytes_written == 0, plan.ops
        assert "a" not in [op.key for op in plan.ops if op.op == "evict"], plan.ops


@settings(max_examples=200, deadline=None)
@given(traces(writes=False, equal=True))
def test_read_only_equal_sized_records_move_the_fewest_bytes(case):
    """Farthest-next-use eviction is optimal when every record has the same size and
    none is modified: the plan reads exactly what brute force finds."""
    uses, records, budget = case
    plan = make_plan(uses, records, budget)
    assert plan.bytes_written == 0
    assert plan.bytes_read == _optimum(uses, records, budget)


@settings(max_examples=200, deadline=None)
@given(traces())
def test_never_below_the_optimum(case):
    uses, records, budget = case
    assert make_plan(uses, records, budget).bytes_moved >= _optimum(uses, records, budget)


@settings(max_examples=200, deadline=None)
@given(traces(reserve=True))
def test_a_reserve_shrinks_the_budget_and_the_plan_stays_at_or_above_the_optimum(case):
    """Memory held outside the records (`Use.reserved`, e.g. gradients kept from their
    backward to their update) is never given to them: the plan, executed, holds at
    most the budget with the reserve counted, and no eviction choice under the same
    reserves moves fewer bytes."""
    uses, records, budget = case
    plan = make_plan(uses, records, budget)
    assert _replay(uses, records, plan) == (plan.bytes_read, plan.bytes_written)
    assert plan.bytes_moved >= _optimum(uses, records, budget)
    read, written = lru_bytes(uses, records, budget)
    assert read + written >= _optimum(uses, records, budget)


def test_a_reserve_that_grows_evicts_what_is_needed_last():
    records = {"a": RecordSpec(2), "b": RecordSpec(2)}
    uses = [Use(("a",)), Use(("b",)), Use(("b",), reserved=2), Use(("a",)), Use(("b",))]
    plan = make_plan(uses, records, 4)
    _replay(uses, records, plan)
    assert plan.held[2] == 4 and plan.bytes_read == 6  # "a" dropped, read again at use 3
    with pytest.raises(ValueError, match="needs 5 bytes at once"):
        make_plan([Use(("a",), reserved=3)], records, 4)


def _training_step(layers=8, size=10, state=20):
    """A step's access trace: forward over the layers' parameters, backward in reverse
    with each layer's update (its optimizer state, modified, and its parameters)."""
    records = {f"p{k}": RecordSpec(size) for k in range(layers)}
    records.update({f"s{k}": RecordSpec(state) for k in range(layers)})
    uses = [Use((f"p{k}",), kind="forward", label=f"fwd {k}", compute_s=0.01)
            for k in range(layers)]
    for k in reversed(range(layers)):
        uses.append(Use((f"p{k}",), kind="backward", label=f"bwd {k}", compute_s=0.02))
        uses.append(Use((f"p{k}", f"s{k}"), (f"p{k}", f"s{k}"), kind="update",
                        label=f"adam {k}", compute_s=0.005))
    return uses, records


@pytest.mark.parametrize("budget", [30, 60, 100, 200])
def test_a_training_step_moves_fewer_bytes_than_lru(budget):
    uses, records = _training_step()
    plan = make_plan(uses, records, budget)
    _replay(uses, records, plan)
    read, written = lru_bytes(uses, records, budget)
    assert plan.bytes_moved <= read + written
    if budget == 100:  # LRU evicts exactly what the backward needs next
        assert plan.bytes_moved < read + written


@pytest.mark.parametrize("layers", [2, 3, 8])
def test_a_training_step_moves_no_more_than_lru_at_any_budget(layers):
    """[Note: the plan against LRU's victims] At every budget, every step after the
    first: before, farthest-next-use could write back a 20-byte state where LRU
    dropped a 10-byte parameter, and the steady LRU baseline kept the previous step's
    order of use as if it were this step's (2 layers at 50: LRU moves 100 bytes a step,
    not the 50 it reported, which the plan's 80 exceeded)."""
    uses, records = _training_step(layers)
    for budget in range(30, 30 * layers + 1):
        plan = make_plan(uses, records, budget, steady=True)
        assert plan.bytes_moved <= sum(lru_bytes(uses, records, budget, True)), budget
        assert max(plan.held) <= budget
        _replay(uses, records, make_plan(uses, records, budget))
    assert lru_bytes(*_training_step(2), 50, steady=True) == (50, 50)


def test_prefetch_is_issued_ahead_where_the_budget_allows():
    uses, records = _training_step()
    plan = make_plan(uses, records, 100)
    fetches = [op for op in plan.ops if op.op == "fetch"]
    assert any(op.at < op.needed_at for op in fetches)
    tight = make_plan(uses, records, 30)  # one layer's parameters and state only
    for op in tight.ops:  # a layer's state fits beside its parameters from its backward on:
        if op.op == "fetch" and op.key.startswith("s"):  # it is read while that runs
            backward = uses.index(Use((f"p{op.key[1:]}",), kind="backward",
                                      label=f"bwd {op.key[1:]}", compute_s=0.02))
            assert op.at <= backward < op.needed_at, op


def test_simulated_step_waits_for_the_disk_and_writes_a_trace(tmp_path):
    uses, records = _training_step()
    plan = make_plan(uses, records, 100)
    slow = simulate(plan, uses, Rates(read_Bps=100, write_Bps=100))
    fast = simulate(plan, uses, Rates(read_Bps=1e9, write_Bps=1e9))
    compute = sum(u.compute_s for u in uses)
    assert fast.step_s == pytest.approx(compute, rel=1e-6) and fast.exposed_io_s < 1e-6
    assert slow.step_s >= max(compute, plan.bytes_moved / 100) - 1e-9
    assert slow.exposed_io_s > 0
    path = write_trace_dict(tmp_path / "predicted.trace.json",
                            slow.to_trace(budget=plan.budget))
    data = json.loads(path.read_text())
    assert data["metadata"]["kind"] == "predicted"
    names = {(e["name"], e["ph"]) for e in data["traceEvents"]}
    assert {("read", "b"), ("write", "b"), ("fetch", "b"), ("wait:gather", "X"),
            ("step", "X")} <= names
    # the report reads it as it reads a measured trace: the same bytes and waits
    (rank,) = parse_trace(data)
    (step,) = steps_of(rank)
    moved = bytes_moved(rank, step)
    assert (moved["nvme_read"], moved["nvme_write"]) == (plan.bytes_read, plan.bytes_written)
    assert exposed_time(rank, step)["io"] == pytest.approx(slow.exposed_io_s * 1e6, rel=1e-6)
    # a use of each record by the compute, and the fetches that served them: before, the
    # prediction's fetches had no `steps` and only uses that waited were drawn, so the
    # report called every use "resident"
    outcomes = prefetch_outcomes(rank)
    assert len(outcomes) == sum(len(u.keys) for u in uses if u.lane == "compute")
    fetched = sum(len(ops) for i, ops in plan.fetches_by_use.items()
                  if uses[i].lane == "compute")
    assert sum(o.outcome != "resident" for o in outcomes) == fetched > 0


def test_a_use_bigger_than_the_budget_is_refused():
    uses, records = _training_step()
    with pytest.raises(ValueError, match="needs 30 bytes at once"):
        make_plan(uses, records, 29)


def test_updates_on_their_own_lane_overlap_backward_and_the_commit_waits_for_them():
    """The engine's update thread: each update starts after the backward that made its
    gradient, runs beside the next backward, holds back the backward after that (one
    update queues, no more), and the commit waits for the last."""
    uses = [Use((), kind="forward", compute_s=1.0)]
    for k in range(3):
        uses.append(Use((), kind="backward", compute_s=1.0))
        uses.append(Use((), kind="update", compute_s=0.5, lane="update"))
    uses.append(Use((), kind="commit", compute_s=0.1))
    plan = make_plan(uses, {}, 1)
    pred = simulate(plan, uses, Rates(read_Bps=1e9, write_Bps=1e9))
    assert pred.step_s == pytest.approx(1.0 + 3 * 1.0 + 0.5 + 0.1)  # the last update shows
    serial = [Use((), kind=u.kind, compute_s=u.compute_s) for u in uses]
    assert simulate(plan, serial, Rates(1e9, 1e9)).step_s == pytest.approx(5.6)
    slow = [Use((), kind=u.kind, compute_s=3.0 if u.lane == "update" else u.compute_s,
                lane=u.lane) for u in uses]
    # backward 2 waits for update 0 (issued before backward 1), backward 3 for update 1
    got = simulate(plan, slow, Rates(1e9, 1e9))
    spans = {e[5]["use"]: (e[3], e[4]) for e in got.events if e[1] == "compute"}
    assert spans[3][0] == pytest.approx(spans[1][1])  # backward 1 right after backward 0
    assert spans[5][0] == pytest.approx(spans[2][1])  # backward 2 when update 0 ends
    assert got.step_s == pytest.approx(1.0 + 1.0 + 3 * 3.0 + 0.1)


def test_a_fresh_write_is_not_fetched_and_leaves_no_previous_version_behind():
    """An update that writes a partition whole without reading it (the master kept
    apart: bf16 training) does not read the partition back where it left memory, and
    its old version, on NVMe only, needs no room until the commit."""
    records = {k: RecordSpec(1) for k in "ab"}
    uses = [Use(("a",)), Use(("b",)),
            Use(("a",), ("a",), "update", previous=("a",), fresh=("a",)),
            Use(("b",), ("b",), "update", previous=("b",), fresh=("b",)),
            Use((), (), "commit", drops=(previous_key("a"), previous_key("b")))]
    plan = make_plan(uses, records, 1, steady=True)
    assert not [op for op in plan.ops if op.op == "fetch" and op.needed_at in (2, 3)], plan.ops
    assert max(plan.held) <= 1
    reading = make_plan([Use(u.keys, u.writes, u.kind) for u in uses], records, 1, steady=True)
    assert [op for op in reading.ops if op.op == "fetch" and op.needed_at == 2]  # reads it


def test_a_use_waits_for_the_write_that_makes_its_room():
    """A dirty record that must leave for a use's record is written first: with the
    write-back issued where the room is needed (as the store evicts), that use waits
    for the write, then for its own read."""
    import dataclasses

    uses = [Use(("a",), ("a",), compute_s=1.0), Use(("b",), compute_s=1.0)]
    plan = make_plan(uses, {"a": RecordSpec(10), "b": RecordSpec(10)}, 10)
    (wb,) = [op for op in plan.ops if op.op == "write-back"]
    assert (wb.key, wb.at, wb.needed_at, wb.follows) == ("a", 1, 1, 0)
    rates = Rates(read_Bps=10, write_Bps=10)  # a second per record either way
    pred = simulate(plan, uses, rates)
    waits = {e[0]: (e[3], e[4]) for e in pred.events if e[1] == "wait"}
    # a is read over [0, 1] and used until 2; then written over [2, 3] for b's room,
    # b read over [3, 4] behind it, and used until 5
    assert waits["wait:budget"] == pytest.approx((2.0, 3.0))
    assert waits["wait:gather"] == pytest.approx((3.0, 4.0))
    assert pred.step_s == pytest.approx(5.0)
    assert pred.exposed_io_s == pytest.approx(1.0 + 2.0)
    # a write that does not make room for anything is nobody's wait
    loose = dataclasses.replace(plan, ops=[dataclasses.replace(op, needed_at=None)
                                           if op.op == "write-back" else op
                                           for op in plan.ops])
    assert not [e for e in simulate(loose, uses, rates).events if e[0] == "wait:budget"]


def test_a_read_into_the_room_of_a_dirty_record_waits_for_its_write():
    """An update (5 s on its own lane) dirties a; b's read needs a's room, so it waits
    until a's bytes are on NVMe (the store holds a dirty copy until then) and the step
    takes 8 s, not the 7 s of a read that overwrote a's room during its update."""
    records = {"a": RecordSpec(100, resident=True), "b": RecordSpec(100),
               "c": RecordSpec(100)}
    uses = [Use(("a",), writes=("a",), compute_s=5.0, lane="update"),
            Use(("c",), compute_s=0.0), Use(("b", "c"), compute_s=1.0)]
    pred = simulate(make_plan(uses, records, budget=200), uses,
                    Rates(read_Bps=100, write_Bps=100))
    io = {(e[0], e[5].get("key")): (e[3], e[4]) for e in pred.events if e[1] == "io"}
    assert io[("write", "a")] == pytest.approx((5.0, 6.0))
    assert io[("read", "b")][0] >= io[("write", "a")][1]
    assert pred.step_s == pytest.approx(8.0)


def test_a_fetch_does_not_wait_for_the_room_of_a_later_use():
    """The next backward (b) may start before the update lane's second update (s2), so
    its operations are issued first: the write-back of s2 that makes b's room, after
    s2's update. s2's own fetch, issued later, waits only for rooms made for its use
    or earlier ones. Before, it waited for that write-back too, which waited for its
    update: "the plan's operations wait on one another"."""
    records = {k: RecordSpec(1) for k in ("a", "s1", "s2", "b")}
    uses = [Use(("a",), kind="backward", compute_s=1.0),
            Use(("s1",), ("s1",), kind="update", compute_s=5.0, lane="update"),
            Use(("s2",), ("s2",), kind="update", compute_s=1.0, lane="update"),
            Use(("b",), kind="backward", compute_s=1.0)]
    plan = make_plan(uses, records, budget=2)
    pred = simulate(plan, uses, Rates(read_Bps=1.0, write_Bps=1.0))
    io = {(e[0], e[5]["key"]): (e[3], e[4]) for e in pred.events if e[1] == "io"}
    start = {e[5]["use"]: e[3] for e in pred.events if e[1] == "compute"}
    assert io[("read", "s2")][1] <= start[2] < io[("write", "s2")][0]  # read, update, write
    assert io[("read", "b")][0] >= io[("write", "s2")][1]  # b reads into s2's room
    assert pred.step_s == pytest.approx(13.0)


def test_the_disk_serves_operations_in_the_order_of_time_they_are_issued():
    """An update lane whose long first update delays its second one's read: that read
    is issued later in time than the next backward's fetch, so it queues behind it,
    not ahead of it, though it comes first in the trace."""
    uses = [Use((), kind="backward", compute_s=1.0),
            Use((), kind="update", compute_s=5.0, lane="update"),
            Use(("s",), kind="update", compute_s=0.1, lane="update"),
            Use(("p",), kind="backward", compute_s=1.0),
            Use((), kind="commit", compute_s=0.0)]
    plan = make_plan(uses, {"s": RecordSpec(100), "p": RecordSpec(1)}, 101)
    assert {op.key: op.at for op in plan.ops if op.op == "fetch"} == {"s": 0, "p": 0}
    import dataclasses
    plan = dataclasses.replace(plan, ops=[dataclasses.replace(op, at=op.needed_at)
                                          for op in plan.ops])  # each at its use
    pred = simulate(plan, uses, Rates(read_Bps=100, write_Bps=100))
    start = {e[5]["use"]: e[3] for e in pred.events if e[1] == "compute"}
    assert start[3] == pytest.approx(1.01)   # p (1 byte) read at 1 s, before s at 6 s
    assert start[2] == pytest.approx(7.0)    # s read over [6, 7]
    assert pred.step_s == pytest.approx(7.1)


def test_a_write_back_due_later_does_not_hold_up_the_disk_before_it():
    """The update lane's chunk is written back once its update ends, the write issued
    at the next backward in the trace, beside that backward's fetch. The disk serves
    the fetch while the update still runs and the write when it falls due. The
    simulator queued the fetch behind the write, as if the disk were busy until the
    update ended: the backward waited for the whole update, and the MLP `both` rows
    of `offload bench plan` came out 12-32% long."""
    import dataclasses

    uses = [Use((), kind="backward", compute_s=1.0),
            Use(("s",), ("s",), kind="update", compute_s=5.0, lane="update"),
            Use(("p",), kind="backward", compute_s=1.0),
            Use((), kind="commit", compute_s=0.0)]
    plan = make_plan(uses, {"s": RecordSpec(10, resident=True), "p": RecordSpec(10)}, 20)
    (fetch,) = [op for op in plan.ops if op.op == "fetch"]
    write = PlanOp("write-back", "s", 10, at=2, needed_at=None, follows=1)
    plan = dataclasses.replace(plan, ops=[dataclasses.replace(fetch, at=2), write],
                               bytes_written=10)
    pred = simulate(plan, uses, Rates(read_Bps=10, write_Bps=10))  # a second a record
    start = {e[5]["use"]: e[3] for e in pred.events if e[1] == "compute"}
    assert start[2] == pytest.approx(2.0)   # p read over [1, 2], beside the update
    assert start[3] == pytest.approx(6.0)   # the commit waits for the update
    io = {e[0]: (e[3], e[4]) for e in pred.events if e[1] == "io"}
    assert io == {"read": pytest.approx((1.0, 2.0)), "write": pytest.approx((6.0, 7.0))}
    assert pred.step_s == pytest.approx(7.0) and pred.exposed_io_s == pytest.approx(1.0)
