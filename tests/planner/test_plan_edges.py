"""The plan and the simulator at their edges: ties, empty and one-use traces, budgets
met exactly, records that do not fit, bad inputs, and the same plan in every process."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.planner import Rates, RecordSpec, Use, lru_bytes, make_plan, previous_key, simulate

from .test_plan import _replay

_PLAN_SCRIPT = """
import json
from offload.planner import RecordSpec, Use, make_plan, lru_bytes, simulate, Rates
records = {f"r{k}": RecordSpec(k % 3 + 1, resident=k < 4, dirty=k % 2 == 0)
           for k in range(10)}
uses = [Use(("r0", "r1")), Use(("r2", "r3"), ("r2",)), Use(("r4", "r5")),
        Use(("r6", "r7"), ("r6",)), Use(("r8", "r9")), Use(("r0", "r1", "r2"))]
out = []
try:  # a use that cannot fit: its message names its records, the same in every process
    make_plan([Use(("r0",), ("r0",)), Use(("r0",), ("r0",), previous=("r0",))],
              {"r0": RecordSpec(4)}, 6)
except ValueError as e:
    out.append(str(e))
for budget in (7, 8, 9, 11):
    for steady in (False, True):
        plan = make_plan(uses, records, budget, steady=steady)
        pred = simulate(plan, uses, Rates(10.0, 5.0))
        out.append([[list(map(str, (o.op, o.key, o.at, o.needed_at, o.follows)))
                     for o in plan.ops], plan.held, plan.bytes_read, plan.bytes_written,
                    lru_bytes(uses, records, budget, steady=steady), pred.step_s])
print(json.dumps(out))
"""


def test_the_same_inputs_give_the_same_plan_in_every_process():
    """Victims tied on next use (records used by the same later use, or by none) are
    chosen by the records' order, not by a set's iteration order, which differs from
    one process to the next with string hashing (PYTHONHASHSEED)."""
    outs = set()
    for seed in ("1", "2", "3", "4", "5"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        got = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT], env=env, check=True,
                             capture_output=True, text=True, cwd=_repo_root())
        outs.add(got.stdout)
    assert len(outs) == 1, [json.loads(o)[0][2:4] for o in outs]


def _repo_root():
    import pathlib
    return str(pathlib.Path(__file__).resolve().parents[2])


def test_a_record_larger_than_the_budget_is_named():
    records = {"small": RecordSpec(1), "huge": RecordSpec(50)}
    with pytest.raises(ValueError, match=r"needs 50 bytes at once, more than the budget of "
                                         r"40: records 'huge' \(50 bytes\)"):
        make_plan([Use(("small",)), Use(("huge",))], records, 40)
    with pytest.raises(ValueError, match="'huge' \\(50 bytes\\)"):
        lru_bytes([Use(("huge",))], records, 40)


def test_a_previous_version_that_does_not_fit_beside_its_record_is_a_clear_error():
    """A dirty record an update keeps the previous version of needs its bytes twice
    ([Note: previous versions]): where the budget holds it only once, the plan says
    which use and how much, rather than failing inside `max()`."""
    records = {"a": RecordSpec(1)}
    uses = [Use(("a",), ("a",), "update", "adam 0", previous=("a",))]
    make_plan(uses, records, 1)  # clean on the first step: updated in place
    with pytest.raises(ValueError, match=r"use 0 \(update adam 0\) needs 1 bytes more than "
                                         r"the budget of 1 leaves: its records .*'a'"):
        make_plan(uses, records, 1, steady=True)  # dirty from the step before
    with pytest.raises(ValueError, match="use 0 .* budget of 1"):
        lru_bytes(uses, records, 1, steady=True)
    assert make_plan(uses, records, 2, steady=True).bytes_moved == 0


def test_a_second_update_of_the_same_record_in_a_step_keeps_one_previous_version():
    """Two updates of one record in a step, each listing it in `previous`: the step's
    previous version is kept once (the version before the step is what a failure goes
    back to), so after the commit drops it the plan holds only what is resident."""
    records = {"a": RecordSpec(2), "b": RecordSpec(2)}
    uses = [Use(("a",), ("a",)), Use(("a",), ("a",), previous=("a",)),
            Use(("a",), ("a",), previous=("a",)), Use((), drops=(previous_key("a"),)),
            Use(("b",)), Use(("a",))]
    for budget in (4, 6):
        plan = make_plan(uses, records, budget)
        _replay(uses, records, plan)  # the bytes held are the bytes resident
        assert plan.held[4:] == [4, 4] and plan.bytes_moved == 4
    assert lru_bytes(uses, records, 4) == (4, 0)  # a and b fit: nothing leaves


@pytest.mark.parametrize("use, match", [
    (Use(("a",), ("a",), drops=("a",)), "drops 'a', which is no previous version"),
    (Use(("a",), drops=(previous_key("zzz"),)), "which is no previous version"),
    (Use(("a",), (), previous=("a",)), "keeps the previous version of .'a'., which it "
                                         "does not write"),
    (Use(("a",), (), fresh=("a",)), "overwrites .'a'. whole, which it does not write"),
    (Use(("a",), reserved=-1), "reserves -1 bytes"),
])
def test_uses_that_would_lose_or_invent_bytes_are_refused(use, match):
    """A drop frees a record without writing it: naming anything but a previous version
    would lose a dirty record's only copy. `previous` and `fresh` are parts of
    `writes`; a negative reserve would hand the records more than the budget."""
    records = {"a": RecordSpec(2), "b": RecordSpec(2)}
    with pytest.raises(ValueError, match=match):
        make_plan([Use(("a",), ("a",)), use, Use(("b",)), Use(("a",))], records, 2)
    with pytest.raises(ValueError, match=match):
        lru_bytes([use], records, 2)


@pytest.mark.parametrize("budget", [math.nan, -1, -0.5])
def test_a_budget_that_is_no_number_of_bytes_is_refused(budget):
    records = {"a": RecordSpec(2), "b": RecordSpec(2)}
    with pytest.raises(ValueError, match="budget"):
        make_plan([Use(("a",)), Use(("b",))], records, budget)
    with pytest.raises(ValueError, match="budget"):
        lru_bytes([Use(("a",)), Use(("b",))], records, budget)


def test_a_record_of_negative_size_is_refused():
    with pytest.raises(ValueError, match="nbytes must be a number of bytes >= 0, got -3"):
        RecordSpec(-3)
    with pytest.raises(ValueError, match="nbytes"):
        RecordSpec(math.nan)


def test_a_zero_budget_holds_a_trace_that_needs_no_bytes():
    """Budgets are hard, zero included: a trace whose records take no bytes (or that
    names none) plans under it; one byte is refused with the use and the record."""
    records = {"empty": RecordSpec(0)}
    for uses in ([], [Use(())], [Use(("empty",), ("empty",))]):
        plan = make_plan(uses, records, 0)
        assert plan.held == [0] * len(uses) and plan.bytes_moved == 0
        assert simulate(plan, uses, Rates(1.0, 1.0)).step_s == 0.0
    with pytest.raises(ValueError, match="budget of 0: records 'one'"):
        make_plan([Use(("one",))], {"one": RecordSpec(1)}, 0)


@pytest.mark.parametrize("rates", [(math.nan, 1.0), (1.0, 0.0), (1.0, -2.0), (1.0, 1.0, math.nan),
                                   (1.0, 1.0, -1.0), (1.0, math.inf, math.nan)])
def test_rates_that_are_no_rate_are_refused(rates):
    with pytest.raises(ValueError, match="_Bps must be"):
        Rates(*rates)


@pytest.mark.parametrize("compute_s", [-1.0, math.nan, math.inf])
def test_a_use_whose_seconds_are_no_duration_is_refused_by_the_simulator(compute_s):
    records = {"a": RecordSpec(2)}
    uses = [Use(("a",)), Use(("a",), kind="backward", label="layer 0", compute_s=compute_s)]
    plan = make_plan(uses, records, 2)
    with pytest.raises(ValueError, match=r"use 1 \(backward layer 0\) takes .* seconds"):
        simulate(plan, uses, Rates(1.0, 1.0))


def test_a_fetch_issued_after_its_use_is_a_clear_error():
    """A plan built by hand (or edited) whose fetch is issued after the use that needs
    it cannot be simulated: the simulator says which, not a KeyError."""
    import dataclasses

    records = {"a": RecordSpec(2), "b": RecordSpec(2)}
    uses = [Use(("a",)), Use(("b",)), Use(())]
    plan = make_plan(uses, records, 4)
    late = dataclasses.replace(plan, ops=[dataclasses.replace(op, at=2) if op.key == "b"
                                          else op for op in plan.ops])
    late.fetches_by_use = {i: [dataclasses.replace(op, at=2) if op.key == "b" else op
                               for op in ops] for i, ops in plan.fetches_by_use.items()}
    with pytest.raises(ValueError, match="fetch of 'b' .*issued at use 2.*needed at use 1"):
        simulate(late, uses, Rates(1.0, 1.0))


_INF = float("inf")


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_an_infinitely_fast_disk_hides_every_transfer(data):
    """Rates may be infinite (a disk that costs nothing): the step is its compute."""
    from .test_plan import traces

    uses, records, budget = data.draw(traces())
    uses = [Use(u.keys, u.writes, compute_s=data.draw(st.sampled_from([0.0, 0.5, 1.0])))
            for u in uses]
    plan = make_plan(uses, records, budget)
    pred = simulate(plan, uses, Rates(_INF, _INF))
    assert pred.step_s == pytest.approx(sum(u.compute_s for u in uses))
    assert pred.exposed_io_s == 0.0


@st.composite
def _rich_traces(draw):
    """Traces the other strategies leave out: records resident (and dirty) from the
    start, records of no bytes, a record named twice in one use, uses naming none,
    updates that keep previous versions without a commit, budgets met exactly."""
    n = draw(st.integers(1, 6))
    names = [f"r{k}" for k in range(n)]
    records = {}
    for k in names:
        resident = draw(st.booleans())
        records[k] = RecordSpec(draw(st.integers(0, 5)), resident,
                                resident and draw(st.booleans()))
    uses, kept = [], []
    for _ in range(draw(st.integers(0, 10))):
        keys = tuple(draw(st.lists(st.sampled_from(names), max_size=3)))
        writes = tuple(k for k in dict.fromkeys(keys) if draw(st.booleans()))
        prev = tuple(k for k in writes if k not in kept and draw(st.booleans()))
        kept.extend(prev)
        fresh = tuple(k for k in writes if draw(st.booleans()))
        uses.append(Use(keys, writes, reserved=draw(st.integers(0, 3)), previous=prev,
                        fresh=fresh))
    if kept and draw(st.booleans()):
        uses.append(Use((), (), "commit", drops=tuple(previous_key(k) for k in kept)))
    need = max([sum(records[k].nbytes for k in dict.fromkeys(u.keys)) + u.reserved
                for u in uses], default=0)
    start = sum(r.nbytes for r in records.values() if r.resident)
    low = max(need, start)
    budget = draw(st.integers(low, low + sum(r.nbytes for r in records.values())))
    return uses, records, budget, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_rich_traces())
def test_the_budget_holds_from_any_start_or_the_plan_says_which_use_does_not_fit(case):
    """From records resident and dirty at the start, the plan executed holds at most the
    budget at every use (a steady one too), writes back exactly what was dirty, and
    where an update's previous version cannot fit beside its record the ValueError
    names the use; nothing else is raised."""
    uses, records, budget, steady = case
    try:
        plan = make_plan(uses, records, budget, steady=steady)
    except ValueError as e:
        assert "needs" in str(e) and "budget" in str(e), e
        return
    assert all(0 <= held <= budget for held in plan.held), (plan.held, budget)
    if not steady:
        assert _replay(uses, records, plan) == (plan.bytes_read, plan.bytes_written)
    try:
        lru_bytes(uses, records, budget, steady=steady)
    except ValueError as e:
        assert "needs" in str(e) and "budget" in str(e), e


def test_a_record_of_no_bytes_is_never_evicted_for_room():
    """Evicting a record of no bytes frees nothing; a dirty one was written back first,
    and the use the "room" was for waited for that write, which followed a 100 s update:
    b started at 102 s instead of 3 s."""
    records = {"a": RecordSpec(10), "b": RecordSpec(10), "z": RecordSpec(0)}
    uses = [Use(("a",), compute_s=1.0),
            Use(("z",), ("z",), compute_s=100.0, lane="update"),
            Use(("b",), compute_s=1.0)]
    plan = make_plan(uses, records, budget=10)
    assert not [op for op in plan.ops if op.key == "z" and op.op != "fetch"], plan.ops
    pred = simulate(plan, uses, Rates(read_Bps=10.0, write_Bps=10.0))
    start = {e[5]["use"]: e[3] for e in pred.events if e[1] == "compute"}
    assert start[2] == pytest.approx(3.0)


def test_the_steady_plan_takes_lru_s_victims_where_they_move_fewer_bytes():
    """[Note: the plan against LRU's victims] Farthest-next-use here writes back the
    dirty 3-byte r0 where LRU's victims move 9 bytes a step; the plan moved 10."""
    records = {"r0": RecordSpec(3), "r1": RecordSpec(4), "r2": RecordSpec(3)}
    uses = [Use(("r0",), ("r0",)), Use(("r2", "r1")), Use(("r1",))]
    assert sum(lru_bytes(uses, records, 8, steady=True)) == 9
    plan = make_plan(uses, records, 8, steady=True)
    assert plan.bytes_moved == 9 and max(plan.held) <= 8


@st.composite
def _steady_traces(draw):
    """Records of 1-4 bytes, some resident (and dirty) at the start; uses of one or two
    of them that write some, keep the previous versions of some written ones (`fresh`
    or read), reserve 0-2 bytes; a commit that drops the versions kept, or none."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    records, start = {}, 0
    for k, s in enumerate(sizes):
        resident = start + s <= 2 * max(sizes) and draw(st.booleans())
        start += s * resident
        records[f"r{k}"] = RecordSpec(s, resident, resident and draw(st.booleans()))
    keys = st.sampled_from(sorted(records))
    uses, kept = [], []
    for _ in range(draw(st.integers(2, 8))):
        ks = tuple(dict.fromkeys(draw(st.lists(keys, min_size=1, max_size=2))))
        writes = tuple(k for k in ks if draw(st.booleans()))
        prev = tuple(k for k in writes if draw(st.booleans()))
        kept.extend(k for k in prev if k not in kept)
        uses.append(Use(ks, writes, reserved=draw(st.integers(0, 2)), previous=prev,
                        fresh=tuple(k for k in writes if draw(st.booleans()))))
    if kept and draw(st.booleans()):
        uses.append(Use((), (), "commit", drops=tuple(previous_key(k) for k in kept)))
    budget = draw(st.integers(2 * max(sizes) + 2, max(2 * max(sizes), sum(sizes)) + 4))
    return uses, records, budget


def test_a_record_left_dirty_by_the_step_before_moves_no_more_than_lru():
    """r0 starts dirty; use 0 updates it keeping its previous version, use 1 overwrites
    r1 whole keeping its own. The plan (with LRU's victims too: the rules against
    round trips undid LRU's write and read of r0) made room at use 1 by writing r0's
    previous version and kept r0 dirty to the step's end, so the next step's use 0
    kept a dirty previous version of r0 again: 7 bytes a steady step (r1's previous
    version and r0's written for room). LRU writes r0 back and reads it again, so r0
    starts the next step clean, is updated in place, and nothing moves ([Note: the
    plan against LRU's victims])."""
    records = {"r0": RecordSpec(5, resident=True, dirty=True), "r1": RecordSpec(2)}
    uses = [Use(("r1", "r0"), writes=("r1", "r0"), previous=("r0",)),
            Use(("r1",), writes=("r1",), previous=("r1",), fresh=("r1",)),
            Use(("r0",)), Use(("r0",)),
            Use(("r0",), drops=(previous_key("r0"),))]
    assert sum(lru_bytes(uses, records, 12, steady=True)) == 0
    plan = make_plan(uses, records, 12, steady=True)
    assert plan.bytes_moved == 0 and max(plan.held) <= 12, plan.ops


def test_a_record_named_as_another_s_previous_version_is_refused():
    """previous_key("a") is ("a", "previous"): a record of that key was taken for a's
    previous version, so a use that needs it found it "resident" and the plan never
    fetched it (no ops, 0 bytes read)."""
    records = {"a": RecordSpec(5, resident=True, dirty=True),
               ("a", "previous"): RecordSpec(5)}
    uses = [Use(("a",), ("a",), previous=("a",)), Use((("a", "previous"),)),
            Use((), drops=(previous_key("a"),))]
    match = r"record \('a', 'previous'\) is named as the previous version of record 'a'"
    with pytest.raises(ValueError, match=match):
        make_plan(uses, records, 15)
    with pytest.raises(ValueError, match=match):
        lru_bytes(uses, records, 15)
    records = {"b": RecordSpec(5), ("a", "previous"): RecordSpec(5)}  # no record "a"
    assert make_plan([Use((("a", "previous"),))], records, 5).bytes_read == 5


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_steady_plan_never_moves_more_than_lru(data):
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    records = {f"r{k}": RecordSpec(s) for k, s in enumerate(sizes)}
    keys = st.sampled_from(sorted(records))
    uses = []
    for _ in range(data.draw(st.integers(2, 8))):
        ks = tuple(dict.fromkeys(data.draw(st.lists(keys, min_size=1, max_size=2))))
        uses.append(Use(ks, tuple(k for k in ks if data.draw(st.booleans()))))
    budget = data.draw(st.integers(2 * max(sizes), max(2 * max(sizes), sum(sizes))))
    try:
        lru = sum(lru_bytes(uses, records, budget, steady=True))
    except ValueError:
        return
    plan = make_plan(uses, records, budget, steady=True)
    assert plan.bytes_moved <= lru and max(plan.held) <= budget


@settings(max_examples=500, deadline=None)
@given(_steady_traces())
def test_the_steady_plan_never_moves_more_than_lru_from_any_start(case):
    """Records resident and dirty at the start, reserves, updates that keep previous
    versions (fresh or read) and the commit that drops them: wherever LRU's steady step
    fits, the steady plan fits too, moves no more bytes and holds at most the budget
    ([Note: the plan against LRU's victims])."""
    uses, records, budget = case
    try:
        lru = sum(lru_bytes(uses, records, budget, steady=True))
    except ValueError:
        return
    plan = make_plan(uses, records, budget, steady=True)
    assert plan.bytes_moved <= lru and max(plan.held) <= budget, (plan.bytes_moved, lru)
