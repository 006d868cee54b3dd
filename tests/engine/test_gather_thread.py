"""comm.gather_thread: all-gathers issued from one communication thread over their own
process group, two ranks (gloo). The training is the same as without it, bit for bit,
with the same all-gathers, parameters in host memory and on NVMe (a rank that issued
them in another order would hang or gather the wrong shards)."""

import pytest
import torch

from .ranks import gloo_group, spawn
from .traced import train_traced

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, init_file: str, out: str, cfgs: dict) -> None:
    with gloo_group(rank, world, init_file):
        results = {}
        for name, cfg in cfgs.items():
            sd, rt = train_traced(cfg, rank, world, 4)
            results[name] = {"sd": sd, "spans": [(s.name, s.cat) for s in rt.spans]}
        if rank == 0:
            torch.save(results, out)


@pytest.mark.parametrize("placement", [pytest.param("host", marks=pytest.mark.slow), "nvme"])
def test_gather_thread_trains_the_same(tmp_path, engine_cfg, placement):
    cfgs = {}
    for on in (False, True):
        cfg = engine_cfg(placement, "host", "host", group_size=1500, check_rank_order=False)
        cfg["io"]["paths"] = [str(tmp_path / f"swap-{on}")]
        cfg["comm"] = {"gather_thread": on}
        cfgs[on] = cfg
    out = str(tmp_path / "out.pt")
    spawn(_worker, str(tmp_path / "init"), out, cfgs)
    got = torch.load(out)
    for k, v in got[False]["sd"].items():
        assert torch.equal(got[True]["sd"][k], v), k
    gathers = {on: sum(name == "all-gather" for name, *_ in r["spans"]) for on, r in got.items()}
    assert gathers[True] == gathers[False] > 0, gathers


def test_a_queued_gather_whose_shard_fails_gives_its_pin_back():
    """A gather the thread issues for a shard whose fetch fails raises that error at the
    wait, after `on_error` (which unpins the fetch) ran on the waiting thread; one
    waited on at once raises to the caller, which unpins itself."""
    from offload.comm import Collectives
    from offload.comm.gather_thread import GatherIssuer

    issuer = GatherIssuer(Collectives(), Collectives())
    unpinned = []

    def shard() -> torch.Tensor:
        raise OSError("the shard's read failed")
    try:
        pending = issuer.all_gather(torch.empty(4), shard, async_op=True,
                                    on_error=lambda: unpinned.append("async"))
        with pytest.raises(OSError, match="read failed"):
            pending.wait()
        assert unpinned == ["async"]
        with pytest.raises(OSError, match="read failed"):
            issuer.all_gather(torch.empty(4), shard, async_op=False,
                              on_error=lambda: unpinned.append("sync"))
        assert unpinned == ["async"]
        full = torch.empty(4)
        issuer.all_gather(full, lambda: torch.arange(4.0), async_op=True,
                          on_error=lambda: unpinned.append("ok")).wait()
        assert torch.equal(full, torch.arange(4.0)) and unpinned == ["async"]
    finally:
        issuer.close()
