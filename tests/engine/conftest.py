import pytest


@pytest.fixture
def engine_cfg(tmp_path):
    """A config with small budgets and swap files under tmp_path."""
    def make(params="device", grads="host", optimizer="host", dtype="fp32", **engine):
        return {
            "engine": {"params": params, "grads": grads, "optimizer": optimizer, "dtype": dtype,
                       "group_size": 3000, **engine},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
            "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                   "grow_step": "4MiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
        }
    return make
