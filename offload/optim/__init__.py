"""CPU Adam / AdamW over flat fp32 partitions, with state on the host or streamed from NVMe.

`CpuAdam` is the entry point; `AdamKernel` is the chunked update on torch's
kernels (the fused CPU kernel, or `torch._foreach_*` math where it is absent),
`native.NativeAdam` the native one-pass kernel (adam_native.c) where it is built; `SwapPipeline`
streams NVMe-resident state through a fixed ring of pool buffers. See the notes
in optimizer.py (early reads and updates, schedules), state.py (NVMe layout,
commit after the writes) and pipeline.py (slot reuse).
"""

from .adam import AdamHyper, AdamKernel, GradScaling, fused_status, grad_sq_sum, resolve_scaling
from .optimizer import CpuAdam, StepResult, resolve_chunk_elems
from .pipeline import OptimStepError, SwapPipeline
from .state import ChunkLayout, PartitionState, Tier, state_bytes

__all__ = [
    "AdamHyper", "AdamKernel", "ChunkLayout", "CpuAdam", "GradScaling", "OptimStepError",
    "PartitionState", "StepResult", "SwapPipeline", "Tier", "fused_status", "grad_sq_sum",
    "resolve_chunk_elems", "resolve_scaling", "state_bytes",
]
