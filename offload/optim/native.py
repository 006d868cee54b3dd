"""The native fused Adam kernel (`adam_native.c`), loaded with ctypes.

[Note: native kernel]
One C call updates one cache block in one pass over memory: fp32 master,
fp32 gradient, moments in any `optim.state_dtype` form (decoded into fp32 tiles
of `codec.QBLOCK` elements in L1 and encoded back, with codec.py's codes bit
for bit; bf16 moments rounded stochastically as `codec.encode_stochastic`, and the
int8 codes of updated elements as `codec.encode` with `codec.int8_offsets`, from
the model-wide index of the block's first element and each run's update count),
the gradient divisor, weight decay, bias correction, and the
compute-dtype copy (bf16 / fp16, round to nearest even). The math follows the
operation order of torch's fused CPU Adam in fp32, so its results equal
`torch._fused_adamw_`'s to fp32 rounding (equal bit for bit where torch runs its
vector loop on every element; tested either way against both torch paths).

It is built, where a C compiler is present, by `pip install -e .` (setup.py,
an optional extension: without a compiler the install still succeeds). ctypes
releases the GIL for the call, so blocks.py's worker threads run it in
parallel; `NativeAdam.claimer` instead gives each thread one call over a whole
chunk, the threads claiming units of it from a counter inside C (no return to
Python, nor the GIL, between blocks). The C side trusts its arguments: `NativeAdam.block` checks every
tensor's dtype, size, device, contiguity and alignment, and the runs' bounds, before
calling, and raises instead. `OFFLOAD_NATIVE_ADAM=0` in the environment turns
it off (torch's kernels run instead, as where the library is absent).
`OFFLOAD_NATIVE_ISA=baseline` (or `avx2`) keeps the kernel off its AVX-512
loop (and the AVX2 stream), which every path must match bit for bit: tests
run each path on a host that has them all.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch

from .adam import AdamHyper
from .codec import QBLOCK, Moment, moment_bound, rounding_key

log = logging.getLogger(__name__)

__all__ = ["NativeAdam", "native_status", "ENV_SWITCH", "ISA_SWITCH", "ISAS"]

ENV_SWITCH = "OFFLOAD_NATIVE_ADAM"
ISA_SWITCH = "OFFLOAD_NATIVE_ISA"
ISAS = {"baseline": 0, "avx2": 1, "avx512": 2}  # adam_native.c make_args' `isa`
_LIB_STEM = "_adam_native"
_ABI = 5  # offload_adam_abi() of the C file this module calls
CLAIM_UNIT = 1 << 16  # elements per unit a thread claims in `NativeAdam.claimer` (64 tiles)
_TILE = 4 * QBLOCK  # adam_native.c's TILE
_STATE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_OUT = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_V_DTYPE = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.int8: torch.uint8}

# (first element, last element + 1, hyper-parameters or None to leave alone, update count
# before this one) in the coordinates of the block
BlockRun = tuple[int, int, "AdamHyper | None", int]


class _Run(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_int64), ("hi", ctypes.c_int64), ("skip", ctypes.c_int32),
                ("decoupled", ctypes.c_int32), ("weight_decay", ctypes.c_float),
                ("decay_mult", ctypes.c_float), ("lerp_w", ctypes.c_float),
                ("beta2", ctypes.c_float), ("beta2_c", ctypes.c_float),
                ("neg_step", ctypes.c_float), ("bias2_sqrt", ctypes.c_float),
                ("eps", ctypes.c_float), ("key", ctypes.c_uint32),
                ("m_bound", ctypes.c_float)]


_cache: dict[str, object] = {}


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / (_LIB_STEM + suffix)
        if p.is_file():
            return p
    return None


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    path = _library_path()
    if path is None:
        return None, (f"the native Adam kernel is not built (no {_LIB_STEM}*.so beside "
                      f"{Path(__file__).name}; `pip install -e .` builds it where gcc is present)")
    try:
        lib = ctypes.CDLL(str(path))
        ok = lib.offload_adam_abi() == _ABI
    except (OSError, AttributeError) as e:
        return None, f"the native Adam kernel {path.name} does not load ({e})"
    if not ok:
        return None, f"the native Adam kernel {path.name} is of another version; rebuild it"
    args = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.POINTER(_Run),
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    lib.offload_adam_block.restype = ctypes.c_int
    lib.offload_adam_block.argtypes = args
    lib.offload_adam_claim.restype = ctypes.c_int64
    lib.offload_adam_claim.argtypes = args + [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    return lib, f"native Adam kernel {path.name}"


def native_status() -> tuple[bool, str]:
    """(usable, why): whether the native kernel loads here (read once per process,
    and again when `OFFLOAD_NATIVE_ADAM` changes)."""
    key = os.environ.get(ENV_SWITCH, "1")
    if key not in ("0", "1"):  # "false", "off": read as on, the kernel kept silently
        from ..config import ConfigError
        raise ConfigError(f"{ENV_SWITCH}: {key!r} is not 0 or 1; give 0 to run torch's "
                          "kernels, or unset it (the native kernel runs where it loads)")
    if _cache.get("key") != key:
        _cache["lib"], _cache["why"] = _load()
        _cache["key"] = key
        if _cache["lib"] is None:
            log.info("%s: CPU Adam runs torch's kernels", _cache["why"])
    return _cache["lib"] is not None, str(_cache["why"])


def _coefficients(h: AdamHyper, step: int) -> tuple:
    """The kernel's per-run constants, computed in double and rounded to fp32 by
    ctypes, as torch's fused kernel derives them, and the run's key for bf16 and
    int8 moments ([Note: stochastic rounding] in codec.py)."""
    bias1 = 1.0 - h.beta1 ** step
    bias2 = 1.0 - h.beta2 ** step
    return (int(h.decoupled), h.weight_decay, 1.0 - h.lr * h.weight_decay, 1.0 - h.beta1,
            h.beta2, 1.0 - h.beta2, -(h.lr / bias1), math.sqrt(bias2), h.eps,
            rounding_key(step), moment_bound(h.beta1, h.beta2))


def _check(name: str, t: torch.Tensor, dtypes, n: int) -> None:
    # one test of the common case first: this runs for every block (several per
    # thread and chunk), while the kernel's own time is a few hundred microseconds
    if (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.is_cpu and t.is_contiguous()
            and t.numel() == n and not t.data_ptr() % t.element_size()):
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise ValueError(f"{name}: expected a tensor of {[str(d) for d in dtypes]}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"{name}: expected a contiguous CPU tensor of {n} elements, got "
                         f"{t.numel()} on {t.device} (contiguous: {t.is_contiguous()})")
    # the kernel's vector stores need each element at a multiple of its size (its
    # streaming stores fault otherwise); torch's allocations always are, a tensor
    # over a foreign buffer (torch.frombuffer with an odd offset) may not be
    raise ValueError(f"{name}: its address {t.data_ptr():#x} is not aligned to its "
                     f"{t.element_size()}-byte elements; pass a copy (t.clone())")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous fp32 tensors share any byte."""
    return (a.data_ptr() < b.data_ptr() + 4 * b.numel()
            and b.data_ptr() < a.data_ptr() + 4 * a.numel())


class NativeAdam:
    """The native kernel's calls; stateless, so one serves every thread. `isa`:
    the code paths it may take, one of `ISAS` (default `OFFLOAD_NATIVE_ISA`, else
    all the CPU has)."""

    def __init__(self, isa: str | None = None) -> None:
        ok, why = native_status()
        if not ok:
            raise RuntimeError(why)
        isa = isa or os.environ.get(ISA_SWITCH) or "avx512"
        if isa not in ISAS:
            from ..config import ConfigError
            raise ConfigError(f"{ISA_SWITCH}: {isa!r} is not one of {list(ISAS)}; unset it "
                              "(the kernel then takes every path the CPU has) or give one")
        self.isa = isa
        self._fn = _cache["lib"].offload_adam_block
        self._claim = _cache["lib"].offload_adam_claim
        self._coef: dict[tuple[AdamHyper, int], tuple] = {}

    def block(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: Moment,
              exp_avg_sq: Moment, out: torch.Tensor | None, grad_scale: float,
              runs: list[BlockRun], first: int = 0, src: torch.Tensor | None = None) -> None:
        """Updates elements [0, n) of a block in place (n = master.numel()): `grad`,
        the moments and `out` (compute-dtype copy of the new master, or None) are
        views of the same n elements; an int8 moment's first element is the first of a
        `QBLOCK`. `runs`: sorted, disjoint, within [0, n); a run whose hyper-parameters
        are None keeps its weights and moments (its master is still copied to `out`),
        and elements outside every run are not written (int8 codes of a block that a
        run updates aside: the whole block is coded again, as `codec.encode` does).
        `first`: the model-wide index of element 0 (the stochastic rounding of bf16
        moments and int8 codes: the partition's origin plus the block's place in it).
        `src`: the master's current values, when they are not in `master`: `master`
        receives the new ones (and `src`'s values where no run updates), `src` is only
        read; the same bits as copying `src` into `master` first."""
        self._fn(*self._args(master, grad, exp_avg, exp_avg_sq, out, grad_scale, runs, first,
                             src))

    def claimer(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: Moment,
                exp_avg_sq: Moment, out: torch.Tensor | None, grad_scale: float,
                runs: list[BlockRun], first: int = 0, src: torch.Tensor | None = None,
                unit: int = CLAIM_UNIT) -> Callable[[], int]:
        """The update of `block`'s arguments (here a whole chunk) shared between
        threads: checks them once and returns a function that every thread calls
        once; each call claims units of `unit` elements (a multiple of 1024) from a
        shared counter until none is left, with the GIL released throughout, and
        returns how many it updated. The function holds the tensors: the C calls
        write through their addresses."""
        if unit < 1 or unit % _TILE:
            raise ValueError(f"unit {unit} must be a positive multiple of {_TILE}")
        args = self._args(master, grad, exp_avg, exp_avg_sq, out, grad_scale, runs, first, src)
        nxt = ctypes.c_int64(0)
        claim, ref = self._claim, ctypes.byref(nxt)
        held = (master, grad, exp_avg, exp_avg_sq, out, src)

        def run() -> int:
            held  # noqa: B018 - kept alive by the closure: `args` holds their addresses
            return claim(*args, unit, ref)
        return run

    def _args(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: Moment,
              exp_avg_sq: Moment, out: torch.Tensor | None, grad_scale: float,
              runs: list[BlockRun], first: int, src: torch.Tensor | None = None) -> tuple:
        """The C call's arguments, after checking every one."""
        n = master.numel()
        _check("master", master, (torch.float32,), n)
        if src is not None:
            _check("src", src, (torch.float32,), n)
            if _overlap(src, master) and src.data_ptr() != master.data_ptr():
                raise ValueError("src overlaps master without being it")
        _check("grad", grad, (torch.float32,), n)
        state = exp_avg.data.dtype
        if state not in _STATE:
            raise ValueError(f"exp_avg stored as {state}, not one of {list(_STATE)}")
        _check("exp_avg", exp_avg.data, (state,), n)
        _check("exp_avg_sq", exp_avg_sq.data, (_V_DTYPE[state],), n)
        scales = [None, None]
        if state == torch.int8:
            for i, mom in enumerate((exp_avg, exp_avg_sq)):
                if mom.scale is None:
                    raise ValueError(f"{mom.kind}: 8-bit codes without scales")
                _check(f"{mom.kind} scales", mom.scale, (torch.float32,), -(-n // QBLOCK))
                scales[i] = mom.scale.data_ptr()
        if out is not None:
            _check("out", out, tuple(_OUT), n)
        if first < 0:
            raise ValueError(f"first element {first} is negative")
        if not (math.isfinite(grad_scale) and grad_scale > 0):
            raise ValueError(f"grad_scale {grad_scale} must be a positive finite number")
        arr = (_Run * max(1, len(runs)))()
        at = 0
        for i, (lo, hi, hyper, step) in enumerate(runs):
            if not at <= lo <= hi <= n:
                raise ValueError(f"run {i} [{lo}, {hi}) is out of order or outside [0, {n})")
            at = hi
            if hyper is None:
                arr[i] = _Run(lo, hi, 1)
                continue
            if step < 0:
                raise ValueError(f"run {i}: update count {step} is negative")
            key = (hyper, step)
            coef = self._coef.get(key)
            if coef is None:
                coef = self._coef[key] = _coefficients(hyper, step + 1)
                if len(self._coef) > 256:  # schedules change lr every step
                    self._coef = {key: coef}
            arr[i] = _Run(lo, hi, 0, *coef)
        return (n, master.data_ptr(), grad.data_ptr(), exp_avg.data.data_ptr(),
                exp_avg_sq.data.data_ptr(), scales[0], scales[1], _STATE[state],
                None if out is None else out.data_ptr(), 0 if out is None else _OUT[out.dtype],
                grad_scale, arr, len(runs), first, ISAS[self.isa],
                None if src is None else src.data_ptr())
