"""Gathered weights on a CPU device reuse freed memory (see [Note: warm gather memory])."""

import pytest
import torch

from offload.engine.warm import Borrowing, WarmMemory

SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


@pytest.mark.skipif(not SWAP, reason=f"torch {torch.__version__} has no "
                    "UntypedStorage._swap_data_ptr_: gathers allocate afresh")
def test_freed_gather_memory_is_reused_and_bounded():
    warm = WarmMemory(torch.device("cpu"), limit=3 << 20, largest=1 << 20)
    assert warm.enabled
    flat = torch.empty(1 << 18)  # 1 MiB of fp32, storage emptied as the engine does
    flat.untyped_storage().resize_(0)
    warm.fill(flat.untyped_storage(), flat.numel() * 4)
    first = flat.data_ptr()
    view = flat[10:20]  # kept across the free, as autograd's saved views are
    flat.fill_(1.0)
    warm.drain(flat.untyped_storage())
    # [Note: freed gathers read zeros]: the storage keeps its size, over zero pages
    assert flat.untyped_storage().nbytes() == flat.numel() * 4 and flat.data_ptr() != first
    assert view.sum().item() == 0.0
    warm.fill(flat.untyped_storage(), flat.numel() * 4)
    assert flat.data_ptr() == first  # the kept buffer came back, no new allocation
    flat.fill_(2.0)
    assert view.sum().item() == 20.0  # the saved view sees the refilled storage
    warm.drain(flat.untyped_storage())
    # a request more than twice smaller does not take a big buffer; the limit drops the oldest
    small = torch.empty(1 << 10)
    small.untyped_storage().resize_(0)
    warm.fill(small.untyped_storage(), 4096)
    assert small.data_ptr() != first
    others = [torch.empty(1 << 18) for _ in range(3)]
    for t in others:
        t.untyped_storage().resize_(0)
        warm.fill(t.untyped_storage(), 1 << 20)
    for t in others:
        warm.drain(t.untyped_storage())
    assert sum(b.nbytes() for b in warm._free) <= 3 << 20
    warm.clear()
    assert warm._free == []


@pytest.mark.skipif(not SWAP, reason=f"torch {torch.__version__} has no "
                    "UntypedStorage._swap_data_ptr_: gathers allocate afresh")
def test_the_limit_counts_gathered_and_kept_storage_together():
    warm = WarmMemory(torch.device("cpu"), limit=2 << 20, largest=1 << 20)
    flats = [torch.empty(1 << 18) for _ in range(3)]  # 1 MiB each
    for t in flats:
        t.untyped_storage().resize_(0)
        warm.fill(t.untyped_storage(), 1 << 20)
    kept = []
    for t in flats:
        warm.drain(t.untyped_storage())
        kept.append(sum(b.nbytes() for b in warm._free))
    assert kept == [0, 1 << 20, 2 << 20]  # 2 MiB gathered: none kept; then room for more


@pytest.mark.skipif(not SWAP, reason=f"torch {torch.__version__} has no "
                    "UntypedStorage._swap_data_ptr_: gathers allocate afresh")
def test_storage_handed_to_a_kept_tensor_stops_counting():
    """A gathered buffer disowned to a tensor the model kept is no longer the warm
    memory's: a later gather of the whole limit is kept when freed."""
    warm = WarmMemory(torch.device("cpu"), limit=1 << 20, largest=1 << 20)
    kept, flat = torch.empty(1 << 18), torch.empty(1 << 18)
    for t in (kept, flat):
        t.untyped_storage().resize_(0)
    warm.fill(kept.untyped_storage(), 1 << 20)
    warm.disown(1 << 20)
    warm.fill(flat.untyped_storage(), 1 << 20)
    warm.drain(flat.untyped_storage())
    assert sum(b.nbytes() for b in warm._free) == 1 << 20


@pytest.mark.skipif(not SWAP, reason=f"torch {torch.__version__} has no "
                    "UntypedStorage._swap_data_ptr_: no borrowing")
def test_borrowing_counts_what_is_borrowed_and_at_most_three_units():
    """[Note: gathered weights borrow the record]: pinned records that leave no room for
    prefetches and evictions are bounded by the spare budget, and by three units."""
    cpu = torch.device("cpu")
    assert Borrowing(cpu, True, spare=10 * 100, unit=100).room == 300
    b = Borrowing(cpu, True, spare=250, unit=100)
    assert b.room == 200
    assert b.take(100) and b.take(100) and not b.take(100)
    assert b.held == 200
    b.give(100)
    assert b.take(50)
    assert Borrowing(cpu, False, spare=1000, unit=100).room == 0  # several ranks: none
    assert Borrowing(cpu, True, spare=99, unit=100).room == 0


def test_cuda_device_resizes_instead():
    warm = WarmMemory(torch.device("cuda"), limit=1 << 20, largest=1 << 20)
    assert not warm.enabled


@pytest.mark.skipif(SWAP, reason="this torch swaps storage data pointers")
def test_without_the_swap_gathers_resize():
    warm = WarmMemory(torch.device("cpu"), limit=1 << 20, largest=4096)
    assert not warm.enabled
    flat = torch.empty(1024)
    flat.untyped_storage().resize_(0)
    warm.fill(flat.untyped_storage(), 4096)
    assert flat.untyped_storage().nbytes() == 4096
    warm.drain(flat.untyped_storage())
    assert flat.untyped_storage().nbytes() == 0
