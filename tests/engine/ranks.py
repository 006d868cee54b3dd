"""Running a test's worker on several ranks: processes spawned by torch.multiprocessing,
joined by a gloo (or NCCL) process group over a file in the test's directory."""

import contextlib
import multiprocessing
import os
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str,
                  backend: str = "gloo") -> Iterator[None]:
    """The worker's process group (nccl: on GPU `rank`), destroyed on every way out."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gloo_group(rank: int, world: int, init_file: str) -> contextlib.AbstractContextManager:
    """The worker's gloo process group, destroyed on every way out."""
    return process_group(rank, world, init_file)


# The ranks are forked from a server that has imported torch and offload once: a
# spawned rank spent about 1.5 s importing them, a forked one starts in 0.03 s. Each
# rank still is a fresh process, started with the test's environment (_entry); what
# is read from the environment at import (OMP_WAIT_POLICY, THP_MEM_ALLOC_ENABLE) is
# the server's, so a test that sets those starts its own interpreter.
multiprocessing.set_forkserver_preload(["offload", "torch", "torch.distributed"])


def _entry(rank: int, env: dict[str, str], worker: Callable, *args: object) -> None:
    """A rank's start: the environment of the test that spawned it (the server's is
    the one it was started with), then the worker."""
    os.environ.clear()
    os.environ.update(env)
    worker(rank, *args)


def spawn(worker: Callable, init_file: str, *args: object, world: int = 2,
          timeout_s: float = 300.0) -> None:
    """Runs worker(rank, world, init_file, *args) on `world` new processes; raises if
    one fails, or kills them and raises TimeoutError after `timeout_s` (a hang fails
    the test, not the suite's run: gloo's own timeout is 30 minutes)."""
    ctx = mp.start_processes(_entry, args=(dict(os.environ), worker, world, init_file, *args),
                             nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the {world} ranks did not finish within {timeout_s:g} s: "
                               "they hung")


def run_cases(cases: dict[str, Callable[[], object]], out: str) -> None:
    """Runs each case on this rank and saves {name: its result, or {"crash": repr}} to
    `out`: one case's crash fails its test only."""
    results: dict[str, object] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as e:  # noqa: BLE001
            results[name] = {"crash": repr(e)}
    torch.save(results, out)


def spawn_cases(worker: Callable, d: str, world: int = 2, args: tuple = ()) -> list:
    """Runs worker(rank, world, init_file, out, *args) on `world` processes (each calling
    `run_cases(..., f"{out}.{rank}")`) and returns each rank's results."""
    out = f"{d}/out"
    spawn(worker, f"{d}/init", out, *args, world=world)
    return [torch.load(f"{out}.{r}") for r in range(world)]
