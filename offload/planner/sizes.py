"""Bytes of optimizer state as the optimizer lays it out, and its chunk size: pure
arithmetic the planner sizes records with and the optimizer (a layer above)
builds its layout from, so the two never disagree.

The forms of Adam's moments ([Note: compressed moments] in offload/optim/codec.py):
fp32, bf16, and int8 codes with one fp32 scale per block of `QBLOCK` elements.
A chunk of NVMe state holds `[master | exp_avg | exp_avg_sq]`, the master
absent where the fp32 parameter is the master ([Note: NVMe layout] in
offload/optim/state.py).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["MAX_AUTO_CHUNK", "QBLOCK", "STATE_DTYPES", "StateDtype", "auto_chunk_elems",
           "keeps_master", "moment_bytes", "nvme_state_bytes", "state_bytes",
           "state_elem_bytes"]

StateDtype = Literal["fp32", "bf16", "int8"]
STATE_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = 256  # elements per int8 scale
MAX_AUTO_CHUNK = 1 << 23  # elements: 96 MiB per buffer; larger only lengthens fill and drain
MIN_CHUNK = 4096


def keeps_master(dtype: str, params: str, device: str) -> bool:
    """Whether the optimizer keeps an fp32 master apart from the parameter partition:
    in bf16/fp16 training, and in fp32 training where the parameters live in the
    device tier of a GPU (the CPU optimizer cannot update them there). Otherwise the
    fp32 parameter partition is the master (the engine's `master_is_param`).
    `dtype`: engine.dtype; `params`: engine.params; `device`: "cpu" or "cuda"."""
    return dtype != "fp32" or (params == "device" and device != "cpu")


def moment_bytes(state_dtype: StateDtype, n: int) -> int:
    """Bytes of both moments of `n` elements, as laid out in a chunk (codes, a pad to
    4 bytes, then the scales)."""
    if state_dtype == "fp32":
        return 8 * n
    if state_dtype == "bf16":
        return 4 * n
    if state_dtype == "int8":
        return -(-2 * n // 4) * 4 + 8 * -(-n // QBLOCK)
    raise ValueError(f"state_dtype {state_dtype!r} is not one of {STATE_DTYPES}")


def state_bytes(n: int, kinds: int = 3, state_dtype: StateDtype = "fp32") -> int:
    """Bytes of `n` elements' optimizer state as laid out in a chunk: the fp32 master
    (`kinds` 3; 2 without it) and both moments in `state_dtype` form."""
    if kinds not in (2, 3):
        raise ValueError(f"state_bytes: kinds is the number of tensors a partition's state "
                         f"holds, 3 (master and both moments) or 2 (the moments), got "
                         f"{kinds!r}")
    return (4 * n if kinds == 3 else 0) + moment_bytes(state_dtype, n)


def nvme_state_bytes(n: int, master: bool, state_dtype: StateDtype, chunk_elems: int) -> int:
    """Bytes of `n` elements' optimizer state on NVMe: one swap extent per chunk of
    `chunk_elems` elements, its master (where `master`) and moments back to back
    (`state_bytes`), rounded up to 4 KiB. With int8 moments a chunk's scales leave
    it off the 4 KiB grid: each chunk pads, not the partition once."""
    kinds = 3 if master else 2
    full, rest = divmod(n, chunk_elems)
    return full * _pages(state_bytes(chunk_elems, kinds, state_dtype)) + (
        _pages(state_bytes(rest, kinds, state_dtype)) if rest else 0)


def _pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def state_elem_bytes(master: bool, state_dtype: StateDtype) -> float:
    """Bytes per element of a long chunk of optimizer state (with or without its
    master)."""
    n = 1 << 20
    return state_bytes(n, 3 if master else 2, state_dtype) / n


def auto_chunk_elems(buffer_budget: int, buffers: int, share: float = 0.5,
                     state_dtype: StateDtype = "fp32", master: bool = True) -> int:
    """Elements per NVMe chunk when `optim.chunk_elems` is 0: the largest power of two
    such that `buffers` chunk buffers (sized for a chunk with its master, or
    without where `master` is False: fp32 training, the parameter is the master)
    take at most `share` of `buffer_budget`, at most `MAX_AUTO_CHUNK`; 0 when that
    leaves fewer than 4096 elements."""
    if buffers < 1:
        raise ValueError(f"buffers must be at least 1 (optim.buffers), got {buffers}")
    per = int(buffer_budget * share / (buffers * state_elem_bytes(master, state_dtype)))
    return 0 if per < MIN_CHUNK else min(MAX_AUTO_CHUNK, 1 << (per.bit_length() - 1))
