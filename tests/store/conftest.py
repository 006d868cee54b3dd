"""Helpers of the store tests: stores over real swap files under tmp_path."""

from __future__ import annotations

import pytest
import torch

from offload.config import IoConfig, OffloadConfig, StoreConfig
from offload.io import libaio_status
from offload.store import TieredStore
from offload.trace import NULL_RECORDER

PAGE = 4096
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ENGINES = ["aio", "threads"] if libaio_status()[0] else ["threads"]


def store_config(path, *, device_pages: int = 4, host_pages: int = 4, nvme_pages: int = 0,
                 engine: str = "auto", device: str = "cpu", **store_kw) -> OffloadConfig:
    """A config with budgets counted in 4 KiB pages and small swap growth steps."""
    io = IoConfig(paths=[str(path)], engine=engine, grow_step=1 << 20, stripe_size=1 << 20,
                  block_size=64 << 10, queue_depth=8, threads=2)
    store = StoreConfig(device=device, device_budget=device_pages * PAGE,
                        host_budget=host_pages * PAGE, nvme_budget=nvme_pages * PAGE,
                        wait_timeout=store_kw.pop("wait_timeout", 30.0),
                        swap_kinds=["param"], **store_kw)
    return OffloadConfig(io=io, store=store)


@pytest.fixture
def make_store(tmp_path):
    """make_store(policy=..., recorder=..., **store_config kwargs) -> an open TieredStore,
    closed after the test."""
    stores = []

    def make(*, policy=None, recorder=NULL_RECORDER, **kw) -> TieredStore:
        s = TieredStore(store_config(tmp_path / "swap", **kw), policy=policy, recorder=recorder)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def page_tensor(seed: int, pages: float = 1, dtype=torch.float32) -> torch.Tensor:
    """A tensor of about `pages` 4 KiB pages whose values depend on `seed`."""
    numel = int(pages * PAGE) // dtype.itemsize
    return (torch.arange(numel, dtype=torch.float64) * 0.5 + seed * 1000).to(dtype)
