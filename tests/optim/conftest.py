"""Fixtures of the optimizer tests: a swap space on tmp_path (ext4, O_DIRECT) and a pool."""

import numpy as np
import pytest
import torch

from offload.config import OptimConfig
from offload.io import BufferPool, SwapSpace
from offload.optim import CpuAdam


@pytest.fixture
def pool():
    p = BufferPool(64 << 20)
    yield p
    p.close(force=True)


@pytest.fixture
def swap(engine, tmp_path):
    sw = SwapSpace([str(tmp_path / "swap")], "rank0-optim", engine, stripe_size=64 << 10,
                   grow_step=1 << 20)
    yield sw
    sw.close()


def random_numels(seed: int, count: int, chunk: int) -> list[int]:
    """Partition sizes around the chunk size, most of them with a tail."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(1, 4 * chunk)) for _ in range(count)] + [chunk, 2 * chunk + 1]


def make_opt(cfg: OptimConfig, masters: dict, tier: str = "host", swap=None, pool=None,
             **kw) -> CpuAdam:
    opt = CpuAdam(cfg, swap=swap, pool=pool, **kw)
    for pid, m in masters.items():
        opt.add_partition(pid, m.clone(), tier=tier)
    return opt


def grads_for(numels: dict, seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {pid: torch.randn(n, generator=g) * scale for pid, n in numels.items()}
