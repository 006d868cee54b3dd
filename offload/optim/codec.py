"""How Adam's moments are stored: fp32, bf16, or 8-bit codes with a scale per block.

[Note: compressed moments]
`optim.state_dtype` fixes the form of exp_avg and exp_avg_sq in every tier
(host tensors, NVMe chunks, `state_dict`); the master stays fp32. Per element:

| state_dtype | exp_avg                             | exp_avg_sq                          | bytes |
| ----------- | ----------------------------------- | ----------------------------------- | ----- |
| fp32        | fp32                                | fp32                                | 8     |
| bf16        | bf16, stochastic rounding on update | bf16, stochastic rounding on update | 4     |
| int8        | int8, linear, stochastic on update  | uint8 codes of sqrt(v), the same    | ~2.03 |

Moments loaded from other values (`encode` without offsets: state dicts,
checkpoints) round to nearest even; the update's writes round stochastically
([Note: stochastic rounding] below).

int8 keeps one fp32 scale per block of `QBLOCK` (256) elements for each
moment (8 bytes per 256 elements). exp_avg is signed and maps linearly:
code = round(m / s), s = max|m| / 127 over the block. exp_avg_sq spans
orders of magnitude inside a block, and Adam divides by sqrt(v): a linear
code of v rounds small entries to 0, and m / (0 + eps) blows the update up.
Coding r = sqrt(v) linearly (v = (code * s)^2, s = max r / 255) keeps the
error of the denominator, which is what the update sees, within half a step
of the block's largest sqrt(v) for one encode (a step, rounded
stochastically); `docs/optim.md` gives the measurement that chose it over a
linear code of v. Across steps that bound did not hold while every update
rounded to nearest: a change under half a step was lost each time, so a
small entry beside a large one stayed at code 0 (next note). sqrt(v) is the
correctly rounded fp32 square root, the same on every CPU, so the native
kernel (native.py) and this module give the same codes bit for bit.

A NaN or an inf in a block stays in its element, as in an fp32 moment: a NaN is
left out of the block's max (it codes to 0), and the scale is at most FLT_MAX /
127 (exp_avg) or FLT_MAX / 255 (exp_avg_sq), so an inf codes to the top code and
decodes to about FLT_MAX, or inf once squared. Before, the block's scale became
NaN or inf, each of its codes decoded to NaN or inf, and all 256 weights went to
NaN at the next step, where torch's Adam spoils one (a NaN or inf gradient) or
none (a gradient whose square overflows exp_avg_sq: that weight stops moving).
The block's other elements then code against the huge scale, as against any
outlier (most round to 0); the weights' NaN are those of fp32 moments, tested in
tests/optim/test_int8_non_finite.py.

[Note: the first moment's bound]
Adam keeps |m| <= C sqrt(v) in every element, C = (1 - beta1) / sqrt((1 - beta2)
(1 - beta1^2 / beta2)) (Cauchy-Schwarz over the sums m and v are; an update
keeps it, as C^2 (1 - beta1^2 / beta2) = (1 - beta1)^2 / (1 - beta2)): 7.27 for
(0.9, 0.999), so a step is at most about 7 lr. The two int8 codes round apart,
each stochastically: an element whose sqrt(v) code rounded down to 0 while its
exp_avg code rounded up to 1 stepped by m / eps, thousands of lr at once (a weight
of -2.17 at 71.4 after two steps at lr 1e-2, fp32 -2.16). So the update takes
decoded m as clamp(m, -lim, lim), lim = (code * s) * C in fp32 with the element's
decoded sqrt(v) (`moment_bound`; adam_native.c's bound_m8), before it runs, in
each run with its own betas: a state Adam could hold is left as it is, and one
the rounding made impossible is moved to the nearest Adam can hold, so the step
is again at most the bound fp32 Adam's is under. Where beta1^2 >= beta2 Adam
has no such bound, and nothing is clamped. int8 only: fp32 moments are torch's
exactly, bf16 ones keep m / sqrt(v) within a few parts in a thousand.

Decoding and encoding happen inside the update's pass over memory, one cache
block at a time (blocks.py): decode a block into fp32 scratch, update, encode
back, while the block is in cache. A block of `QBLOCK` elements is coded as a
whole: chunks and cache blocks start at multiples of `QBLOCK`.

[Note: stochastic rounding]
bf16 has 8 significant bits (steps of 0.4-0.8%), and exp_avg_sq decays by
0.1% a step with beta2 = 0.999: rounded to nearest, an entry whose gradient
went quiet rounds back to its old value for ever, so v stays high and the
steps small (docs/benchmarks.md, "Loss with compressed moments"). The update
therefore writes bf16 moments with stochastic rounding: x rounds up with
probability (x - down) / (up - down), so the stored value is x on average and
the decay goes on. Loading state (`encode`: state dicts, checkpoints) still
rounds to nearest; a value already a bf16 one is kept either way.

The random bits must be the same on every path (the native kernel's vector
and scalar loops, the torch path in blocks.py, on any device) and not depend
on how the update is cut (chunks, cache blocks, threads, claim units), nor on
how many ranks share the weights: they are a hash of the element's index (mod
2^32; its place in the model's weights, the partition's `origin` plus its
place in the partition) and the update count of the run that updates it (the
step number Adam's bias correction uses), one half of it for each moment:

    key = mix32(count mod 2^32)                  once per run
    h   = mix32((index mod 2^32) ^ key)          per element
    r   = h & 0xffff for exp_avg, h >> 16 for exp_avg_sq
    bf16 bits = (fp32 bits + r) >> 16;  a NaN -> 0xffff

mix32 is the integer hash x = ((x >> 16) ^ x) * 0x45d9f3b twice, then
(x >> 16) ^ x, mod 2^32: a bijection of 32-bit words whose output bits each
flip with probability close to 1/2 for a flip of any input bit, and a
multiplier below 2^27, so the torch path's int64 arithmetic never overflows
(x * 0x45d9f3b < 2^59). One hash serves both moments: its two multiplies per
element cost the AVX-512 loop 0.13 ns per element and core (0.20 with a hash
per moment; the bf16-moment update of a block in L2 took 0.75 ns before).
Counter-based: no generator state to seed or save; a resumed run draws the
same bits as one that never stopped (the update counts are in the state
dict). The carry of the addition is the rounding: a value above a binade's
largest bf16 value rounds up to the next power of two, one above bf16's
largest finite value rounds up to inf (each with its probability), and inf
stays inf.

int8 codes stall the same way, worse: a code step is 1/127 of the block's
largest |m| (1/255 of its largest sqrt(v)), and sqrt(v) grows by
sqrt(1 - beta2) * |g| = 0.0316 |g| a step. After one gradient of 10 in an
element, its neighbour with a steady gradient of 1e-3 gained 2.5% of a code
a step and rounded back to 0 for thousands of steps, while its exp_avg code
came back within a few: its steps were about 30 lr (weight -45.9 after 2000
steps at lr 1e-3, fp32's -2.0). So the update codes each element a run
updates as floor(x / s + r) with 8 bits of the same hash h:

    k = (h >> 8) & 0xff for exp_avg, h >> 24 for exp_avg_sq
    r = (k + 0.5) / 256                       in [1/512, 1 - 1/512]

x / s is one fp32 multiply by the reciprocal of the scale, + r one fp32 add,
then floor (`encode`'s `offsets`, `int8_offsets`; adam_native.c's code8), then
the clamps as before; a value within 1/512 of a code keeps it, so a decoded
block encodes back to its own codes. The code is x / s on average: the
neighbour above ends at -2.15 (fp32 -2.0). What remains: the first steps
after a spike still code the small entries against its scale, so their
codes are 0 or 1 at random (exp_avg's too, which scales their steps down
while the spike's scale lasts: -0.21 after 500 steps against fp32's -0.5),
and the rounding adds noise of up to a code step per update where rounding
to nearest added a bias. The code of sqrt(v) is unbiased, so decoded v is
above v on average by the rounding's variance (at most a quarter of a step
squared). Elements no run
updates (segments without a gradient that share a block with one that has
one) round to nearest as before when their block is coded again, so they
keep their codes unless the block's scale moves; blocks without any
gradient are not coded again.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..planner.sizes import QBLOCK, STATE_DTYPES, StateDtype, moment_bytes

__all__ = ["Moment", "QBLOCK", "SpareBuffers", "StateDtype", "STATE_DTYPES", "moment_bytes",
           "new_moment", "zero_moment", "decode", "encode", "clone_moment", "copy_moment",
           "moment_views", "moment_to_dict", "moment_from_dict", "mix32", "rounding_key",
           "rounding_hash", "encode_stochastic", "int8_offsets", "NEAREST"]

_TINY = torch.finfo(torch.float32).tiny
_STORED = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CODE_MAX = {"exp_avg": 127.0, "exp_avg_sq": 255.0}
_CODE_DTYPE = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
# the largest scale: FLT_MAX / top in fp32 (adam_native.c's clamp_scale), where an inf
# in the block leaves it ([Note: compressed moments], "A NaN or an inf")
_SCALE_MAX = {k: float(torch.tensor(torch.finfo(torch.float32).max) / top)
              for k, top in _CODE_MAX.items()}


class Moment(NamedTuple):
    """One moment of `n` elements as stored: `data` (fp32, bf16, int8 or uint8 codes)
    and, for int8, `scale` (fp32, one per `QBLOCK` elements); `kind` is "exp_avg"
    (signed, linear) or "exp_avg_sq" (sqrt-coded, see [Note: compressed moments])."""

    data: torch.Tensor
    scale: torch.Tensor | None
    kind: str

    def __getitem__(self, sl):  # a slice of elements [lo, hi), lo a multiple of QBLOCK
        if not isinstance(sl, slice):
            return tuple.__getitem__(self, sl)
        lo, hi = sl.start or 0, self.data.numel() if sl.stop is None else sl.stop
        if self.scale is None:
            return Moment(self.data[lo:hi], None, self.kind)
        if lo % QBLOCK:
            raise ValueError(f"int8 moment sliced at element {lo}, not a multiple of {QBLOCK}")
        return Moment(self.data[lo:hi], self.scale[lo // QBLOCK:-(-hi // QBLOCK)], self.kind)

    @property
    def numel(self) -> int:
        return self.data.numel()


def _scales(n: int) -> int:
    return -(-n // QBLOCK)


def new_moment(state_dtype: StateDtype, kind: str, n: int) -> Moment:
    """A zero moment of `n` elements in host memory (see `zero_moment`)."""
    if state_dtype == "int8":
        m = Moment(torch.empty(n, dtype=_CODE_DTYPE[kind]), torch.empty(_scales(n)), kind)
    else:
        m = Moment(torch.empty(n, dtype=_STORED[state_dtype]), None, kind)
    zero_moment(m)
    return m


def zero_moment(m: Moment) -> None:
    """Sets `m` to zeros in its stored form: codes 0 and, for int8, the scale that
    `encode` gives a block of zeros (the smallest normal fp32, not 0). A block no
    update touches then holds the bits that decoding and encoding it again gives,
    as a save and resume does."""
    m.data.zero_()
    if m.scale is not None:
        m.scale.fill_(_TINY)


def moment_views(raw: torch.Tensor, state_dtype: StateDtype, n: int) -> tuple[Moment, Moment]:
    """(exp_avg, exp_avg_sq) views of `raw` (uint8, `moment_bytes(state_dtype, n)` bytes
    or more, 4-byte aligned), laid out as [exp_avg | exp_avg_sq | pad | scales]."""
    if state_dtype == "int8":
        at = -(-2 * n // 4) * 4
        k = _scales(n)
        sc = raw[at:at + 8 * k].view(torch.float32)
        return (Moment(raw[:n].view(torch.int8), sc[:k], "exp_avg"),
                Moment(raw[n:2 * n], sc[k:], "exp_avg_sq"))
    dt = _STORED[state_dtype]
    w = dt.itemsize * n
    return (Moment(raw[:w].view(dt), None, "exp_avg"),
            Moment(raw[w:2 * w].view(dt), None, "exp_avg_sq"))


def clone_moment(m: Moment) -> Moment:
    return Moment(m.data.clone(), None if m.scale is None else m.scale.clone(), m.kind)


def copy_moment(dst: Moment, src: Moment) -> None:
    """Copies stored codes and scales (same form)."""
    dst.data.copy_(src.data)
    if dst.scale is not None:
        dst.scale.copy_(src.scale)


def _rows(x: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """`x` as (k, QBLOCK) rows plus a one-row tail of the remainder, each with the
    slice of the scales it uses."""
    n = x.numel()
    full = n // QBLOCK
    out = []
    if full:
        out.append((x[:full * QBLOCK].view(full, QBLOCK), slice(0, full)))
    if n > full * QBLOCK:
        out.append((x[full * QBLOCK:].view(1, -1), slice(full, full + 1)))
    return out


@functools.lru_cache(maxsize=64)
def moment_bound(beta1: float, beta2: float) -> float:
    """C of [Note: the first moment's bound], rounded to fp32 (as the kernel takes it);
    0.0 where Adam has none (beta1^2 >= beta2)."""
    if beta1 == 0.0:
        c = 1.0 / math.sqrt(1.0 - beta2)
    elif beta1 * beta1 >= beta2:
        return 0.0
    else:
        c = (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2))
    return float(torch.tensor(c, dtype=torch.float32))


def bound_first_moment(m: torch.Tensor, root: torch.Tensor, c: float) -> None:
    """[Note: the first moment's bound]: `m` (fp32, decoded exp_avg) clamped in place
    to +-root * c, `root` the same elements' decoded sqrt(v) (`decode(...,
    squared=False)`); nothing where `c` is 0."""
    if c == 0.0:
        return
    # adam_native.c's two selects exactly (signed zeros too: torch.minimum's vector
    # body and its scalar tail disagree on which zero of -0.0 and +0.0 is the less)
    lim = root * c
    torch.where(lim < m, lim, m, out=m)
    lim.neg_()
    torch.where(lim > m, lim, m, out=m)


def decode(m: Moment, out: torch.Tensor, squared: bool = True) -> torch.Tensor:
    """fp32 values of `m` into `out` (fp32, same numel); returns `out`. `squared`
    False: int8 exp_avg_sq's decoded sqrt(v) (code * s), not v."""
    out.copy_(m.data)
    if m.scale is None:
        return out
    for rows, sl in _rows(out):
        rows.mul_(m.scale[sl].unsqueeze(1))
    if m.kind == "exp_avg_sq" and squared:
        out.square_()
    return out


def _sqrt(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """sqrt(x) correctly rounded to fp32 (taken in fp64, then rounded: exact for
    sqrt). torch.sqrt's vectorised CPU kernel is not: it is 1 ulp off for about a
    sixth of the values on an AVX-512 host, and the codes must not depend on the
    CPU (the native kernel takes the IEEE square root)."""
    return out.copy_(torch.sqrt(x.to(torch.float64)))


def encode(x: torch.Tensor, m: Moment, tmp: torch.Tensor,
           offsets: torch.Tensor | None = None) -> None:
    """Stores fp32 `x` into `m` (rounded to nearest); `tmp`: fp32 scratch of x's numel.
    exp_avg_sq must be >= 0 (Adam keeps it so). `offsets` (int8 only; fp32, x's numel):
    element i codes as floor(x_i / s + offsets_i) where offsets_i >= 0 (stochastic
    rounding, `int8_offsets`), to nearest where it is `NEAREST`."""
    if m.scale is None:
        m.data.copy_(x)
        return
    top = _CODE_MAX[m.kind]
    src = _sqrt(x, tmp) if m.kind == "exp_avg_sq" else torch.abs(x, out=tmp)
    src.masked_fill_(torch.isnan(src), 0.0)  # a NaN is left out of the scale (it codes to 0)
    for rows, sl in _rows(src):
        torch.amax(rows, dim=1, out=m.scale[sl])
    if m.kind == "exp_avg":
        src.copy_(x)  # (torch.aminmax would spare the |x| pass but runs 6x slower)
    m.scale.div_(top).clamp_(min=_TINY, max=_SCALE_MAX[m.kind])
    for rows, sl in _rows(src):
        rows.mul_(m.scale[sl].reciprocal().unsqueeze(1))
    if offsets is None:
        src.round_()
    else:  # x * inv, + r, floor: adam_native.c's code8, one fp32 rounding each
        near = offsets < 0  # (most blocks have none: no rounded copy)
        rounded = src.round() if near.any() else None
        src.add_(offsets).floor_()
        if rounded is not None:
            torch.where(near, rounded, src, out=src)
    src.clamp_(min=-top if m.kind == "exp_avg" else 0.0, max=top)  # an inf: top
    m.data.copy_(src)


_MIX = 0x45D9F3B
_M32 = 0xFFFFFFFF
BF16_NAN = 0xFFFF  # every NaN, as torch's vectorised fp32 -> bf16 conversion gives


def mix32(x):
    """[Note: stochastic rounding]'s hash of a 32-bit word: an int, or an int64 tensor
    of values in [0, 2^32) (updated in place)."""
    if isinstance(x, torch.Tensor):
        for _ in range(2):
            x.bitwise_xor_(x >> 16).mul_(_MIX).bitwise_and_(_M32)
        return x.bitwise_xor_(x >> 16)
    for _ in range(2):
        x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def rounding_key(count: int) -> int:
    """The key of a run with update count `count` (1 for a moment's first update),
    [Note: stochastic rounding]."""
    return mix32(count & _M32)


def rounding_hash(first: int, n: int, count: int, device: torch.device) -> torch.Tensor:
    """The hash h of elements `first` .. `first + n - 1` of a partition updated for the
    `count`-th time (int64, [Note: stochastic rounding]): both moments take their
    random bits from it."""
    h = torch.arange(first, first + n, dtype=torch.int64, device=device)
    h.bitwise_and_(_M32).bitwise_xor_(rounding_key(count))
    return mix32(h)


def encode_stochastic(x: torch.Tensor, m: Moment, first: int, count: int,
                      h: torch.Tensor | None = None) -> None:
    """Stores fp32 `x` into the bf16 moment `m` (same numel, any device) with
    stochastic rounding: element i is element `first + i` of its partition, updated
    for the `count`-th time ([Note: stochastic rounding]); the native kernel's bits.
    `h`: `rounding_hash` of those elements, where the caller has it (left as is)."""
    if m.data.dtype != torch.bfloat16:
        raise ValueError(f"{m.kind}: stochastic rounding writes bf16, not {m.data.dtype}")
    if h is None:
        h = rounding_hash(first, x.numel(), count, x.device)
    r = h & 0xFFFF if m.kind == "exp_avg" else h >> 16
    bits = x.view(torch.int32).to(torch.int64).bitwise_and_(_M32)
    bits.add_(r).bitwise_right_shift_(16)
    bits.masked_fill_(torch.isnan(x), BF16_NAN)
    bits.sub_((bits & 0x8000) << 1)  # the int16 whose bits these are
    m.data.view(torch.int16).copy_(bits)


NEAREST = -1.0  # an `encode` offset: this element rounds to nearest even


def int8_offsets(h: torch.Tensor, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The offsets r = (k + 0.5) / 256 with which the update's int8 codes round
    (`encode`'s `offsets`, fp32): k is bits 8-15 of `rounding_hash` h for exp_avg, bits
    24-31 for exp_avg_sq ([Note: stochastic rounding]). Into `out` where given."""
    k = (h >> 8 if kind == "exp_avg" else h >> 24).bitwise_and_(0xFF)
    r = k.to(torch.float32) if out is None else out.copy_(k)
    return r.mul_(1.0 / 256).add_(1.0 / 512)  # exact: 9 significant bits


def moment_to_dict(m: Moment) -> dict[str, torch.Tensor]:
    """{kind: data} and, for int8, {kind + "_scale": scale}: the state_dict entries."""
    d = {m.kind: m.data}
    if m.scale is not None:
        d[m.kind + "_scale"] = m.scale
    return d


def moment_from_dict(state: dict, kind: str, state_dtype: StateDtype, n: int,
                     what: str) -> Moment | torch.Tensor | None:
    """The `kind` entry of a state dict: a `Moment` when it is stored in `state_dtype`'s
    form (copied as is), else an fp32 tensor (to be encoded); None when absent."""
    t = state.get(kind)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != n:
        raise ValueError(f"{what}[{kind!r}]: expected a tensor of {n} elements, got "
                         f"{getattr(t, 'shape', type(t).__name__)}")
    t = t.detach().reshape(-1).contiguous()
    scale = state.get(kind + "_scale")
    if t.dtype in (torch.int8, torch.uint8):
        # codes of the other signedness would decode to other values (exp_avg's -1 as 255)
        if t.dtype != _CODE_DTYPE[kind]:
            raise ValueError(f"{what}[{kind!r}]: {kind} is coded as {_CODE_DTYPE[kind]}, "
                             f"not {t.dtype} ([Note: compressed moments])")
        if scale is None:
            raise ValueError(f"{what}[{kind!r}] holds 8-bit codes without {kind + '_scale'!r}")
        if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
            raise ValueError(f"{what}[{kind + '_scale'!r}]: expected a float tensor, got "
                             f"{getattr(scale, 'dtype', type(scale).__name__)}")
        scale = scale.detach().reshape(-1).to(torch.float32).contiguous()
        if scale.numel() != _scales(n):
            raise ValueError(f"{what}[{kind + '_scale'!r}]: {scale.numel()} scales, "
                             f"{_scales(n)} needed for {n} elements")
        # `encode` writes every scale in [_TINY, _SCALE_MAX]; a NaN, an inf, or a finite
        # one above the largest (its top code decodes to inf) would decode its whole
        # block to NaN or inf (256 weights NaN at the next step), a negative one flip
        # exp_avg's signs
        bad = ~((scale >= 0) & (scale <= _SCALE_MAX[kind]))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{what}[{kind + '_scale'!r}]: scale {i} is "
                             f"{float(scale[i])}; int8 scales are at least 0 and at most "
                             f"{_SCALE_MAX[kind]:.6g} ([Note: compressed moments])")
        if state_dtype == "int8":
            return Moment(t, scale, kind)
        return decode(Moment(t, scale, kind), torch.empty(n, dtype=torch.float32))
    if not t.is_floating_point():
        raise ValueError(f"{what}[{kind!r}]: expected floating-point values or 8-bit codes, "
                         f"got {t.dtype}")
    if kind == "exp_avg_sq":  # a mean of squares: below 0 or NaN, every update it meets
        bad = ~(t >= 0)       # is NaN (int8 coded it as 0 without a word)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{what}[{kind!r}]: element {i} is {float(t[i])}; exp_avg_sq "
                             "is a mean of squared gradients, at least 0: the state dict is "
                             "damaged (load another, or leave the optimizer state out)")
    if state_dtype in _STORED and t.dtype == _STORED[state_dtype] and scale is None:
        return Moment(t, None, kind)
    return t.to(torch.float32)


class SpareBuffers:
    """[Note: the copies' buffers] A host partition's update in `CpuAdam` first copies
    its state (the round's rollback copy). Fresh memory for each copy cost page faults: a
    clone of 4 MiB took 15 ms on the development machine, a copy into memory
    touched before 0.85 ms, and with host optimizer state those clones were
    about half of `step()` for 8 x Linear(1024, 1024), parameters streaming.
    So the copies' buffers outlive the round (committed or rolled back) and the
    next round copies into them: the copy of the host state is held between
    steps too, where the round holds it anyway at its end."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        free = self._free.get((t.numel(), t.dtype))
        out = free.pop() if free else torch.empty(t.numel(), dtype=t.dtype)
        return out.view(t.shape).copy_(t)

    def copy_moment(self, m: Moment) -> Moment:
        return Moment(self.copy(m.data), None if m.scale is None else self.copy(m.scale),
                      m.kind)

    def give(self, *copies: torch.Tensor | Moment | None) -> None:
        """Takes back the buffers of copies no longer needed."""
        for c in copies:
            for t in (c.data, c.scale) if isinstance(c, Moment) else (c,):
                if t is not None:
                    self._free.setdefault((t.numel(), t.dtype), []).append(t.reshape(-1))
