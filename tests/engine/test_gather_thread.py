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
