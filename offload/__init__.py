"""offload: train models whose training state is far larger than accelerator
memory, by keeping every ZeRO-3 partition in GPU memory, host memory or NVMe
and moving it there before it is needed.

    engine = offload.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

import os as _os
import sys as _sys

# Before torch's first CPU allocation, which reads it: [Note: huge pages] in
# offload/io/hugepages.py (offload.io itself is imported later, with the engine).
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# [Note: OpenMP's wait policy]
# After a parallel region, torch's OpenMP threads (libgomp) spin for a while
# waiting for the next one. Where the optimizer's updates run beside backward
# (optimizer state on NVMe: [Note: early update] in engine/updates.py) the
# spinning threads take the cores the updates need, and a thread of the
# backward's team preempted by an update keeps the rest of its team spinning at
# the region's barrier: the bench step (6 x Linear(4096, 4096), int8 moments,
# nvme-opt, 2 cores) spent 0.746 CPU s a step and took 0.433 s with the default
# policy, 0.636 CPU s and 0.382 s with OMP_WAIT_POLICY=PASSIVE, its none step
# 0.298 and 0.292 s (docs/benchmarks.md, bench step runs 9 and 10). libgomp reads
# the variable once, when `import torch` loads it, so `import offload` sets it
# where torch is not loaded yet and the environment does not name a policy;
# otherwise the engine says once how to set it (`omp_wait_policy`).
if "OMP_WAIT_POLICY" in _os.environ:
    _OMP_POLICY = _os.environ["OMP_WAIT_POLICY"]
elif "torch" in _sys.modules:
    _OMP_POLICY = ""  # libgomp's default (spinning), read when torch was imported
else:
    _os.environ["OMP_WAIT_POLICY"] = _OMP_POLICY = "PASSIVE"


def omp_wait_policy() -> str:
    """The OpenMP wait policy this process's torch runs with, as far as offload can
    tell: the `OMP_WAIT_POLICY` the environment named when offload was imported
    (offload sets PASSIVE where neither it nor torch was there yet), or "" when
    torch was imported first with none named (libgomp's default: threads spin
    between parallel regions). [Note: OpenMP's wait policy]"""
    return _OMP_POLICY


from .config import ConfigError, OffloadConfig, load_config  # noqa: E402

__version__ = "0.1.0"

_ENGINE = ("CheckpointCorruptError", "CheckpointError", "EngineBusyError", "OffloadEngine",
           "RankOrderError", "StepFailedError", "initialize")


def __getattr__(name: str):
    """The engine's names, imported on first use: `offload` itself, and the CLI with
    it, start without importing torch (`offload --help`, `offload view` and every
    refusal of a bad flag answer in a fraction of a second)."""
    if name in _ENGINE:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")

__all__ = ["CheckpointCorruptError", "CheckpointError", "ConfigError", "EngineBusyError",
           "OffloadConfig", "OffloadEngine", "RankOrderError", "StepFailedError", "initialize",
           "load_config", "omp_wait_policy", "__version__"]
