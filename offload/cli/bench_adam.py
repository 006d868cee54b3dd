"""`offload bench adam`: the CPU Adam update against torch, DeepSpeed and a memory stream.

Every implementation updates the same fp32 arrays of `--elements` elements
(offload's own moments aside), once per round, in interleaved order (A B A B)
so drift of the machine hits every row alike; rows report the median.

The memory-stream reference is a streaming in-place kernel over the same
arrays (p += a*g, m += a*v, v *= 1: 32 bytes per element in three torch passes,
no write-allocate since every line written was just read): its bytes per second
divided by the 28 bytes per element an fp32 Adam step moves (reads p, g, m, v;
writes p, m, v). It takes the fastest round, the rows the median. It is a
reference, not a bound: a one-pass kernel moves bytes faster than three torch
passes do, and rows above 1.0x of it were measured.

Rows "offload+bf16" / "+fp16" write the compute-dtype parameter in the same
pass (the engine's mixed-precision step); "bf16 moments" / "int8 moments" keep
the moments compressed (`optim.state_dtype`), decoded and encoded in the pass;
"offload int8 moments, new master apart" reads the fp32 parameter as the master
and writes the new one to a second buffer, as the engine's fp32 step does while
it keeps the old version until the step commits.
Where torchao or bitsandbytes import, their 8-bit AdamW runs as a peer.
Where the native kernel is built (offload/optim/native.py), the "offload" rows
run it (the plain fp32 row: torch's fused kernel, which "auto" keeps there),
rows marked "(torch kernels)" run the same steps on torch's, "offload fp32
(native kernel)" the plain fp32 step on the native one, and "native+bf16, one
call per thread" the bf16-parameter update as one native call per thread
(`NativeAdam.claimer`, no optimizer around it). Each row starts after a pause
(`SETTLE_S`), on cores no earlier row's threads still spin on.
`--busy` runs every row a second time with a CPU-bound process beside it (one
spinning process), as on a host shared with a data loader.

`--nvme PATH` also runs the step with the state on NVMe under PATH and
compares its time with max(bytes moved / disk bandwidth, in-memory update
time), the disk bandwidth measured in the same run with the io engine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import torch

from ..config import IoConfig, OptimConfig, format_bytes, parse_bytes
from ..files import existing_ancestor
from ..io import BufferPool, make_engine, open_swap
from ..optim import CpuAdam, fused_status
from ..optim.native import native_status
from ..optim.state import state_bytes as optim_state_bytes
from .args import (CommandParser, UsageError, byte_size, count, directory, integer,
                   missing_directories, parse_count, remove_directories, run_command, table_console)
from .benchutil import check_memory, emit, progress_printer

ADAM_BYTES = 28     # fp32 bytes an Adam step moves per element (16 read, 12 written)
STREAM_BYTES = 32   # bytes per element of the reference's streaming kernel
MEMORY_PER_ELEM = 56  # host bytes per element the rows hold at once (54 measured)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
# Seconds between rows. After a parallel region, torch's OpenMP threads spin for a
# while before they sleep (libgomp: about 5 ms of a core, measured here), taking a
# core from whatever runs next: without a pause the row after a torch row ran
# 0.75x as fast as after one of ours. Each row starts on idle cores instead.
SETTLE_S = 0.02


def _torch_opt(p: torch.nn.Parameter, m: torch.Tensor, v: torch.Tensor, **kw) -> Callable:
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    # Share the moments: no extra memory, the same bytes touched as everyone else.
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    return opt.step


def _impls(n: int, args: argparse.Namespace, notes: list[str]) -> dict[str, Callable]:
    g = torch.randn(n)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = g
    m, v = torch.zeros(n), torch.rand(n)
    def cpu_adam(state_dtype: str = "fp32", kernel: str = "auto", **kw) -> CpuAdam:
        opt = CpuAdam(OptimConfig(lr=LR, betas=list(BETAS), eps=EPS, weight_decay=WD,
                                  block_elems=args.block_elems, state_dtype=state_dtype,
                                  kernel=kernel))
        opt.add_partition("x", p.data, exp_avg=m, exp_avg_sq=v, **kw)
        return opt
    ours = cpu_adam()
    small = {k: cpu_adam(k) for k in ("bf16", "int8")}  # moments encoded from m, v
    # the fp32 parameter as the master, the new one written to a second buffer: the
    # engine's step in fp32 training, which keeps the old version until the commit
    into = cpu_adam("int8", master_is_param=True)
    staged = torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.float16)
    step_t = torch.tensor(0.0)

    def fused_direct() -> None:
        step_t.add_(1)
        torch._fused_adamw_([p.data], [g], [m], [v], [], [step_t], lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False,
                            maximize=False)

    def stream() -> None:
        p.data.add_(g, alpha=1e-30)
        m.add_(v, alpha=1e-30)
        v.mul_(1.0)

    # final=True: no copy of the previous state, as the engine's host-state step
    impls = {"offload": lambda: ours.step({"x": g}, final=True),
             "offload+bf16": lambda: ours.step({"x": g}, params_out={"x": out}, final=True),
             "offload+fp16": lambda: ours.step({"x": g}, params_out={"x": out16}, final=True),
             "offload bf16 moments": lambda: small["bf16"].step({"x": g}, final=True),
             "offload int8 moments": lambda: small["int8"].step({"x": g}, final=True),
             "offload int8 moments+bf16": lambda: small["int8"].step(
                 {"x": g}, params_out={"x": out}, final=True),
             "offload int8 moments, new master apart": lambda: into.step(
                 {"x": g}, params_out={"x": staged}, masters={"x": p.data}, final=True),
             "torch AdamW fused": _torch_opt(p, m, v, fused=True),
             "torch AdamW foreach": _torch_opt(p, m, v, foreach=True),
             "torch._fused_adamw_": fused_direct,
             "bound": stream}
    native, why_native = native_status()
    if native:
        # the native kernel's gain: the same steps on torch's kernels, and the plain
        # fp32 step (torch's fused kernel under "auto") on the native one
        tk = {k: cpu_adam(k, kernel="fused" if fused_status()[0] else "foreach")
              for k in ("fp32", "int8")}
        nat = cpu_adam(kernel="native")
        impls.update({
            "offload fp32 (native kernel)": lambda: nat.step({"x": g}, final=True),
            "native+bf16, one call per thread": _claimed(p.data, g, m, v, out),
            "offload+bf16 (torch kernels)": lambda: tk["fp32"].step(
                {"x": g}, params_out={"x": out}, final=True),
            "offload int8 moments (torch kernels)": lambda: tk["int8"].step({"x": g}, final=True)})
    else:
        notes.append(f"offload runs torch's kernels: {why_native}")
    ok, why = fused_status()
    if not ok:
        notes.append(f"offload's torch rows run torch._foreach_* math: {why}")
        del impls["torch AdamW fused"], impls["torch._fused_adamw_"]
    try:
        # DeepSpeed logs to stdout while it loads and builds; keep stdout for --json
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            ds = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                  adamw_mode=True)
        impls["DeepSpeedCPUAdam"] = ds.step
    except Exception as e:  # ImportError, or its C++ extension failing to build
        notes.append(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {e}")
    impls.update(_peers_8bit(n, notes))
    return impls


def _claimed(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor) -> Callable:
    """The bf16-parameter update as one native call per thread (`NativeAdam.claimer`:
    the threads claim units of the chunk inside C), against the "offload+bf16" row's
    one call per cache block from blocks.py's workers: the kernel alone, no
    optimizer around it (its step count stays at 1)."""
    from ..optim import AdamHyper
    from ..optim.codec import Moment
    from ..optim.native import NativeAdam

    kernel = NativeAdam()
    hyper = AdamHyper(LR, BETAS[0], BETAS[1], EPS, WD, True)
    ma, va = Moment(m, None, "exp_avg"), Moment(v, None, "exp_avg_sq")

    def step() -> None:
        job = kernel.claimer(p, g, ma, va, out, 1.0, [(0, p.numel(), hyper, 0)])
        threads = [threading.Thread(target=job) for _ in range(torch.get_num_threads())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return step


def _peers_8bit(n: int, notes: list[str]) -> dict[str, Callable]:
    """torchao's and bitsandbytes' 8-bit AdamW on their own copy, where they import."""
    out = {}
    for name, load in (("torchao AdamW8bit", lambda: __import__("torchao.optim").optim.AdamW8bit),
                       ("bitsandbytes AdamW8bit", lambda: __import__(
                           "bitsandbytes").optim.AdamW8bit)):
        try:
            with contextlib.redirect_stdout(sys.stderr):
                cls = load()
                q = torch.nn.Parameter(torch.randn(n))
                q.grad = torch.randn(n)
                kw = {"min_8bit_size": 0} if name.startswith("bitsandbytes") else {}
                opt = cls([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
                t = time.perf_counter()
                opt.step()  # torchao compiles its kernel here
                notes.append(f"{name}: first step {time.perf_counter() - t:.1f} s")
            out[name] = opt.step
        except Exception as e:  # not installed, or no CPU kernel
            notes.append(f"{name} skipped: {type(e).__name__}: {str(e)[:120]}")
    return out


@contextlib.contextmanager
def _busy_process():
    """One CPU-bound process beside the benchmark while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()


def _interleaved(impls: dict[str, Callable], rounds: int, progress) -> dict[str, list[float]]:
    for fn in impls.values():  # warm-up: page faults, lazy state, thread pools
        fn()
    times: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(rounds):
        for name, fn in impls.items():
            time.sleep(SETTLE_S)  # the previous row's idle OpenMP threads stop spinning
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            if progress:
                progress(f"round {r + 1}/{rounds}: {name} {times[name][-1] * 1e3:.1f} ms")
    return times


class _Disk:
    """Times, through the io engine with O_DIRECT, a write of `nbytes`, a read of
    `nbytes`, and both at once (what a pipelined step asks of the device)."""

    def __init__(self, engine, path: str, nbytes: int, pool: BufferPool) -> None:
        self.engine, self.n = engine, max(4096, nbytes // 4096 * 4096)
        self.buf = pool.alloc(2 * self.n, tag="bench-disk")
        self.buf.tensor[:] = torch.randint(0, 256, (self.buf.capacity,), dtype=torch.uint8)
        self.path = os.path.join(path, "offload-bench-adam-disk.dat")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT
                          | (os.O_DIRECT if engine.direct else 0), 0o600)
        os.posix_fallocate(self.fd, 0, 2 * self.n)
        self._write(self.n).wait()  # the region the reads come from holds data

    def _write(self, at: int):
        return self.engine.write(self.fd, self.path, at, self.buf.address, self.n,
                                 keepalive=self.buf)

    def _read(self):
        return self.engine.read(self.fd, self.path, self.n, self.buf.address + self.n, self.n,
                                keepalive=self.buf)

    def measure(self) -> tuple[float, float, float]:
        """(write, read, both at once) seconds."""
        out = []
        for start in (lambda: [self._write(0)], lambda: [self._read()],
                      lambda: [self._write(0), self._read()]):
            t = time.perf_counter()
            for h in start():
                h.wait()
            out.append(time.perf_counter() - t)
        return out[0], out[1], out[2]

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.buf.release()


def _nvme_bounds(state_bytes: int, t_mem: float, step: float, wbw: float, rbw: float,
                 mbw: float) -> dict:
    """The NVMe step against its bound; `state_bytes` each way, bandwidths in bytes/s.

    The bound is max(the reads alone at the read rate, the writes alone at the write
    rate, the in-memory update): no schedule is faster, as a disk that served both
    directions at full speed at once would take the slower stream's time. Two
    references are reported beside it, neither a bound: the read and write times
    added (a device that serves one direction at a time; reads and writes issued
    together beat it here), and both at the rate the device gave them issued
    together (as the pipeline issues them)."""
    io_serial = state_bytes / rbw + state_bytes / wbw
    io_mixed = 2 * state_bytes / mbw
    io_bound = max(state_bytes / rbw, state_bytes / wbw)
    bound = max(io_bound, t_mem)
    return {"disk_write_GBps": wbw / 1e9, "disk_read_GBps": rbw / 1e9,
            "disk_mixed_GBps": mbw / 1e9, "bytes_read": state_bytes,
            "bytes_written": state_bytes, "io_bound_s": io_bound, "io_mixed_s": io_mixed,
            "io_serial_s": io_serial, "memory_update_s": t_mem, "step_s": step,
            "bound_s": bound, "step_over_bound": step / bound,
            "step_over_mixed": step / max(io_mixed, t_mem),
            "step_over_serial": step / max(io_serial, t_mem)}


def _nvme(path: str, n: int, args: argparse.Namespace, t_mem: float, progress) -> dict:
    """State on NVMe: step time against the disk, measured in the same rounds (A B A B)."""
    os.makedirs(path, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".offload-bench-adam-", dir=path)
    io_cfg = IoConfig(paths=[work], buffer_budget=parse_bytes(args.buffer_budget,
                                                              "--buffer-budget"))
    engine = make_engine(io_cfg)
    pool = BufferPool(io_cfg.buffer_budget)
    swap = open_swap(io_cfg, "bench-optim", engine)
    disk = None
    try:
        cfg = OptimConfig(lr=LR, betas=list(BETAS), eps=EPS, weight_decay=WD,
                          chunk_elems=args.chunk_elems, buffers=args.buffers,
                          block_elems=args.block_elems, state_dtype=args.state_dtype)
        opt = CpuAdam(cfg, swap=swap, pool=pool)
        g = torch.randn(n)
        opt.add_partition("x", torch.randn(n), tier="nvme")
        opt.step({"x": g})  # warm-up: maps and faults in the pipeline's buffers
        state_bytes = optim_state_bytes(n, 3, args.state_dtype)
        free = io_cfg.buffer_budget - pool.stats().held_bytes - 8192
        disk = _Disk(engine, work, min(state_bytes, free // 2), pool)
        steps, writes, reads, mixed = [], [], [], []
        for r in range(args.rounds):
            w, rd, both = disk.measure()
            writes.append(disk.n / w)
            reads.append(disk.n / rd)
            mixed.append(2 * disk.n / both)
            steps.append(opt.step({"x": g}).seconds)
            if progress:
                progress(f"nvme round {r + 1}/{args.rounds}: step {steps[-1]:.3f} s, disk write "
                         f"{writes[-1] / 1e9:.2f} GB/s, read {reads[-1] / 1e9:.2f} GB/s, both "
                         f"at once {mixed[-1] / 1e9:.2f} GB/s")
        opt.close()
        wbw, rbw, mbw, step = (statistics.median(x) for x in (writes, reads, mixed, steps))
        return {"path": os.path.abspath(path), "engine": engine.name,
                "chunk_elems": opt.chunk_elems, "buffers": cfg.buffers,
                "state_dtype": args.state_dtype,
                **_nvme_bounds(state_bytes, t_mem, step, wbw, rbw, mbw)}
    finally:
        if disk is not None:
            disk.close()
        swap.close()
        pool.close(force=True)
        engine.close()
        shutil.rmtree(work, ignore_errors=True)


def _rows(times: dict[str, list[float]], n: int) -> tuple[list[dict], float]:
    """(one row per implementation: medians, rate, fraction of the bound and of the
    fp32 "offload" row; the streaming kernel's GB/s)."""
    med = {k: statistics.median(t) for k, t in times.items()}
    med["bound"] = min(times["bound"])  # the best the memory stream gave, not the typical
    bound = STREAM_BYTES * n / med["bound"] / ADAM_BYTES / 1e9
    results = []
    for name, s in med.items():
        if name == "bound":
            continue
        rate = n / s / 1e9
        results.append({"impl": name, "Gelem_per_s": rate, "seconds": s,
                        "fraction_of_stream": rate / bound, "vs_fp32": med["offload"] / s})
    results.append({"impl": "memory-stream reference", "Gelem_per_s": bound,
                    "seconds": ADAM_BYTES * n / (STREAM_BYTES * n / med["bound"]),
                    "fraction_of_stream": 1.0, "vs_fp32": med["offload"] / (
                        ADAM_BYTES * n / (STREAM_BYTES * n / med["bound"]))})
    return results, STREAM_BYTES * n / med["bound"] / 1e9


# the in-memory row whose update the NVMe step runs, by optim.state_dtype
IN_MEMORY = {"fp32": "offload", "bf16": "offload bf16 moments", "int8": "offload int8 moments"}


def run_adam_bench(args: argparse.Namespace, progress=None) -> dict:
    """Runs the benchmark; returns the JSON-ready result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    n = parse_count(str(args.elements))
    if n is None or n < 1 or args.rounds < 1:
        raise UsageError("--elements and --rounds must be positive; give e.g. --elements 20M")
    # every row's arrays at once (parameter, gradient, moments, their bf16 and int8
    # forms, the outputs): about 54 bytes per element, measured
    check_memory("offload bench adam", "--elements", str(args.elements), MEMORY_PER_ELEM * n)
    if args.nvme:
        _check_nvme_room(args.nvme, n, args.state_dtype)
    notes: list[str] = []
    impls = _impls(n, args, notes)
    times = _interleaved(impls, args.rounds, progress)
    results, stream = _rows(times, n)
    out = {"benchmark": "adam", "elements": n, "rounds": args.rounds,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "stream_GBps": stream, "adam_bytes_per_elem": ADAM_BYTES,
           "results": results, "notes": notes}
    if args.busy:
        with _busy_process():
            out["busy_results"] = _rows(_interleaved(impls, args.rounds, progress), n)[0]
    med = {k: statistics.median(t) for k, t in times.items()}
    if args.nvme:
        made = missing_directories(args.nvme)
        try:
            # the in-memory update of the moments' form the NVMe step runs (fp32: "offload")
            out["nvme"] = _nvme(args.nvme, n, args, med[IN_MEMORY[args.state_dtype]], progress)
        except OSError as e:  # the disk refused the state: full, quota, file-size limit
            raise SystemExit(f"offload bench adam: --nvme: {' '.join(str(e).split())}; give "
                             "--nvme on a disk with room for the state, or lower --elements"
                             ) from None
        finally:
            remove_directories(made)
    return out


def _check_nvme_room(path: str, n: int, state_dtype: str) -> None:
    """Refuses an --nvme whose disk cannot hold the state and the disk probe (at most as
    large) before any row runs: one line, exit code 1 (a condition of the machine)."""
    need = 2 * optim_state_bytes(n, 3, state_dtype)
    free = shutil.disk_usage(existing_ancestor(path)).free
    if need > free:
        raise SystemExit(f"offload bench adam: --nvme: {path} has {format_bytes(free)} free, "
                         f"the state on NVMe and the disk probe need about "
                         f"{format_bytes(need)}; lower --elements or give --nvme on a bigger "
                         "disk")


def render(result: dict) -> None:
    """Prints the result as a rich table."""
    from rich.table import Table

    con = table_console()
    t = Table(title=f"offload bench adam: {result['elements']:,} fp32 elements, "
                    f"{result['threads']} threads, median of {result['rounds']} interleaved rounds")
    busy = {r["impl"]: r for r in result.get("busy_results", [])}
    cols = ["implementation", "Gelem/s", "ms/step", "x stream", "x offload fp32"]
    if busy:
        cols += ["busy Gelem/s", "busy x offload fp32"]
    for col in cols:
        t.add_column(col, justify="left" if col == "implementation" else "right")
    for r in result["results"]:
        row = [r["impl"], f"{r['Gelem_per_s']:.3f}", f"{r['seconds'] * 1e3:.1f}",
               f"{r['fraction_of_stream']:.2f}", f"{r['vs_fp32']:.2f}"]
        if busy:
            b = busy[r["impl"]]
            row += [f"{b['Gelem_per_s']:.3f}", f"{b['vs_fp32']:.2f}"]
        t.add_row(*row)
    con.print(t)
    con.print(f"streaming kernel: {result['stream_GBps']:.1f} GB/s; Adam moves "
              f"{result['adam_bytes_per_elem']} B/element")
    nv = result.get("nvme")
    if nv:
        con.print(f"NVMe ({nv['engine']}, {nv['state_dtype']} moments, chunk "
                  f"{nv['chunk_elems']} elements x {nv['buffers']} buffers): step "
                  f"{nv['step_s']:.3f} s; disk write {nv['disk_write_GBps']:.2f} GB/s, read "
                  f"{nv['disk_read_GBps']:.2f} GB/s -> I/O bound {nv['io_bound_s']:.3f} s "
                  f"(the slower direction alone); in-memory update "
                  f"{nv['memory_update_s']:.3f} s; step / max(I/O, memory) = "
                  f"{nv['step_over_bound']:.2f}. References, not bounds: reads and writes "
                  f"issued together ran at {nv['disk_mixed_GBps']:.2f} GB/s "
                  f"({nv['io_mixed_s']:.3f} s, step / that = {nv['step_over_mixed']:.2f}); "
                  f"one after the other they take {nv['io_serial_s']:.3f} s (step / that = "
                  f"{nv['step_over_serial']:.2f})")
    for note in result["notes"]:
        con.print(f"note: {note}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--elements", default="100M", type=count(1, example="20M"),
                   help="fp32 elements of the partition (default 100M; e.g. 20M for a quick run)")
    p.add_argument("--rounds", type=integer(1, example=3), default=3,
                   help="interleaved rounds (default 3)")
    p.add_argument("--nvme", metavar="PATH", default=None,
                   type=directory("directory on the NVMe disk"), help="also run with the state "
                   "on NVMe under directory PATH, against the disk bandwidth measured there")
    p.add_argument("--chunk-elems", type=integer(0, multiple=1024, example=4194304), default=0,
                   help="elements per NVMe chunk, a multiple of 1024 (default 0: derived from "
                   "--buffer-budget)")
    p.add_argument("--buffers", type=integer(1, 16, example=3), default=3,
                   help="pipeline buffers, 1..16 (default 3)")
    p.add_argument("--buffer-budget", default="1GiB", type=byte_size(IoConfig().block_size,
                                                                     example="1GiB"),
                   help="host staging budget, at least one I/O block (default 1GiB)")
    p.add_argument("--block-elems", type=integer(1024, example=1048576),
                   default=OptimConfig().block_elems,
                   help="elements per update-kernel call, at least 1024 (default "
                   f"{OptimConfig().block_elems})")
    p.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="form of the moments in the --nvme run, optim.state_dtype "
                   "(default fp32)")
    p.add_argument("--busy", action="store_true", help="run every row again with a "
                   "CPU-bound process beside it")
    p.add_argument("--threads", type=integer(0, example=4), default=0,
                   help="torch threads (default: torch's)")
    p.add_argument("--convergence", action="store_true", help="instead: train the demo's task "
                   "with each moment form and compare final losses with fp32's "
                   "(see bench_convergence.py)")
    p.add_argument("--steps", type=integer(21, example=300), default=300,
                   help="--convergence: steps per run (default 300)")
    p.add_argument("--seeds", type=integer(1, example=3), default=3,
                   help="--convergence: seeds per model and form (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.convergence:
        from . import bench_convergence as conv

        if args.threads:
            torch.set_num_threads(args.threads)
        return emit(conv.run_convergence(args.steps, args.seeds, ("bf16", "int8"),
                                         progress_printer(args.json)), args.json, conv.render)
    return emit(run_adam_bench(args, progress_printer(args.json)), args.json, render)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench adam", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
