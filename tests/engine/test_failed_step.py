"""A disk that fails mid-step: the engine raises, and every group's weights agree
with its optimizer state again (old weights with old state, new with new)."""

import copy
import os

import pytest
import torch

import offload
from offload.optim import OptimStepError
from offload.store import Tier

from .models import TiedTwice, lm_batches, lm_loss


def test_failed_optimizer_writes_leave_weights_matching_their_master(engine_cfg):
    torch.manual_seed(0)
    model = copy.deepcopy(TiedTwice())
    batches = lm_batches(3)
    engine = offload.initialize(model, engine_cfg("host", "host", "nvme", dtype="bf16"))
    opt = engine.optimizer
    swap_file = opt._pipeline.swap._files[0]
    good_fd = swap_file.fd
    try:
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        # from the 3rd chunk update of the next step on, every optimizer write fails
        # for real (EBADF): the swap file's descriptor is swapped for a read-only one
        calls = {"n": 0}
        inner = opt.kernel.update

        def update(*a, **kw):
            inner(*a, **kw)
            calls["n"] += 1
            if calls["n"] == 3:
                swap_file.fd = os.open(swap_file.path, os.O_RDONLY | os.O_DIRECT)
        opt.kernel.update = update
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(OptimStepError) as err:
            engine.step()
        assert err.value.unchanged
        opt.kernel.update = inner
        os.close(swap_file.fd)
        swap_file.fd = good_fd
        for g in engine.groups:
            if not g.requires_grad:
                continue
            master = torch.empty(g.shard, dtype=torch.bfloat16)
            opt.read_master(g.gid, master)
            weights = engine.store.fetch(("p", g.gid), to=Tier.HOST).wait()
            assert torch.equal(weights.cpu(), master), g.gid
        # the disk works again: training goes on
        x, y = batches[2]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    finally:
        engine.close()
