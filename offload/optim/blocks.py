"""The update of one chunk, cache block by cache block, on a few worker threads.

[Note: blocks on worker threads]
The update streams the master, gradient and moments once through memory and,
in the same pass, writes the compute-dtype parameter and decodes / encodes
compressed moments (codec.py) while each block is in cache. Run as a loop of
small torch calls, each spreading its block over the OpenMP team, it pays one
team barrier per call: a few per block, thousands per step. Measured on two
cores (`offload bench adam`), that made the bf16-parameter path 0.7-0.8x the
fp32 one when quiet and 0.16x beside a CPU-bound process, where every barrier
waits for the thread the scheduler parked.

So blocks go to `threads` worker threads instead (torch's intra-op thread
count), each running its blocks' calls single-threaded (its own OpenMP team
set to one by `torch.set_num_threads(1)` in the thread; the process-wide
count that call also sets is put back, see `_start`) and claiming the next
block from a shared counter when done.
A thread that loses its core claims fewer blocks; nobody waits for it until
the chunk's end. Workers start on the first update that has several blocks
and end after `IDLE_EXIT_S` without work (or at `close`). Each worker owns its kernel and fp32 scratch (a block of each
moment, plus one for encoding), so blocks need no locks. `block_elems`
(`optim.block_elems`, capped so every thread's working set fits the L3 together)
is a multiple of `codec.QBLOCK`, so compressed blocks never straddle two calls.
bf16 moments go back run by run, rounded stochastically with the run's update
count (codec.py, [Note: stochastic rounding]): the bits of the native kernel.
int8 codes go back block by block, each element a run updated rounded
stochastically with that run's offsets (`codec.int8_offsets`), the others to
nearest.
Where nothing rides on the pass (fp32 moments, no compute-dtype copy, no
gradient divisor, one run), torch's fused kernel takes the whole chunk in one
call.

With the native kernel (native.py, [Note: native kernel]), the default where
it is built, a block is one C call that does all of it in one pass; the same
threads run it (ctypes releases the GIL), and no fp32 scratch is needed. The
plain fp32 update still goes to torch's fused kernel in one call under
`optim.kernel = "auto"` (as fast or faster there, measured).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from typing import Callable

import torch

from ..io.process import usable_cpus
from .adam import AdamHyper, AdamKernel, KernelName, fused_status
from .codec import (NEAREST, QBLOCK, Moment, bound_first_moment, decode, encode,
                    encode_stochastic, int8_offsets, moment_bound, rounding_hash)
from .native import NativeAdam, native_status

log = logging.getLogger(__name__)

__all__ = ["BlockUpdater", "Run"]

Run = tuple[int, int, "AdamHyper | None", int]  # first element, elements, hyper or None, step
MAX_THREAD_BLOCK = 1 << 19  # elements per block and thread: ~11 MiB (~15 with int8 moments)
IDLE_EXIT_S = 5.0  # a worker idle this long ends (an optimizer never closed keeps no threads)
_OPEN: "weakref.WeakSet[BlockUpdater]" = weakref.WeakSet()  # [Note: workers at exit]


class _Worker:
    """One thread's torch kernel and scratch (none where the native kernel runs)."""

    def __init__(self, kernel: KernelName, block: int, native: bool) -> None:
        self.kernel = None if native else AdamKernel(kernel, block)
        size = 0 if native else block
        self.m = torch.empty(size, dtype=torch.float32)
        self.v = torch.empty(size, dtype=torch.float32)
        self.tmp = torch.empty(size, dtype=torch.float32)
        self.size = size
        self._offsets: tuple[torch.Tensor, torch.Tensor] | None = None

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the int8 codes' offsets of both moments, made at first use (the
        other forms need none)."""
        if self._offsets is None:
            self._offsets = (torch.empty(self.size, dtype=torch.float32),
                             torch.empty(self.size, dtype=torch.float32))
        return self._offsets


def _native_for(kernel: KernelName | str) -> NativeAdam | None:
    """The native kernel where `kernel` asks for it ("native") or leaves the choice
    ("auto") and it loads; None for torch's kernels."""
    if kernel not in ("auto", "native"):
        return None
    ok, why = native_status()
    if ok:
        return NativeAdam()
    if kernel == "native":
        raise RuntimeError(f"optim kernel 'native' asked for, but {why}")
    return None  # (native_status logged why, once)


class BlockUpdater:
    """Runs `update` over cache blocks on `threads` workers ([Note: blocks on worker
    threads]). Calls must not overlap (the optimizer's lock serialises them). `threads`
    defaults to torch's intra-op count, lowered to a container's CPU quota, which
    torch does not follow (`usable_cpus`)."""

    def __init__(self, kernel: KernelName = "auto", block_elems: int = 1 << 20,
                 threads: int | None = None) -> None:
        self.threads = max(1, threads or min(torch.get_num_threads(), usable_cpus()))
        blk = min(block_elems, MAX_THREAD_BLOCK) if self.threads > 1 else block_elems
        self.block = max(QBLOCK, blk // QBLOCK * QBLOCK)
        self.native = _native_for(kernel)
        self.kernel = "auto" if kernel == "native" else kernel
        self._main = self._worker()
        self.impl = "native" if self.native else self._main.kernel.impl
        # The plain fp32 update (nothing rides on the pass) stays one call of torch's
        # fused kernel where torch has one: the native kernel measured no faster
        # there, and slower beside a busy process (docs/optim.md).
        self._whole = None
        if self.impl == "fused":
            self._whole = self._main.kernel
        elif self.native is not None and kernel == "auto" and fused_status()[0]:
            self._whole = AdamKernel("fused", 1)  # whole-tensor calls use no scratch
        self._pool: list[threading.Thread] = []
        self._go = threading.Condition()
        self._job: tuple[int, Callable[[_Worker], None]] | None = None
        self._gen = 0
        self._left = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._pid = os.getpid()
        _OPEN.add(self)

    def _worker(self) -> _Worker:
        return _Worker(self.kernel, self.block, self.native is not None)

    # -- the pool ------------------------------------------------------------------
    def _loop(self, seen: int, ready: threading.Event) -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team: itself
        ready.set()
        w = None
        while True:
            with self._go:
                while self._gen == seen and not self._closed:
                    if not self._go.wait(IDLE_EXIT_S) and self._gen == seen:
                        # idle: end, with the scratch (a later update starts threads again;
                        # a close() that took the pool as the wait ran out has it already)
                        if threading.current_thread() in self._pool:
                            self._pool.remove(threading.current_thread())
                        return
                if self._closed:
                    return
                seen, (_, job) = self._gen, self._job
            try:
                w = w or self._worker()
                job(w)
            except BaseException as e:  # reported by the caller of `_each`
                with self._go:
                    self._errors.append(e)
            with self._go:
                self._left -= 1
                self._go.notify_all()

    def _each(self, job: Callable[[_Worker], None]) -> None:
        """Runs `job(worker)` once on every worker thread and waits for all."""
        with self._go:
            self._check_open()  # its workers would return at once, and this wait for good
            if len(self._pool) < self.threads:  # (re)started: none, or some ended idle
                self._start()
            self._errors = []
            self._left = self.threads
            self._gen += 1
            self._job = (self._gen, job)
            self._go.notify_all()
            while self._left:
                self._go.wait()
            if self._errors:
                raise self._errors[0]

    def _start(self) -> None:
        """Starts the missing workers. torch.set_num_threads, which each calls for
        itself, also sets the count that threads started later begin with, process
        wide: the caller's count is put back once they have set theirs."""
        mine = torch.get_num_threads()
        ready = []
        while len(self._pool) < self.threads:
            ready.append(threading.Event())
            t = threading.Thread(target=self._loop, args=(self._gen, ready[-1]), daemon=True,
                                 name=f"offload-adam-{len(self._pool)}")
            self._pool.append(t)
            t.start()
        for ev in ready:
            ev.wait()
        torch.set_num_threads(mine)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the optimizer's update threads are closed (close() ran, or "
                               "the interpreter is exiting)")

    def close(self) -> None:
        with self._go:
            self._closed = True
            self._go.notify_all()
            pool, self._pool = self._pool, []
        for t in pool:
            t.join()
        _OPEN.discard(self)

    # -- the update ----------------------------------------------------------------
    def update(self, runs: list[Run], base: int, master: torch.Tensor, grad: torch.Tensor,
               exp_avg: Moment, exp_avg_sq: Moment, out: torch.Tensor | None,
               grad_scale: float, src: torch.Tensor | None = None, *, origin: int = 0) -> None:
        """Elements [base, base + n) of a partition: `master`, `exp_avg`, `exp_avg_sq`
        and `out` (the compute-dtype copy, or None) are their views (n elements,
        base a multiple of QBLOCK where the moments are int8), `grad` the whole
        partition's gradient. `runs`: (first element, elements, hyper-parameters or
        None to leave alone, update count) in partition coordinates. `src`: the
        master's current values where they are not in `master` (n elements, read
        only; `master` receives the new ones): the native kernel reads them tile by
        tile as it goes, the other paths copy them into `master` first. `origin`: the
        index of the partition's element 0 in bf16 moments' rounding."""
        self._check_open()
        n = master.numel()
        nb = -(-n // self.block)
        if src is not None and self.native is None:
            master.copy_(src)
            src = None
        if (out is None and grad_scale == 1.0 and exp_avg.scale is None and src is None
                and exp_avg.data.dtype == torch.float32 and self._whole is not None
                and len(runs) == 1 and runs[0][2] is not None
                and runs[0][0] <= base and runs[0][0] + runs[0][1] >= base + n):
            nb = 1  # nothing rides on the pass: one fused call, one parallel region
            self._whole.update(master, grad[base:base + n], exp_avg.data,
                               exp_avg_sq.data, step=runs[0][3] + 1, hyper=runs[0][2])
            return

        if self.native is not None and nb > 1 and self.threads > 1:
            # one C call per thread claiming units from a counter inside the kernel: no
            # return to Python (and the GIL) between blocks ([Note: native kernel])
            todo = [(max(a, base) - base, min(a + k, base + n) - base, h, st)
                    for a, k, h, st in runs if max(a, base) < min(a + k, base + n)]
            claim = self.native.claimer(master, grad[base:base + n], exp_avg, exp_avg_sq,
                                        out, grad_scale, todo, first=origin + base, src=src)
            self._each(lambda w: claim())
            return

        def block(w: _Worker, b: int) -> None:
            lo = b * self.block
            hi = min(n, lo + self.block)
            self._block(w, runs, base, lo, hi, master, grad, exp_avg, exp_avg_sq, out,
                        grad_scale, src, origin)
        if nb <= 1 or self.threads == 1:
            for b in range(nb):
                block(self._main, b)
            return
        claim = itertools.count()

        def job(w: _Worker) -> None:
            for b in iter(lambda: next(claim), None):
                if b >= nb:
                    return
                block(w, b)
        self._each(job)

    def _block(self, w: _Worker, runs: list[Run], base: int, lo: int, hi: int,
               master: torch.Tensor, grad: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment,
               out: torch.Tensor | None, grad_scale: float,
               src: torch.Tensor | None = None, origin: int = 0) -> None:
        """One cache block [lo, hi) of the chunk: decode, update each run, encode
        (`src`, native kernel only, and `origin`: as in `update`)."""
        todo = [(max(a, base + lo), min(a + k, base + hi), h, st) for a, k, h, st in runs
                if max(a, base + lo) < min(a + k, base + hi)]
        if self.native is not None:
            at = base + lo
            self.native.block(master[lo:hi], grad[at:base + hi], exp_avg[lo:hi],
                              exp_avg_sq[lo:hi], None if out is None else out[lo:hi],
                              grad_scale, [(i - at, j - at, h, st) for i, j, h, st in todo],
                              first=origin + at, src=None if src is None else src[lo:hi])
            return
        ma, va = exp_avg[lo:hi], exp_avg_sq[lo:hi]
        coded = ma.data.dtype != torch.float32
        bf16 = ma.data.dtype == torch.bfloat16
        busy = any(h is not None for _, _, h, _ in todo)
        if coded and busy:
            m = decode(ma, w.m[:hi - lo])
            v = decode(va, w.v[:hi - lo])
        else:
            m, v = ma.data, va.data
        int8 = coded and busy and not bf16
        if int8:  # elements no run updates round to nearest ([Note: stochastic rounding])
            rm, rv = (t[:hi - lo].fill_(NEAREST) for t in w.offsets())
            root = decode(va, w.tmp[:hi - lo], squared=False)  # encode's scratch, later
        for i, j, hyper, step in todo:
            x, y = i - base, j - base  # chunk coordinates
            p = master[x:y]
            o = None if out is None else out[x:y]
            if hyper is None:  # no gradient: left as it is, as torch leaves it
                if o is not None:
                    o.copy_(p)
                continue
            if int8:  # [Note: the first moment's bound] in codec.py
                bound_first_moment(m[x - lo:y - lo], root[x - lo:y - lo],
                                   moment_bound(hyper.beta1, hyper.beta2))
            w.kernel.update(p, grad[i:j], m[x - lo:y - lo], v[x - lo:y - lo], step=step + 1,
                            hyper=hyper, grad_scale=grad_scale, param_out=o)
            if not coded:
                continue
            at = origin + i  # the element's place in the model ([Note: stochastic ...])
            h = rounding_hash(at, y - x, step + 1, m.device)  # one hash for both moments
            if bf16:  # the updated elements, rounded stochastically; the rest keep their bits
                for f, mom in ((m, ma), (v, va)):
                    encode_stochastic(f[x - lo:y - lo], mom[x - lo:y - lo], at, step + 1, h)
            else:
                int8_offsets(h, "exp_avg", rm[x - lo:y - lo])
                int8_offsets(h, "exp_avg_sq", rv[x - lo:y - lo])
        if int8:
            encode(m, ma, w.tmp[:hi - lo], rm)
            encode(v, va, w.tmp[:hi - lo], rv)


def _close_open_at_exit() -> None:
    """[Note: workers at exit] A worker that ended while the interpreter shut down
    (its idle wait ran out, its optimizer never closed) freed its scratch tensors
    there: torch's free releases the GIL, and a daemon thread taking it back during
    finalization is ended by an unwind that C++ cannot pass, which aborted the
    process ("terminate called without an active exception", exit code 134; half
    the runs of tests/optim here). At exit, before finalization, every updater still
    open in this process stops its workers and joins them."""
    for updater in list(_OPEN):
        if updater._pid == os.getpid():
            try:
                updater.close()
            except Exception as e:  # noqa: BLE001 - the others still close
                log.warning("stopping the optimizer's update threads at exit failed: %s", e)


atexit.register(_close_open_at_exit)
