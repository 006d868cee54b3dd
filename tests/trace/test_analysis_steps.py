"""The per-step figures of a trace of many steps, computed in one pass (bisection over
the steps and over the waits), against the definitions applied one step at a time:
on random traces of overlapping spans, steps that may overlap, and uses of records
with fetches before, inside and after them."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.trace.analysis import (FETCH, MAIN_THREAD_TRACK, OPTIM_UPDATE, USE_WAIT,
                                    RankTrace, Span, Step, StepIndex, byte_count,
                                    bytes_moved_per_step, exposed_times, intersect_length,
                                    is_collective_wait, prefetch_outcomes, union,
                                    union_length)

T = st.integers(0, 60).map(float)


@st.composite
def steps(draw):
    out = []
    for i in range(draw(st.integers(1, 6))):
        a = draw(T)
        out.append(Step(f"step {i + 1}", a, a + draw(T)))
    return out


@st.composite
def rank(draw):
    spans = []
    kinds = [("wait:gather", "wait", "compute", {}), ("wait:all-gather", "wait", "compute", {}),
             ("wait:room", "wait", MAIN_THREAD_TRACK, {}), (OPTIM_UPDATE, "optim", "optim", {}),
             ("optimizer step", "compute", "compute", {}), ("forward", "compute", "compute", {}),
             ("NVME->HOST", "store", "io", {"bytes": 4096}),
             ("read", "io", "aio", {"bytes": 8192}), ("write", "io", "aio", {"bytes": 512}),
             ("write", "io", "aio", {"bytes": 512, "error": "EIO"})]
    for _ in range(draw(st.integers(0, 25))):
        name, cat, track, args = draw(st.sampled_from(kinds))
        a = draw(T)
        spans.append(Span(a, a + draw(T), name, cat, track, dict(args),
                          is_async=cat in ("store", "io")))
    for _ in range(draw(st.integers(0, 25))):  # uses of two records, and their fetches
        key, a = draw(st.sampled_from(["k0", "k1"])), draw(T)
        if draw(st.booleans()):
            spans.append(Span(a, a + draw(T), USE_WAIT, "wait", "compute", {"key": key}))
        else:
            spans.append(Span(a, a + draw(T), FETCH, FETCH, "store",
                              {"key": key, "steps": draw(st.integers(0, 2))}))
    spans.sort(key=lambda s: (s.start, -s.end))
    return RankTrace(0, "rank", "<test>", spans)


def _exposed(rt, step):
    """The definition (exposed_time's docstring), one step at a time."""
    comm = union((s.start, s.end) for s in rt.spans if is_collective_wait(s))
    io = [(s.start, s.end) for s in rt.spans
          if s.cat == "wait" and (s.name == USE_WAIT or (
              s.track == MAIN_THREAD_TRACK and not is_collective_wait(s)))]
    updates = union((s.start, s.end) for s in rt.spans if s.name == OPTIM_UPDATE)
    for s in rt.spans:
        if s.name == "optimizer step" and s.cat == "compute":
            t = s.start
            while t < s.end:  # the optimizer phase where no update computes, scanned
                nxt = min([s.end] + [a for a, _ in updates if a > t])
                inside = next((b for a, b in updates if a <= t < b), None)
                if inside is None:
                    io.append((t, nxt))
                    t = nxt
                else:
                    t = inside
    clip = (step.start, step.end)
    io_in = union((max(a, clip[0]), min(b, clip[1])) for a, b in union(io))
    comm_in = union((max(a, clip[0]), min(b, clip[1])) for a, b in comm)
    return {"comm": union_length(comm_in),
            "io": union_length(io_in) - intersect_length(io_in, comm_in)}


def _moved(rt, step):
    moves, nvme, busy = {}, {"read": 0, "write": 0}, {"read": [], "write": []}
    for s in rt.spans:
        if s.is_async and step.holds(s.start) and not s.args.get("error"):
            n = byte_count(s.args.get("bytes"))
            if s.cat == "store":
                moves[s.name] = moves.get(s.name, 0) + n
            elif s.name in nvme:
                nvme[s.name] += n
                busy[s.name].append((s.start, s.end))
    return {"moves": moves, "nvme_read": nvme["read"], "nvme_write": nvme["write"],
            "read_busy_us": union_length(busy["read"]),
            "write_busy_us": union_length(busy["write"])}


def _outcomes(rt):
    """[Note: prefetch outcome], every fetch of the record looked at for each use."""
    out, last = [], {}
    for u in rt.spans:
        if u.name != USE_WAIT:
            continue
        key = str(u.args.get("key"))
        after, last[key] = last.get(key, -math.inf), u.end
        mine = [f for f in rt.spans if f.name == FETCH and str(f.args["key"]) == key
                and f.args["steps"]]
        ahead = [f for f in mine if after <= f.start < u.start]
        inside = [f for f in mine if u.start <= f.start <= u.end]
        if ahead:
            out.append("in time" if ahead[-1].end <= u.start else "late")
        else:
            out.append("on demand" if inside else "resident")
    return out


@settings(max_examples=300, deadline=None)
@given(steps(), st.lists(T, max_size=10))
def test_step_index_names_every_step_holding_a_time(ss, times):
    index = StepIndex(ss)
    for t in times:
        assert sorted(index.holding(t)) == [i for i, s in enumerate(ss) if s.holds(t)]


@settings(max_examples=300, deadline=None)
@given(rank(), steps())
def test_per_step_figures_match_their_definitions(rt, ss):
    for got, s in zip(exposed_times(rt, ss), ss):
        want = _exposed(rt, s)
        assert math.isclose(got["comm"], want["comm"], abs_tol=1e-9), s
        assert math.isclose(got["io"], want["io"], abs_tol=1e-9), s
    for got, s in zip(bytes_moved_per_step(rt, ss), ss):
        assert got == _moved(rt, s), s


@settings(max_examples=300, deadline=None)
@given(rank())
def test_prefetch_outcomes_match_the_note(rt):
    assert [u.outcome for u in prefetch_outcomes(rt)] == _outcomes(rt)
