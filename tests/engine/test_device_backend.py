"""Which backend carries the engine's tensors: NCCL's own calls only where NCCL
serves CUDA tensors and CUDA is here, whether the group was made with "nccl" or a
per-device config ("cpu:gloo,cuda:nccl")."""

import pytest
import torch.distributed as dist

from offload.comm.collectives import backend_for, device_backend


@pytest.mark.parametrize("backend, config, cuda, expected", [
    ("nccl", "cuda:nccl", True, "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True, "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", False, "gloo"),
    ("gloo", "cpu:gloo,cuda:gloo", True, "gloo"),
    ("gloo", "cpu:gloo,cuda:gloo", False, "gloo"),
    ("cpu:gloo", "cpu:gloo", True, "gloo"),
    ("mpi", "cpu:mpi,cuda:mpi", True, "mpi"),
])
def test_backend_for(backend, config, cuda, expected):
    assert backend_for(backend, config, cuda) == expected


def test_a_gloo_group_is_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}",
                            rank=0, world_size=1)
    try:
        assert device_backend() == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend, config, cuda, refused", [
    ("nccl", "cuda:nccl", False, True),   # CPU tensors would go to NCCL
    ("nccl", "cuda:nccl", True, False),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", False, False),
    ("gloo", "cpu:gloo,cuda:gloo", False, False),
])
def test_a_cpu_device_over_a_plain_nccl_group_is_refused(backend, config, cuda, refused):
    """store.device 'cpu' with a plain NCCL group: NCCL carries CUDA tensors only, and
    the first all-gather failed deep inside torch. initialize refuses it, naming the
    key and the groups that work."""
    from offload.config import ConfigError
    from offload.engine import _refuse_cpu_tensors_on_nccl

    if refused:
        with pytest.raises(ConfigError, match="store.device.*cpu:gloo,cuda:nccl"):
            _refuse_cpu_tensors_on_nccl(backend, config, cuda)
    else:
        _refuse_cpu_tensors_on_nccl(backend, config, cuda)
