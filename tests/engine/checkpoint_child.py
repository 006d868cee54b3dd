"""A training process killed in the middle of a save (by tests/engine/test_checkpoint_atomic.py).

Usage: python -m tests.engine.checkpoint_child CONFIG_JSON ROOT PAUSE
Trains 2 steps, saves ROOT/step-2 and its expected state to ROOT/want.pt, trains one
more step and saves ROOT/step-3, pausing (printing PAUSED) at PAUSE: "write" after the
first group's chunks, "rename" just before the publishing rename.
"""

import json
import sys
import time
from pathlib import Path

import torch

import offload
import offload.engine.training_checkpoint as tc

from .models import TiedTwice, lm_batches, lm_loss


def _pause_after(fn):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        print("PAUSED", flush=True)
        time.sleep(600)
        return out
    return wrapped


def main() -> None:
    cfg, root, pause = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    engine = offload.initialize(TiedTwice(), cfg)
    batches = lm_batches(3)
    for x, y in batches[:2]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(root / "step-2")
    torch.save({"sd": engine.state_dict(),
                "opt": {g.gid: engine.optimizer.partition_state(g.gid)
                        for g in engine.groups if g.requires_grad}}, root / "want.pt")
    x, y = batches[2]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    if pause == "write":
        tc._GroupWriter.finish = _pause_after(tc._GroupWriter.finish)
    else:
        tc._fsync_tree = _pause_after(tc._fsync_tree)
    engine.save_checkpoint(root / "step-3")


if __name__ == "__main__":
    main()
