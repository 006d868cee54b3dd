"""The `store` section of the configuration: defaults, loading, and errors that name the key."""

from __future__ import annotations

import pytest

from offload.config import ConfigError, OffloadConfig, StoreConfig, load_config
from offload.store.copy import rank_gpu


def test_defaults_and_loading_sizes():
    assert OffloadConfig().store == StoreConfig()
    cfg = load_config({"store": {"device": "cpu", "device_budget": "64MiB",
                                 "host_budget": "1GiB", "nvme_budget": "2GiB"}})
    assert (cfg.store.device_budget, cfg.store.host_budget, cfg.store.nvme_budget) == \
        (64 << 20, 1 << 30, 2 << 30)


@pytest.mark.parametrize("section,key", [
    ({"device": "gpu"}, "store.device"),
    ({"device_budget": 100}, "store.device_budget"),
    ({"host_budget": "1k"}, "store.host_budget"),
    ({"nvme_budget": -1}, "store.nvme_budget"),
    ({"wait_timeout": 0}, "store.wait_timeout"),
    ({"swap_kinds": ["a/b"]}, "store.swap_kinds"),
    ({"policy": "mru"}, "store.policy"),
    ({"budget": 1}, "store.budget"),
])
def test_errors_name_the_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"store": section})


@pytest.mark.parametrize("local_rank,current,count,gpu", [
    ("3", 0, 8, 3),    # torchrun, nothing set the device yet: GPU LOCAL_RANK, not 0
    ("3", 5, 8, 5),    # the user's torch.cuda.set_device(5) stands
    ("3", 0, 1, 0),    # CUDA_VISIBLE_DEVICES gave the rank one GPU, seen as 0
    (None, 0, 8, 0),   # no launcher: the current device
    ("x", 0, 8, 0),
])
def test_a_cuda_device_without_an_index_is_the_ranks_gpu(local_rank, current, count, gpu):
    """[Note: a GPU per rank] store.device = 'cuda' under torchrun put every rank on
    GPU 0 (NCCL then finds two ranks on one GPU)."""
    assert rank_gpu(local_rank, current, count) == gpu
