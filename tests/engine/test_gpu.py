"""The engine on a CUDA device: same numerics as plain PyTorch on the same device."""

import copy

import pytest
import torch
from torch import nn

import offload

from .models import TiedTwice, lm_batches, lm_loss

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("params,grads,optimizer,dtype", [
    ("device", "host", "host", "fp32"), ("nvme", "host", "nvme", "fp32"),
    ("host", "host", "host", "bf16"), ("device", "device", "nvme", "fp32")])
def test_cuda_matches_adamw(engine_cfg, params, grads, optimizer, dtype):
    torch.manual_seed(0)
    ref = TiedTwice().cuda()
    model = copy.deepcopy(ref).cpu()
    cfg = engine_cfg(params, grads, optimizer, dtype=dtype)
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


@pytest.mark.parametrize("evaluate", [False, True])
def test_cuda_device_budget_below_the_parameters(engine_cfg, evaluate):
    """Eight 257 KiB partitions under a 1 MiB DEVICE budget: each step copies them
    up from host memory and the updated ones back down (D2H on its stream), and the
    numbers stay torch's. `evaluate`: an inference-mode forward before each step
    fetches the partitions into DEVICE memory allocated inside inference mode, which
    the steps then update in place."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    cfg = engine_cfg("device", "host", "host", group_size=256 * 257)
    cfg["store"].update(device="cuda", device_budget="1MiB")
    engine = offload.initialize(copy.deepcopy(ref).cpu(), cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(4):
            x = torch.randn(8, 256, generator=g).cuda()
            if evaluate:
                with torch.inference_mode():
                    engine(x)
            engine.backward(engine(x).square().mean())
            engine.step()
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
        moves = engine.store.stats().moves
        assert moves["HOST->DEVICE"].bytes > 0 and moves["DEVICE->HOST"].bytes > 0, moves
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            assert (sd[k] - v.cpu()).abs().max() < 1e-4, k
    finally:
        engine.close()
