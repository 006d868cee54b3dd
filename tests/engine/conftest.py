import pytest

from ..conftest import loop_mount, unmount


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


@pytest.fixture
def small_fs(tmp_path):
    """make(size_mib) -> a directory on a fresh ext4 file system of that size, loop
    mounted (unmounted after the test); skips where mounting is not allowed."""
    mounts = []

    def make(size_mib: int) -> str:
        mounts.append(loop_mount(tmp_path, f"mnt{len(mounts)}", size_mib))
        return str(mounts[-1])
    yield make
    for mnt in mounts:
        unmount(mnt)
