"""The engine on a CUDA device: same numerics as plain PyTorch on the same device."""

import copy

import pytest
import torch

import offload

from .models import TiedTwice, lm_batches, lm_loss

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("params,optimizer,dtype", [
    ("device", "host", "fp32"), ("nvme", "nvme", "fp32"), ("host", "host", "bf16")])
def test_cuda_matches_adamw(engine_cfg, params, optimizer, dtype):
    torch.manual_seed(0)
    ref = TiedTwice().cuda()
    model = copy.deepcopy(ref).cpu()
    cfg = engine_cfg(params, "host", optimizer, dtype=dtype)
    cfg["store"]["device"] = "cuda"
    engine = offload.initialize(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        assert engine.device.type == "cuda"
        for x, y in lm_batches(5):
            x, y = x.cuda(), y.cuda()
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            opt.step()
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            diff = (sd[k] - v.cpu()).abs()
            bound = 1e-5 if dtype == "fp32" else 5e-2
            assert diff.max() < bound, (k, diff.max())
    finally:
        engine.close()
