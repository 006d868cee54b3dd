"""CPU Adam / AdamW over flat fp32 tensors, one cache block at a time.

[Note: one pass over memory]
The update reads the fp32 master, gradient, exp_avg and exp_avg_sq (16 bytes
per element) and writes master, exp_avg and exp_avg_sq back (12 bytes); that
traffic, not the arithmetic, bounds it. So everything else rides on the same
pass: gradient unscaling and the clipping coefficient are one divisor handed
to the kernel (`grad_scale = loss_scale / clip_coef`), bias correction and
decoupled weight decay are inside the kernel, and the compute-dtype (bf16 /
fp16) parameter is copied from each block of `block_elems` elements right
after that block's update, while the block is still in cache (256 Ki elements:
1 MiB per array; up to 1 Mi keeps five arrays within a 32 MiB L3), instead of
in a second pass over the whole partition. With no scaling and no compute-dtype
copy the fused kernel takes the whole tensor in one call.

The kernel is torch's fused CPU Adam (`torch._fused_adamw_` /
`torch._fused_adam_`), bit-identical to `torch.optim.AdamW(fused=True)`.
Where it is absent, the same math runs as `torch._foreach_*` calls over the
cache block (several passes over cache, still one over memory); a log line
says why. The fused kernel divides the gradient in place when given a
`grad_scale`; the caller's gradient is never written: a scaled block is first
copied into a block-sized scratch that lives in cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch

log = logging.getLogger(__name__)

__all__ = ["AdamHyper", "AdamKernel", "GradScaling", "fused_status", "grad_sq_sum",
           "hyper_error", "resolve_scaling"]

KernelName = Literal["auto", "native", "fused", "foreach"]  # "native": native.py


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one update. `lr` already includes the schedule's multiplier."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # True: AdamW (decay the weights); False: Adam (decay added to the grad)

    def __post_init__(self) -> None:
        bad = hyper_error(self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay,
                          scheduled=True)
        if bad:
            raise ValueError(bad)


def hyper_error(lr: Any, betas: Any, eps: Any, weight_decay: Any, *,
                scheduled: bool = False) -> str | None:
    """What is wrong with Adam's hyper-parameters, or None: the values torch.optim.AdamW
    accepts (lr, eps, weight_decay >= 0; each beta in [0, 1)), and finite. A beta of 1
    divides by zero in the bias correction, one above 1 or a negative value grows the
    moments without bound; torch raises ValueError for them, and so do we.
    `scheduled`: `lr` is a group's rate times its schedule's multiplier, which torch's
    LambdaLR lets go below 0 (only a NaN or inf is refused then: it spoils every weight)."""
    try:
        b = tuple(float(x) for x in betas)
        vals = {"lr": float(lr), "eps": float(eps), "weight_decay": float(weight_decay)}
    except (TypeError, ValueError) as e:
        return f"hyper-parameters must be numbers ({e}): lr {lr!r}, betas {betas!r}, " \
               f"eps {eps!r}, weight_decay {weight_decay!r}"
    if len(b) != 2:
        return f"betas {betas!r} must be two numbers (beta1, beta2) in [0, 1), e.g. (0.9, 0.999)"
    for i, x in enumerate(b):
        if not 0.0 <= x < 1.0:
            return f"beta{i + 1} {x} (betas {b}) is not in [0, 1); e.g. (0.9, 0.999)"
    for k, x in vals.items():
        if not (math.isfinite(x) and (x >= 0.0 or (k == "lr" and scheduled))):
            return f"{k} {x} must be a finite number" + ("" if scheduled and k == "lr" else " >= 0")
    return None


def fused_status() -> tuple[bool, str]:
    """(usable, why): whether torch's fused Adam kernels run on CPU tensors here."""
    names = ("_fused_adamw_", "_fused_adam_")
    missing = [n for n in names if not hasattr(torch, n)]
    if missing:
        return False, f"torch {torch.__version__} has no torch.{missing[0]}"
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    try:
        for n in names:
            getattr(torch, n)([p], [g], [m], [v], [], [torch.ones(())], lr=1e-3, beta1=0.9,
                              beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                              maximize=False, grad_scale=torch.ones(()), found_inf=None)
    except (RuntimeError, NotImplementedError) as e:
        return False, f"torch.{n} has no CPU kernel in torch {torch.__version__} ({e})"
    return True, f"torch.{names[0]} has a CPU kernel (torch {torch.__version__})"


def _choose(kernel: KernelName) -> str:
    if kernel == "foreach":
        log.info("optim.kernel = 'foreach': using torch._foreach_* math")
        return "foreach"
    ok, why = fused_status()
    if ok:
        return "fused"
    if kernel == "fused":
        raise RuntimeError(f"optim.kernel = 'fused' but {why}; set optim.kernel = 'auto'")
    log.warning("%s; falling back to torch._foreach_* math (same results to fp32 rounding, "
                "more passes over each cache block)", why)
    return "foreach"


class AdamKernel:
    """Adam/AdamW update of flat fp32 tensors in place, `block_elems` elements per call.

    Not thread safe: it owns block-sized scratch tensors; use one per thread.
    """

    def __init__(self, kernel: KernelName = "auto", block_elems: int = 1 << 18) -> None:
        if block_elems < 1:
            raise ValueError(f"block_elems must be positive, got {block_elems}")
        self.impl = _choose(kernel)
        self.block_elems = block_elems
        self._scratch = torch.empty(block_elems, dtype=torch.float32)
        self._denom = torch.empty(block_elems if self.impl == "foreach" else 0,
                                  dtype=torch.float32)

    def update(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, hyper: AdamHyper,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None) -> None:
        """One Adam step over 1-D fp32 tensors of equal length, in place.

        Args:
            step: the 1-based number of this update (bias correction uses beta**step).
            grad_scale: the gradient is divided by it (loss scale / clip coefficient);
                1.0 reads the gradient as is. `grad` itself is never written.
            param_out: optional 1-D bf16/fp16/fp32 tensor that receives the new
                master values (rounded to nearest even), block by block.
        """
        n = master.numel()
        for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                        ("param_out", param_out)):
            if t is not None and t.numel() != n:
                raise ValueError(f"{name} has {t.numel()} elements, master has {n}")
        if step < 1:
            raise ValueError(f"step {step} must be >= 1 (the first update is step 1)")
        if not (math.isfinite(grad_scale) and grad_scale > 0):
            raise ValueError(f"grad_scale {grad_scale} must be a positive finite number")
        step_t = torch.tensor(float(step))
        scale_t = torch.tensor(grad_scale, dtype=torch.float32) if grad_scale != 1.0 else None
        # Blocks only where they save a pass (see the note); else one call, one
        # parallel region: fewer thread barriers, which matters on a busy host.
        whole = self.impl == "fused" and scale_t is None and param_out is None
        block = max(n, 1) if whole else self.block_elems
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            p, g, m, v = master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
            if self.impl == "fused":
                if scale_t is not None:
                    g = self._scratch[:hi - lo].copy_(g)  # the kernel unscales in place
                self._fused(p, g, m, v, step_t, hyper, scale_t)
            else:
                self._foreach(p, g, m, v, step, hyper, grad_scale)
            if param_out is not None:
                param_out[lo:hi].copy_(p)

    @staticmethod
    def _fused(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               step_t: torch.Tensor, h: AdamHyper, scale_t: torch.Tensor | None) -> None:
        fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
        fn([p], [g], [m], [v], [], [step_t], lr=h.lr, beta1=h.beta1, beta2=h.beta2,
           weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False,
           grad_scale=scale_t, found_inf=None)

    def _foreach(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 step: int, h: AdamHyper, grad_scale: float) -> None:
        # The same math as torch.optim.AdamW's single-tensor path, over one cache block.
        k = p.numel()
        if grad_scale != 1.0:
            g = torch.div(g, grad_scale, out=self._scratch[:k])
        if h.weight_decay:
            if h.decoupled:
                torch._foreach_mul_([p], 1.0 - h.lr * h.weight_decay)
            else:
                g = torch.add(g, p, alpha=h.weight_decay, out=self._scratch[:k])
        torch._foreach_lerp_([m], [g], 1.0 - h.beta1)
        torch._foreach_mul_([v], h.beta2)
        torch._foreach_addcmul_([v], [g], [g], 1.0 - h.beta2)
        bias1 = 1.0 - h.beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - h.beta2 ** step)
        denom = torch.sqrt(v, out=self._denom[:k])
        torch._foreach_div_([denom], bias2_sqrt)
        torch._foreach_add_([denom], h.eps)
        torch._foreach_addcdiv_([p], [m], [denom], -h.lr / bias1)


@dataclass(frozen=True)
class GradScaling:
    """How one step treats its gradients.

    `grad_scale` divides every gradient element (loss scale / clip coefficient);
    `grad_norm` is the global 2-norm of the unscaled gradients (None when
    neither clipping nor an overflow check needed it); `found_inf` means the
    step must be skipped (a non-finite gradient).
    """

    grad_scale: float
    clip_coef: float
    grad_norm: float | None
    found_inf: bool


def grad_sq_sum(grads: Iterable[torch.Tensor]) -> float:
    """Sum of squares of all gradient elements, as given (still loss-scaled).

    Each given tensor's 2-norm is taken in fp32, as torch.nn.utils.clip_grad_norm_
    takes each parameter's; the squares are summed in float64. The engine gives a
    group's whole flat partition as one tensor, so the norm may differ from torch's
    in its last fp32 bits (torch: one norm per parameter, then the norm of those).
    inf/nan propagate. Across ranks, all-reduce this sum and pass sqrt(sum) /
    loss_scale as `grad_norm`.
    """
    total = 0.0
    for g in grads:
        total += float(torch.linalg.vector_norm(g, 2, dtype=torch.float32)) ** 2
    return total


def resolve_scaling(grads: Iterable[torch.Tensor], *, loss_scale: float, max_grad_norm: float,
                    grad_norm: float | None = None, found_inf: bool | None = None) -> GradScaling:
    """Works out the step's gradient divisor, reading the gradients only if needed.

    The gradients are read once (for their norm) when clipping is on and
    `grad_norm` is not given, or when `loss_scale != 1` and `found_inf` is not
    given (fp16 overflow check). A non-finite norm means overflow: the step is
    skipped. Clipping follows clip_grad_norm_: coef = max_norm / (norm + 1e-6),
    applied only when below 1.
    """
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale {loss_scale} must be a positive finite number")
    need_norm = max_grad_norm > 0 and grad_norm is None
    need_check = found_inf is None and loss_scale != 1.0
    if need_norm or need_check:
        norm = math.sqrt(grad_sq_sum(grads)) / loss_scale
        if found_inf is None:
            found_inf = not math.isfinite(norm)
        if grad_norm is None:
            grad_norm = norm
    found_inf = bool(found_inf) or (grad_norm is not None and not math.isfinite(grad_norm))
    if found_inf:
        return GradScaling(loss_scale, 1.0, grad_norm, True)
    clip = 1.0
    if max_grad_norm > 0:
        clip = min(1.0, max_grad_norm / (grad_norm + 1e-6))
    return GradScaling(loss_scale / clip, clip, grad_norm, False)
