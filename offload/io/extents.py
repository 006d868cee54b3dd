"""Byte-range allocation inside one growable address space (a swap file).

`ExtentAllocator` hands out aligned, non-overlapping `Extent`s from a free list
and takes them back, merging neighbours. It knows nothing about files: when an
`alloc` does not fit it returns ``None``, the owner grows the file (to at least
`required_capacity(nbytes)` bytes), calls `grow`, and retries.

Not thread safe: the owner (one swap file) serialises calls under its own lock.
"""

from __future__ import annotations

import bisect
import operator
from typing import Iterator, NamedTuple


def positive_bytes(nbytes: object, what: str) -> int:
    """`nbytes` as an int, refused (ValueError naming `what`) unless it is a positive
    integer: a float or a bool passed further failed deep inside mmap or the engine,
    or was taken for 1 byte."""
    try:
        n = operator.index(nbytes) if not isinstance(nbytes, bool) else 0
    except TypeError:
        n = 0
    if n <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {nbytes!r}")
    return n


class Extent(NamedTuple):
    """A byte range ``[offset, offset + length)`` of the address space (bytes)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """First byte past the extent (bytes)."""
        return self.offset + self.length


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# [Note: extent free list]
# The free space is a set of maximal, disjoint, non-adjacent ranges, held three
# ways that are always updated together by `_add_free` / `_remove_free`:
#   _free          offset -> length
#   _free_offsets  sorted offsets, to find a range's neighbours by bisect
#   _free_by_size  sorted (length, offset), to find the best fit by bisect
# `alloc` takes the smallest free range that fits (lowest offset among equals)
# and carves from its start; `free` merges the returned range with a free range
# that ends where it starts and one that starts where it ends, so the list stays
# fully coalesced. Allocated extents are an exact-match table, so freeing
# anything that `alloc` did not return (or returning it twice) is caught.


class ExtentAllocator:
    """Aligned byte-range allocator over a growable space of `capacity` bytes.

    Args:
        capacity: initial size of the space (bytes); a multiple of `alignment`.
        alignment: every offset and length is a multiple of this (bytes, a power
            of two; 4096 suits O_DIRECT).

    Invariants (checked by the tests after every operation): allocated extents
    never overlap; ``used_bytes + free_bytes == capacity``; the free list is
    sorted and no two free ranges touch.
    """

    def __init__(self, capacity: int = 0, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        self._alignment = alignment
        self._check_capacity(capacity)
        self._capacity = 0
        self._used = 0
        self._allocated: dict[int, int] = {}
        self._free: dict[int, int] = {}
        self._free_offsets: list[int] = []
        self._free_by_size: list[tuple[int, int]] = []
        if capacity:
            self.grow(capacity)

    # -- queries ---------------------------------------------------------------

    @property
    def alignment(self) -> int:
        """Alignment of every offset and length (bytes)."""
        return self._alignment

    @property
    def capacity(self) -> int:
        """Size of the whole address space (bytes)."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (rounded lengths)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not in any allocated extent."""
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Length of the largest free range (bytes): the biggest `alloc` that succeeds now."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    def __iter__(self) -> Iterator[Extent]:
        """Allocated extents in offset order."""
        return iter([Extent(o, n) for o, n in sorted(self._allocated.items())])

    def __len__(self) -> int:
        """Number of allocated extents."""
        return len(self._allocated)

    def __contains__(self, extent: object) -> bool:
        return (isinstance(extent, tuple) and len(extent) == 2
                and self._allocated.get(extent[0]) == extent[1])

    def free_extents(self) -> list[Extent]:
        """Free ranges in offset order (maximal: no two touch)."""
        return [Extent(o, self._free[o]) for o in self._free_offsets]

    def required_capacity(self, nbytes: int) -> int:
        """Smallest capacity (bytes) at which `alloc(nbytes)` would succeed.

        Equals `capacity` when it already fits; otherwise counts a free range at
        the end of the space, which `grow` extends.
        """
        length = self._rounded(nbytes)
        if length <= self.largest_free:
            return self._capacity
        tail = 0
        if self._free_offsets:
            last = self._free_offsets[-1]
            if last + self._free[last] == self._capacity:
                tail = self._free[last]
        return self._capacity + length - tail

    def __repr__(self) -> str:
        return (f"ExtentAllocator(capacity={self._capacity}, used={self._used}, "
                f"extents={len(self._allocated)}, free_ranges={len(self._free)}, "
                f"largest_free={self.largest_free})")

    # -- operations --------------------------------------------------------------

    def alloc(self, nbytes: int) -> Extent | None:
        """Reserve `nbytes` bytes (rounded up to `alignment`).

        Returns the extent, or ``None`` when no free range is large enough; the
        allocator is then unchanged, so the caller can `grow` and retry.
        """
        length = self._rounded(nbytes)
        i = bisect.bisect_left(self._free_by_size, (length, -1))
        if i == len(self._free_by_size):
            return None
        free_len, offset = self._free_by_size[i]
        self._remove_free(offset)
        if free_len > length:
            self._add_free(offset + length, free_len - length)
        self._allocated[offset] = length
        self._used += length
        return Extent(offset, length)

    def free(self, extent: Extent) -> None:
        """Return an extent that `alloc` gave out; merges it with free neighbours.

        Raises:
            ValueError: `extent` is not currently allocated exactly as given
                (never allocated, already freed, or a different length).
        """
        offset, length = extent
        held = self._allocated.get(offset)
        if held is None:
            raise ValueError(
                f"free of extent (offset={offset}, length={length}) that is not allocated "
                f"(double free, or not from this allocator; capacity {self._capacity} bytes)")
        if held != length:
            raise ValueError(
                f"free of extent (offset={offset}, length={length}) but the extent allocated "
                f"at offset {offset} has length {held}")
        del self._allocated[offset]
        self._used -= length
        self._insert_coalesced(offset, length)

    def grow(self, new_capacity: int) -> None:
        """Extend the space to `new_capacity` bytes; the new tail becomes free.

        Raises:
            ValueError: `new_capacity` is smaller than `capacity` or not a
                multiple of `alignment`.
        """
        self._check_capacity(new_capacity)
        if new_capacity < self._capacity:
            raise ValueError(f"cannot shrink extent space from {self._capacity} to "
                             f"{new_capacity} bytes")
        if new_capacity == self._capacity:
            return
        old = self._capacity
        self._capacity = new_capacity
        self._insert_coalesced(old, new_capacity - old)

    # -- free-list internals (see [Note: extent free list]) -----------------------

    def _rounded(self, nbytes: int) -> int:
        return _round_up(positive_bytes(nbytes, "extent size"), self._alignment)

    def _check_capacity(self, capacity: int) -> None:
        if capacity < 0 or capacity % self._alignment:
            raise ValueError(f"capacity must be a non-negative multiple of the alignment "
                             f"({self._alignment} bytes), got {capacity}")

    def _insert_coalesced(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        if i > 0:
            prev = self._free_offsets[i - 1]
            prev_end = prev + self._free[prev]
            if prev_end > offset:
                raise RuntimeError(f"range [{offset}, {offset + length}) overlaps free range "
                                   f"[{prev}, {prev_end}); extent table is corrupt")
            if prev_end == offset:
                length += self._free[prev]
                offset = prev
                self._remove_free(prev)
                i -= 1
        if i < len(self._free_offsets):
            nxt = self._free_offsets[i]
            if nxt < offset + length:
                raise RuntimeError(f"range [{offset}, {offset + length}) overlaps free range "
                                   f"starting at {nxt}; extent table is corrupt")
            if nxt == offset + length:
                length += self._free[nxt]
                self._remove_free(nxt)
        self._add_free(offset, length)

    def _add_free(self, offset: int, length: int) -> None:
        self._free[offset] = length
        bisect.insort(self._free_offsets, offset)
        bisect.insort(self._free_by_size, (length, offset))

    def _remove_free(self, offset: int) -> None:
        length = self._free.pop(offset)
        del self._free_offsets[bisect.bisect_left(self._free_offsets, offset)]
        del self._free_by_size[bisect.bisect_left(self._free_by_size, (length, offset))]
