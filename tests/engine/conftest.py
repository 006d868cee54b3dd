import subprocess

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


@pytest.fixture
def small_fs(tmp_path):
    """make(size_mib) -> a directory on a fresh ext4 file system of that size, loop
    mounted (unmounted after the test); skips where mounting is not allowed."""
    mounts = []

    def make(size_mib: int) -> str:
        image, mnt = tmp_path / f"fs{len(mounts)}.ext4", tmp_path / f"mnt{len(mounts)}"
        mnt.mkdir()
        subprocess.run(["truncate", "-s", f"{size_mib}M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
        r = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot loop-mount an ext4 image here: {r.stderr.strip()}")
        mounts.append(mnt)
        return str(mnt)
    yield make
    for mnt in mounts:
        subprocess.run(["umount", str(mnt)], check=False)
