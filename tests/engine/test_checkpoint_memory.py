"""A save streams: optimizer state on NVMe is never held whole in memory."""

import importlib

import pytest
import torch
from torch import nn

import offload
from offload.cli.benchutil import reset_hwm, vm_hwm


class Stack(nn.Module):
    def __init__(self, dim: int = 1024, layers: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_save_of_nvme_state_stays_within_budgets(tmp_path, engine_cfg):
    """25M parameters: 302 MiB of master weights and moments on NVMe (streamed in
    chunks of 4096 elements), 50 MiB of bf16 parameters on NVMe; the save's peak RSS
    grows by less than a third of the state (a few zarr chunks per kind in flight,
    tensorstore's threads)."""
    cfg = engine_cfg("nvme", "nvme", "nvme", dtype="bf16", group_size=1 << 20)
    cfg["store"].update(host_budget="16MiB", device_budget="8MiB")
    with offload.initialize(Stack(), cfg) as e:
        x = torch.randn(4, 1024, dtype=torch.bfloat16)
        e.backward(e(x).square().mean())
        e.step()
        importlib.import_module("tensorstore")  # its own memory is not the save's
        if not reset_hwm():
            pytest.skip("this kernel does not let a process reset its peak RSS")
        before = vm_hwm()
        e.save_checkpoint(tmp_path / "ck")
        grown = vm_hwm() - before
    state = 24 * 1024 * 1024 * 12  # master + moments, fp32
    assert grown < state / 3, f"the save grew peak RSS by {grown / 2**20:.0f} MiB"
