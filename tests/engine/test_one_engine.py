"""One I/O engine per rank: the optimizer's NVMe state lives in a swap file of the store,
read and written through the store's engine, and goes away with the store; the
store opens only the swap files training uses, and one host buffer pool holds the
store's memory and the optimizer's buffers."""

import os

import offload

from .models import TiedTwice, lm_batches, lm_loss


def test_optimizer_state_goes_through_the_stores_swap_and_engine(tmp_path, engine_cfg):
    cfg = engine_cfg("nvme", "nvme", "nvme")
    swap_dir = cfg["io"]["paths"][0]
    with offload.initialize(TiedTwice(), cfg) as e:
        swap = e.optimizer.swap
        assert swap is e.store.swap_space("optim")
        assert swap.engine is e.store.io_engine
        pool = e.store.buffer_pool  # one pool: the optimizer's chunk buffers come from it
        assert e.optimizer._pipeline.pool is pool
        assert pool.budget == (64 + 64 + 32) << 20  # host + device (a CPU) + io.buffer_budget
        for x, y in lm_batches(2):
            e.backward(lm_loss(e(x), y))
            e.step()
        assert e.optimizer.partition(e.groups[0].gid).extents  # the state is on NVMe
        files = sorted(os.listdir(swap_dir))
        assert [f for f in files if f.endswith(".swap")] == [
            "offload-r0-grad.swap", "offload-r0-optim.swap", "offload-r0-param.swap"]
    assert not [f for f in os.listdir(swap_dir) if f.endswith(".swap")]  # removed at close


def test_one_tier_enum_and_optimizer_tiers():
    """The optimizer's homes are the store's tiers; the device is not one of them."""
    import pytest
    import torch

    from offload.optim import CpuAdam, Tier
    from offload.store import Tier as StoreTier
    assert Tier is StoreTier
    opt = CpuAdam()
    opt.add_partition("a", torch.zeros(8), tier="host")
    opt.add_partition("b", torch.zeros(8), tier=Tier.HOST)
    assert opt.partition("a").tier is opt.partition("b").tier is StoreTier.HOST
    with pytest.raises(ValueError, match="'host' or 'nvme'"):
        opt.add_partition("c", torch.zeros(8), tier="device")
    opt.close()


def test_optimizer_buffers_stay_within_io_buffer_budget_of_the_shared_pool(tmp_path):
    """The optimizer sizes its chunks from io.buffer_budget, not from the whole shared
    pool (which also holds the store's budgets): its buffers fit io.buffer_budget."""
    import torch
    from torch import nn

    from offload.config import OptimConfig
    from offload.optim import resolve_chunk_elems

    cfg = {"engine": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "24MiB"},
           "store": {"host_budget": "256MiB", "device_budget": "256MiB", "device": "cpu"}}
    for dtype, masters in (("fp32", False), ("bf16", True)):
        with offload.initialize(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)),
                                {**cfg, "engine": {**cfg["engine"], "dtype": dtype}}) as e:
            # fp32: the parameter is the master, chunk buffers hold the moments alone
            assert e.optimizer.chunk_elems == resolve_chunk_elems(OptimConfig(), 24 << 20,
                                                                  masters=masters)
            e.backward(e(torch.randn(4, 512, dtype=e.dtype)).float().square().mean())
            e.step()
            slots = e.optimizer._pipeline.slot_bytes * e.optimizer._pipeline.nbuf
            assert slots <= 24 << 20, slots
    # 24 MiB x 0.5 / 6 buffers: 8 B/element (moments only) gives 2**18, 12 B 2**17
    assert resolve_chunk_elems(OptimConfig(), 24 << 20, masters=False) == 1 << 18
    assert resolve_chunk_elems(OptimConfig(), 24 << 20) == 1 << 17


def test_the_nvme_budget_counts_the_optimizers_state(tmp_path, engine_cfg):
    """[Note: optimizer extents] in offload/store/store.py: the optimizer's extents are
    NVME bytes of the store (kind "optim"), the audit agrees; a store.nvme_budget that
    cannot hold a step's new version beside the old one is refused by initialize,
    naming the key and the bytes a step needs (it used to ask for one version, and the
    first step then failed); that figure trains, within the budget."""
    import re

    import pytest

    cfg = engine_cfg("host", "host", "nvme")
    batches = list(lm_batches(3))
    with offload.initialize(TiedTwice(), cfg) as e:
        x, y = batches[0]
        e.backward(lm_loss(e(x), y))
        e.step()
        held = e.store.stats().tiers["NVME"].by_kind.get("optim", 0)
        assert held > 0 and held == e.store.swap_space("optim").used_bytes
        e.store.audit()
    cfg = engine_cfg("host", "host", "nvme")
    cfg["store"]["nvme_budget"] = held + held // 2  # the state, not two versions of it
    with pytest.raises(offload.ConfigError, match="store.nvme_budget: .* during a step") as err:
        offload.initialize(TiedTwice(), cfg)
    need = int(re.search(r"raise it to at least (\d+) bytes", str(err.value)).group(1))
    assert need == 2 * held
    cfg["store"]["nvme_budget"] = need
    with offload.initialize(TiedTwice(), cfg) as e:
        for x, y in batches:
            e.backward(lm_loss(e(x), y))
            assert e.step()
            assert e.store.stats().tiers["NVME"].used <= need
        e.store.audit()
