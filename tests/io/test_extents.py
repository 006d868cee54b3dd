"""ExtentAllocator: invariants under random alloc/free/grow, alignment, exhaustion, misuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload.io.extents import Extent, ExtentAllocator

ALIGN = 4096


def check_invariants(a: ExtentAllocator, expected: set[Extent] | None = None) -> None:
    allocated = list(a)
    free = a.free_extents()
    for e in allocated + free:
        assert e.offset % a.alignment == 0 and e.length % a.alignment == 0, e
        assert e.length > 0 and 0 <= e.offset and e.end <= a.capacity, (e, a.capacity)
    # Allocated and free ranges tile [0, capacity) exactly, without overlap.
    spans = sorted(allocated + free)
    pos = 0
    for e in spans:
        assert e.offset == pos, (spans, pos)
        pos = e.end
    assert pos == a.capacity
    assert a.used_bytes == sum(e.length for e in allocated)
    assert a.used_bytes + a.free_bytes == a.capacity
    assert a.free_bytes == sum(e.length for e in free)
    # Free list sorted and fully coalesced: no two free ranges touch.
    assert free == sorted(free)
    for f, g in zip(free, free[1:]):
        assert f.end < g.offset, (f, g)
    assert a.largest_free == max((f.length for f in free), default=0)
    assert len(a) == len(allocated)
    if expected is not None:
        assert set(allocated) == expected


def snapshot(a: ExtentAllocator):
    return list(a), a.free_extents(), a.capacity, a.used_bytes


class ExtentMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = ExtentAllocator(capacity=16 * ALIGN, alignment=ALIGN)
        self.live: set[Extent] = set()
        self.freed: list[Extent] = []

    @rule(nbytes=st.integers(min_value=1, max_value=12 * ALIGN))
    def alloc(self, nbytes: int) -> None:
        fits = -(-nbytes // ALIGN) * ALIGN <= self.a.largest_free
        before = snapshot(self.a)
        e = self.a.alloc(nbytes)
        if not fits:
            assert e is None
            assert snapshot(self.a) == before
            return
        assert e is not None and e.length == -(-nbytes // ALIGN) * ALIGN and e.length >= nbytes
        assert e.offset % ALIGN == 0
        for other in self.live:
            assert e.end <= other.offset or other.end <= e.offset, (e, other)
        self.live.add(e)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        e = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(e)
        self.live.remove(e)
        self.freed.append(e)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free(self, data) -> None:
        e = data.draw(st.sampled_from(self.freed))
        if e in self.live:  # the same range was handed out again: a legal free
            return
        before = snapshot(self.a)
        with pytest.raises(ValueError, match=f"offset={e.offset}"):
            self.a.free(e)
        assert snapshot(self.a) == before

    @rule(pages=st.integers(min_value=0, max_value=8))
    def grow(self, pages: int) -> None:
        self.a.grow(self.a.capacity + pages * ALIGN)

    @rule(nbytes=st.integers(min_value=1, max_value=40 * ALIGN))
    def grow_to_fit(self, nbytes: int) -> None:
        need = self.a.required_capacity(nbytes)
        if need > self.a.capacity:
            assert self.a.alloc(nbytes) is None
        self.a.grow(need)
        e = self.a.alloc(nbytes)
        assert e is not None
        self.live.add(e)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.a, self.live)


TestExtentMachine = ExtentMachine.TestCase
TestExtentMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 512)), max_size=80),
       st.sampled_from([512, 1024, 4096]))
@settings(deadline=None)
def test_random_sequences_other_alignments(ops, alignment):
    a = ExtentAllocator(capacity=0, alignment=alignment)
    live: list[Extent] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            e = a.alloc(n)
            if e is None:
                a.grow(a.required_capacity(n))
                e = a.alloc(n)
            assert e is not None and e.offset % alignment == 0 and e.length % alignment == 0
            live.append(e)
        else:
            a.free(live.pop(n % len(live)))
        check_invariants(a, set(live))
    for e in live:
        a.free(e)
    check_invariants(a, set())
    assert a.free_extents() == ([Extent(0, a.capacity)] if a.capacity else [])


def test_alignment_and_rounding():
    a = ExtentAllocator(capacity=64 * 1024, alignment=4096)
    e1 = a.alloc(1)
    e2 = a.alloc(4096)
    e3 = a.alloc(4097)
    assert e1 == Extent(0, 4096)
    assert e2 == Extent(4096, 4096)
    assert e3 == Extent(8192, 8192) and e3.end == 16384
    assert a.used_bytes == 16384 and a.free_bytes == 64 * 1024 - 16384


def test_free_coalesces_both_neighbours():
    a = ExtentAllocator(capacity=3 * ALIGN)
    x, y, z = a.alloc(ALIGN), a.alloc(ALIGN), a.alloc(ALIGN)
    a.free(x)
    a.free(z)
    assert a.free_extents() == [Extent(0, ALIGN), Extent(2 * ALIGN, ALIGN)]
    assert a.largest_free == ALIGN
    a.free(y)
    assert a.free_extents() == [Extent(0, 3 * ALIGN)]


def test_best_fit_prefers_smallest_hole():
    a = ExtentAllocator(capacity=10 * ALIGN)
    es = [a.alloc(n * ALIGN) for n in (3, 1, 1, 1, 2)]  # fills 8 pages
    a.free(es[0])  # 3-page hole at 0
    a.free(es[2])  # 1-page hole at 4 pages
    e = a.alloc(ALIGN)
    assert e == Extent(4 * ALIGN, ALIGN)
    check_invariants(a)


def test_exhaustion_returns_none_and_leaves_state():
    a = ExtentAllocator(capacity=4 * ALIGN)
    a.alloc(ALIGN)
    b = a.alloc(ALIGN)
    a.alloc(ALIGN)
    a.free(b)
    before = snapshot(a)
    assert a.alloc(2 * ALIGN) is None  # 2 free pages, but not contiguous
    assert snapshot(a) == before
    assert a.required_capacity(2 * ALIGN) == 5 * ALIGN  # the free tail page counts
    a.grow(5 * ALIGN)
    assert a.alloc(2 * ALIGN) == Extent(3 * ALIGN, 2 * ALIGN)
    check_invariants(a)


def test_grow_from_zero_and_coalesce_tail():
    a = ExtentAllocator()
    assert a.capacity == 0 and a.largest_free == 0 and a.alloc(1) is None
    a.grow(2 * ALIGN)
    a.grow(4 * ALIGN)
    assert a.free_extents() == [Extent(0, 4 * ALIGN)]


def test_misuse_raises_with_values():
    a = ExtentAllocator(capacity=4 * ALIGN)
    e = a.alloc(ALIGN)
    a.free(e)
    with pytest.raises(ValueError, match=r"offset=0, length=4096.*not allocated"):
        a.free(e)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(Extent(2 * ALIGN, ALIGN))
    f = a.alloc(2 * ALIGN)
    with pytest.raises(ValueError, match="has length 8192"):
        a.free(Extent(f.offset, ALIGN))
    with pytest.raises(ValueError, match="shrink"):
        a.grow(ALIGN)
    with pytest.raises(ValueError, match="multiple of the alignment"):
        a.grow(5 * ALIGN + 1)
    with pytest.raises(ValueError, match="positive"):
        a.alloc(0)
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(alignment=3000)
    assert f in a and Extent(f.offset, ALIGN) not in a
    check_invariants(a)
