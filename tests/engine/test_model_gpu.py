"""The model after `initialize` on a CUDA device: registered parameters on the device, full
weights read and written, evaluation between steps."""

import copy

import pytest
import torch

import offload

from .models import TiedTwice, lm_batches, lm_loss

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("params,optimizer,dtype", [
    ("device", "host", "fp32"), ("nvme", "nvme", "fp32"), ("host", "host", "bf16")])
def test_cuda_full_weights_and_evaluation(engine_cfg, params, optimizer, dtype):
    torch.manual_seed(0)
    ref = TiedTwice()
    cfg = engine_cfg(params, "host", optimizer, dtype=dtype)
    cfg["store"]["device"] = "cuda"
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    try:
        assert all(p.device.type == "cuda" for p in engine.module.parameters())
        with engine.full_weights() as w:
            for n, q in ref.named_parameters():
                assert torch.equal(w[n].cpu(), q.detach()), n
        with engine.full_weights("l1", writable=True):
            engine.module.l1.weight.data.fill_(0.25)
        assert torch.all(engine.state_dict()["l1.weight"] == 0.25)
        with torch.no_grad():
            ref.l1.weight.fill_(0.25)
            x, y = (t.cuda() for t in lm_batches(1)[0])
            low = copy.deepcopy(ref).cuda().to(engine.dtype)
            torch.testing.assert_close(engine(x), low(x), atol=2e-2 if dtype == "bf16" else 1e-5,
                                       rtol=0)
        engine.backward(lm_loss(engine(x), y))
        assert engine.step()
    finally:
        engine.close()
