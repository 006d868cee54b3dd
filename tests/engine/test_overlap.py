"""Collectives behind compute with two ranks (gloo), read from the event trace: a
gradient reduction stays in flight while the next unit's backward computes, and the
next unit's all-gather runs while the current unit's forward computes; with
`engine.reductions_in_flight = 0` and `engine.prefetch_depth = 0` neither happens."""

import pytest
import torch

from .ranks import gloo_group, spawn
from .traced import train_traced

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, init_file: str, out: str, cfg: dict) -> None:
    with gloo_group(rank, world, init_file):
        _, rt = train_traced(cfg, rank, world, 3)
        if rank == 0:
            torch.save([(s.name, s.cat, s.start, s.end) for s in rt.spans], out)


def _overlaps(spans, comm: str, phase: str) -> int:
    """Collectives `comm` in flight (from issue until a wait saw them done) while a unit's
    `phase` span ended: compute went on behind them. A collective waited for where it
    is issued (in a hook, before or after the unit's compute) has none."""
    comms = [(a, b) for name, cat, a, b in spans if cat == "comm" and name == comm]
    ends = [d for name, _cat, _c, d in spans if name.startswith(f"{phase}:")]
    return sum(any(a < d < b for d in ends) for a, b in comms)


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # 3 s
def test_collectives_run_behind_compute(tmp_path, engine_cfg, overlap):
    cfg = engine_cfg("host", "host", "host", group_size=1500, check_rank_order=False,
                     **({} if overlap else {"prefetch_depth": 0, "reductions_in_flight": 0}))
    out = str(tmp_path / "spans.pt")
    spawn(_worker, str(tmp_path / "init"), out, cfg)
    spans = torch.load(out)
    behind_backward = _overlaps(spans, "reduce-scatter", "backward")
    behind_forward = _overlaps(spans, "all-gather", "forward")
    if overlap:
        assert behind_backward >= 2 and behind_forward >= 2, (behind_backward, behind_forward)
    else:
        assert behind_backward == 0 and behind_forward == 0, (behind_backward, behind_forward)
