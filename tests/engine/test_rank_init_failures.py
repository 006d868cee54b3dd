"""A rank that fails at `initialize` while the others do not: every rank raises in
bounded time, the failing rank its own error, the others one naming it, and every
rank's swap files are removed ([Note: a rank that fails while placing] in
offload/engine/__init__.py). A disk with room for the state but not for the whole
stripes its swap files grow by is refused before anything is placed ([Note: swap
files grow by whole stripes] in working_set.py). Two gloo processes; rank 1 swaps to
a small ext4 of its own, rank 0 to the test's directory."""

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .disks import fill
from .ranks import spawn

pytestmark = pytest.mark.distributed

HANG_S = 60  # the ranks took longer: they hung, and the test fails instead of blocking
PG_TIMEOUT_S = 20  # a collective left waiting raises after this (gloo's default: 30 min)


class _Linear(nn.Linear):
    """nn.Linear whose initialiser raises on rank 1 once `fails` is set."""

    fails = False

    def reset_parameters(self) -> None:
        if self.fails and dist.get_rank() == 1:
            raise RuntimeError("this initialiser fails on rank 1")
        super().reset_parameters()


def _model() -> nn.Module:
    """Four groups of 16 512 parameters: about 72 KiB of optimizer state per group and
    rank (fp32, 2 ranks)."""
    torch.manual_seed(0)
    return nn.Sequential(*[_Linear(128, 128) for _ in range(4)])


def _failing_model() -> nn.Module:
    """Built under meta by initialize; the third layer's initialiser raises on rank 1."""
    model = nn.Sequential(*[_Linear(128, 128) for _ in range(4)])
    model[2].fails = True
    return model


def _cfg(swap: str, stripe: str) -> dict:
    return {"engine": {"params": "host", "grads": "host", "optimizer": "nvme", "dtype": "fp32",
                       "group_size": 20000},
            "optim": {"lr": 1e-2, "chunk_elems": 4096},
            "io": {"paths": [swap], "buffer_budget": "8MiB", "grow_step": stripe,
                   "stripe_size": stripe},
            "store": {"host_budget": "16MiB", "device_budget": "16MiB", "device": "cpu"}}


def _worker(rank: int, world: int, init_file: str, out: str, swaps: list, case: str) -> None:
    import offload
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    result: dict = {"error": None}
    try:
        t0 = time.monotonic()
        model, kw = _model, {}
        if case == "fills" and rank == 1:  # the disk fills once the first group is placed
            mnt = Path(swaps[rank]).parent
            kw["progress"] = lambda done, total: fill(mnt, 0) if done == 1 else None
        elif case == "initialiser":
            model = _failing_model
        try:
            offload.initialize(model if case == "initialiser" else model(),
                               _cfg(swaps[rank], "1MiB" if case == "stripe" else "64KiB"),
                               **kw).close()
        except Exception as e:
            result["error"] = (type(e).__name__, str(e))
        result["seconds"] = time.monotonic() - t0
        result["swap"] = sorted(os.listdir(swaps[rank])) if os.path.isdir(swaps[rank]) else []
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _run(tmp_path, small_fs, case: str, free: int | None = None) -> list[dict]:
    """Each rank's {"error": (type, message) or None, "seconds", "swap": files left};
    rank 1's disk left with about `free` bytes free."""
    mnt = Path(small_fs(4))
    if free is not None:
        fill(mnt, free // os.statvfs(mnt).f_frsize)
    swaps = [str(tmp_path / "swap0"), str(mnt / "swap")]
    out = str(tmp_path / "result")
    spawn(_worker, str(tmp_path / "init"), out, swaps, case, timeout_s=HANG_S)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _assert_named(results: list[dict], mine: str, *said: str) -> None:
    """Rank 1 raised `mine` saying `said`; rank 0 an error naming rank 1 and saying it
    too; both within a few seconds (not the process group's timeout), their swap
    directories empty."""
    (_, why0), (type1, why1) = results[0]["error"], results[1]["error"]
    assert type1 == mine, results[1]
    assert why0.startswith("initialize: rank 1 refused, so every rank stops"), why0
    assert why1 in why0, (why0, why1)
    for text in said:
        assert text in why1, why1
    for r in results:
        assert r["seconds"] < PG_TIMEOUT_S / 2, r
        assert r["swap"] == [], r


def test_a_disk_that_fills_on_one_rank_while_placing_stops_every_rank(tmp_path, small_fs):
    """Rank 1's disk fills after its first group (free space was checked; another
    process took it): its optimizer state's swap file cannot grow. Rank 1 raised
    SwapFullError while rank 0 waited in the next group's all-reduce for the process
    group's timeout (30 minutes by default); now both stop at that group."""
    results = _run(tmp_path, small_fs, "fills")
    _assert_named(results, "SwapFullError", "No space left on device", "offload-r1-optim.swap",
                  "free disk space")
    assert results[0]["error"][0] == "RuntimeError"


def test_an_initialiser_that_raises_on_one_rank_stops_every_rank(tmp_path, small_fs):
    """The third group's initialiser raises on rank 1 only, before that group's
    all-reduce: rank 0 waited in it, then failed with gloo's "Connection closed by
    peer", naming no rank and no cause."""
    results = _run(tmp_path, small_fs, "initialiser")
    _assert_named(results, "RuntimeError", "this initialiser fails on rank 1")


def test_a_disk_with_room_for_the_state_but_not_a_stripe_is_refused_up_front(tmp_path,
                                                                               small_fs):
    """320 KiB of optimizer state per rank, 640 KiB free on rank 1's disk: the state
    fits, but its swap file grows by whole stripes of io.stripe_size (1 MiB). The
    free-space check let it through and the first group failed on rank 1; now it is
    refused before any swap file is made, saying so."""
    results = _run(tmp_path, small_fs, "stripe", free=640 << 10)
    _assert_named(results, "SwapPathError", "swap files grow by whole stripes of "
                  "io.stripe_size, 1.0 MiB on each path, so this rank's 320.0 KiB of state "
                  "take 1.0 MiB here", "lower io.stripe_size")
    assert results[0]["error"][0] == "ConfigError"
