"""The access trace's edges (offload/planner/access.py)."""

from offload.planner import AccessTrace


def test_a_step_longer_than_its_plan_breaks_it_without_an_error():
    """A dynamic step that runs more uses than the one before (a route that adds a
    layer) leaves the plan: the engine falls back to on-demand fetches, no IndexError."""
    t = AccessTrace([0, 1])
    for gid in (0, 1, 2):
        t.record(gid)
    assert t.broken and not t.following and t.upcoming(2) == []
    assert t.finish() == [0, 1, 2] and t.plan == [0, 1, 2]


def test_a_shorter_step_is_counted_as_re_recorded():
    """A step that stops early (a prefix of the plan: never marked broken) still
    differs from the step before: its order is a new plan, counted in `rerecords`."""
    t = AccessTrace([0, 1, 2])
    for gid in (0, 1, 2):
        t.record(gid)
    t.finish()  # the static order: not a re-record
    assert t.rerecords == 0
    for gid in (0, 1):
        t.record(gid)
    assert not t.broken
    t.finish()
    assert t.rerecords == 1 and t.plan == [0, 1]


def test_a_group_the_plan_never_uses_is_needed_later_than_any_it_uses():
    """next_use of a group outside the plan is twice the step's length: later than any
    group the plan uses (at most one step away), so the store evicts it first."""
    t = AccessTrace([0, 1, 2])
    t.record(0)
    used = [t.next_use(g) for g in (0, 1, 2)]
    assert used == [3, 1, 2]
    assert t.next_use(7) == 6 and t.next_use(7) > max(used)
