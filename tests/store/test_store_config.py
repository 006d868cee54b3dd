"""The `store` section of the configuration: defaults, loading, and errors that name the key."""

from __future__ import annotations

import pytest

from offload.config import ConfigError, OffloadConfig, StoreConfig, load_config


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
