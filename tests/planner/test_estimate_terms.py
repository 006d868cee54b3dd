"""The estimate's frozen groups, GPU host figures and NVMe totals
(offload/planner/estimate.py)."""

import torch

from offload.planner.estimate import ModelBytes, Placement, kind_bytes, tier_bytes


def test_frozen_groups_have_no_gradient_nor_optimizer_state():
    """A frozen layer (requires_grad False) has parameters but no gradient: the
    estimate's grad and moments count the trainable elements only, as plain PyTorch
    allocates them."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 64))
    model[0].requires_grad_(False)
    shards = tuple((sum(p.numel() for p in layer.parameters()), layer.weight.requires_grad)
                   for layer in model)
    out = model(torch.randn(2, 32)).sum()
    out.backward()
    grads = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    kinds = kind_bytes(ModelBytes(shards, "fp32"))
    assert grads == 32 * 64 * 4 + 64 * 4 and kinds["grad"] == 8192 + 4096  # 4 KiB rounded
    assert kinds["exp_avg"] == kinds["grad"]
    assert kinds["param"] == 8192 + 12288


def test_on_a_gpu_host_adds_up_its_terms_and_the_prefetch_reads():
    """On a GPU the host's copies are distinct: the stored gradients plus the reads in
    flight (largest partition times the look-ahead), not the largest of them."""
    m = ModelBytes(((1024, True), (1024, True)), "fp32")  # 4 KiB per partition
    p = Placement("nvme", "host", "host")
    assert tier_bytes(m, p, device="cpu").store["host"] == 8192
    for depth, want in ((1, 8192 + 4096), (3, 8192 + 3 * 4096)):
        assert tier_bytes(m, p, device="cuda", prefetch_depth=depth).store["host"] == want


def test_the_nvme_total_counts_the_optimizer_state_once():
    """The NVMe ledger already counts the state (twice while a step is open); the
    total does not add the optimizer's figure again."""
    m = ModelBytes(((1024, True),), "fp32")
    tb = tier_bytes(m, Placement("host", "host", "nvme"), clipping=True)
    assert tb.optimizer["nvme"] > 0
    assert tb.total["nvme"] == tb.store["nvme"] == 2 * tb.optimizer["nvme"]
