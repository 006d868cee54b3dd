"""The DEVICE tier on a real CUDA device: stream-ordered H2D/D2H copies with events."""

from __future__ import annotations

import pytest
import torch

from offload.store import Residency, Tier, TieredStore

from .conftest import page_tensor, requires_cuda, store_config

pytestmark = [pytest.mark.gpu, requires_cuda]
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def test_cuda_device_tier_copies_on_streams(tmp_path):
    cfg = store_config(tmp_path / "swap", device="cuda", device_pages=2 * 64,
                       host_pages=3 * 64)
    with TieredStore(cfg) as s:
        assert s.device.type == "cuda" and s._pool.pinned
        refs = {k: page_tensor(k, 64, torch.bfloat16) for k in range(4)}  # 256 KiB each
        for k, r in refs.items():
            s.put(k, r, tier="NVME")
        s.wait_all()
        handles = {k: s.fetch(k, D) for k in (0, 1)}  # NVME -> HOST -> DEVICE
        for k, h in handles.items():
            view = h.wait()
            assert view.is_cuda and torch.equal(view.cpu(), refs[k])
            assert s.info(k).valid == {D, H, N}  # a copy, not a hand-over: HOST stays valid
        st = s.stats().moves["HOST->DEVICE"]
        assert st.copied_bytes == st.bytes == 2 * refs[0].numel() * 2
        with s.modify(0, D) as t:  # written on the current stream, read back on the D2H stream
            t.mul_(2)
        s.fetch(2, D).wait()  # DEVICE full: 1 (least recent, clean) is dropped
        assert s.info(1).valid == {H, N} and s.info(0).state is Residency.DEVICE
        s.fetch(3, D).wait()  # then 0 (dirty) is copied D2H before its DEVICE copy goes
        s.wait_all()
        assert s.info(0).state is Residency.HOST and s.info(0).valid == {H}
        assert torch.equal(s.fetch(0, H).wait(), refs[0] * 2)
        assert s.stats().moves["DEVICE->HOST"].copied_bytes > 0
        for k in (1, 2, 3):
            assert torch.equal(s.fetch(k, D).wait().cpu(), refs[k]), k
        s.audit()
        st = s.stats()
        assert st.tiers["DEVICE"].used <= st.tiers["DEVICE"].budget


def test_a_fetch_from_nvme_does_not_wait_for_compute_queued_during_its_read(tmp_path):
    """[Note: copy streams] A HOST->DEVICE copy waits for its buffer's allocation, at
    the fetch's start: compute queued while the NVMe read ran does not hold back the
    copy that follows it (it waited for the issuing thread's whole queue)."""
    cfg = store_config(tmp_path / "swap", device="cuda", device_pages=2 * 64,
                       host_pages=3 * 64)
    with TieredStore(cfg) as s:
        ref = page_tensor(0, 64, torch.bfloat16)
        s.put(0, ref, tier="NVME")
        s.wait_all()
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        handle = s.fetch(0, D)  # DEVICE memory taken now, the read in flight
        for _ in range(200):  # hundreds of milliseconds of queued matrix products
            a = torch.tanh(a @ a)
        queued = torch.cuda.Event()
        queued.record()
        view = handle.wait()
        assert not queued.query(), "the copy waited for the compute queued during the read"
        assert torch.equal(view.cpu(), ref)
