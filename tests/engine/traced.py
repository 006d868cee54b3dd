"""Training a small model on several ranks with the event trace on, for the tests that
read collectives' overlap and order from the trace."""

import torch

from offload.trace import TraceRecorder
from offload.trace.analysis import RankTrace, parse_trace
from offload.trace.chrome import to_chrome_trace

from .models import TiedTwice, lm_batches, lm_loss


def train_traced(cfg: dict, rank: int, world: int, steps: int) -> tuple[dict, RankTrace]:
    """Trains `TiedTwice` for `steps` steps, each rank on its share of the batch;
    (state dict, this rank's trace of the last step: steady state, the access trace
    exists). Every rank calls it."""
    import offload
    torch.manual_seed(0)
    rec = TraceRecorder(enabled=True, rank=rank)
    with offload.initialize(TiedTwice(), cfg, recorder=rec) as engine:
        for step, (x, y) in enumerate(lm_batches(steps, batch=8)):
            if step == steps - 1:
                rec.clear()
            engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
            engine.step()
        sd = engine.state_dict()
    (rt,) = parse_trace(to_chrome_trace(rec))
    return sd, rt
