"""`offload bench oversized`: train a model whose training state is at least twice
this machine's RAM, and show what it costs.

The model is the demo's GPT-style decoder (offload/cli/gpt.py) with d_model
`--d-model` (default 2048: the largest Linear stays ~17M parameters, so what the
engine holds outside its budgets while one group is gathered stays small) and as
many layers as `--params` asks; `auto` picks twice the RAM in training state
(about 3B parameters in bf16 on 24 GiB). It is built on the meta device and
materialised one group at a time straight into its home tier: weights,
gradients, fp32 master weights and Adam moments all live on NVMe, under a
swap directory that is removed on every way out.

Order of work: check the disk has room for the swap files (refuse otherwise);
measure the disk with offload's own I/O engine in the same directory (O_DIRECT,
no fdatasync, as the run writes); build and place the model; run
`--steps` optimizer steps; report

  * peak RSS (VmHWM) while placing the model and while stepping, against the
    host-memory budgets (device tier, which is host memory on a CPU; host tier;
    I/O staging) + 0.5 GiB for the runtime itself;
  * each step's time and NVMe bytes read and written (the store's moves plus
    the optimizer's step results; /proc/self/io beside them);
  * the lower bound of a step: max(R / read rate, W / write rate), where R and
    W are the fewest bytes any system must read and write per step with this
    model and these budgets (`forced_bytes`: the optimizer's state both ways,
    the parameter reads of farthest-next-use eviction byte by byte over the
    forward and backward order with every memory budget (the device tier, a
    GPU's memory too; the host tier; I/O staging, which `bench step` leaves
    out, so this counts fewer) holding parameters, and the
    updated parameters that memory cannot keep), not the run's own bytes; beside
    it (R + W) / mixed rate, the forced bytes at the rate the disk gave reads
    and writes issued together in the same run (the optimizer's chunk size,
    as many in flight each way as its pipeline keeps): a step whose traffic is
    better spread than the probe's can beat that rate, so it is reported, not
    part of the bound. Each step's own bytes at the read and write rates, one
    after the other, are reported too, as before.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import IoConfig, OptimConfig, format_bytes, parse_bytes
from ..io.process import physical_memory
from ..planner import Rates
from ..planner.estimate import DTYPE_BYTES
from ..planner.sizes import state_bytes
from .args import (CommandParser, UsageError, byte_size, count, directory, integer,
                   missing_directories, parse_count, run_command, table_console)
from .benchutil import DiskProbe, forced_param_reads, proc_io, reset_hwm, swap_rates, vm_hwm
from .demo import StepMeter, remove_swap_dir, signal_exit_code, swap_dir_for_run
from .gpt import GPT, GPTConfig, ReversalTask, state_bytes_per_param

GiB = 1 << 30
RSS_SLACK = GiB // 2          # the runtime (torch, Python) beyond the budgets
DIR_PREFIX = "offload-bench-oversized-"
GROW_STEP = 256 << 20
SWAP_FILES = 3                # parameters, gradients, optimizer state


# -- sizes ---------------------------------------------------------------------------------------
def parse_params(text: str, dtype: str) -> int:
    """'auto' (twice the RAM in training state, +5%), or '200M', '3B', '3e9'."""
    if text == "auto":
        return int(2 * physical_memory() / state_bytes_per_param(dtype) * 1.05)
    n = parse_count(text)
    if n is None or n < 1:
        raise UsageError(f"--params: {text!r} is not a count; give 'auto' or a count such as "
                         "'3B' or '200M'")
    return n


def model_for(params: int, d_model: int, length: int) -> GPTConfig:
    """The decoder of about `params` parameters at width `d_model` (heads of 128)."""
    base = GPTConfig(n_layer=1, d_model=d_model, n_head=max(1, d_model // 128), vocab=17,
                     max_seq=2 * length)
    per_layer = base.params - (base.vocab + base.max_seq + 2) * d_model
    layers = max(1, round((params - (base.params - per_layer)) / per_layer))
    return GPTConfig(n_layer=layers, d_model=d_model, n_head=base.n_head, vocab=base.vocab,
                     max_seq=base.max_seq)


@dataclass(frozen=True)
class BenchSpec:
    model: GPTConfig
    dtype: str
    steps: int
    batch: int
    length: int
    device_budget: int
    host_budget: int
    io_buffers: int
    swap_root: Path
    probe_bytes: int

    @property
    def budgets(self) -> int:
        """Host memory the configuration allows: host tier, I/O staging and, on a
        machine without a GPU, the device tier (host memory acting as the device)."""
        from ..store.copy import resolve_device

        on_cpu = resolve_device("auto").type == "cpu"
        return self.host_budget + self.io_buffers + (self.device_budget if on_cpu else 0)

    @property
    def memory(self) -> int:
        """Memory the configuration allows to keep parameters in from step to step: the
        host tier, I/O staging and the device tier (a GPU's memory too)."""
        return self.host_budget + self.io_buffers + self.device_budget

    @property
    def state_bytes(self) -> int:
        return self.model.params * state_bytes_per_param(self.dtype)

    def disk_needed(self) -> int:
        """Swap bytes: every kind on NVMe; the second version a step keeps of what it
        updates until it commits as a whole ([Note: all or nothing] in
        offload/engine/step.py: the optimizer's state rewritten to fresh extents,
        the new parameters staged beside the old ones); the preallocation slack
        and the bandwidth probe; +5%."""
        m = self.model
        bpp = state_bytes_per_param(self.dtype)
        second = bpp - 4  # all but the gradient: parameters, master (if any), moments
        need = m.params * (bpp + second) + SWAP_FILES * GROW_STEP + self.probe_bytes
        return int(need * 1.05)

    def config(self, swap_dir: Path) -> dict[str, Any]:
        return {
            "engine": {"dtype": self.dtype, "params": "nvme", "grads": "nvme",
                       "optimizer": "nvme"},
            "optim": {"lr": 1e-4, "weight_decay": 0.0},
            "io": {"paths": [str(swap_dir)], "buffer_budget": self.io_buffers,
                   "grow_step": GROW_STEP},
            "store": {"device_budget": self.device_budget, "host_budget": self.host_budget},
        }


# -- process counters ----------------------------------------------------------------------------
def tune_malloc(threshold: int = 1 << 20) -> bool:
    """Fixes glibc's mmap threshold at `threshold` bytes (and the trim threshold with
    it), so buffers of that size or more go back to the OS when freed. By default
    glibc raises the threshold to the largest block freed so far (up to 32 MiB), and
    the engine's per-use transients (gathered weights, gradients) then stay in the
    heap once freed: at 200M parameters that kept ~0.6 GiB more resident. Returns
    False where mallopt is not available (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and \
            bool(libc.mallopt(m_trim_threshold, threshold))
    except (OSError, AttributeError):
        return False


# -- the disk ------------------------------------------------------------------------------------
def disk_bandwidth(path: Path, nbytes: int, io: dict[str, Any]) -> tuple[float, float]:
    """(read, write) bytes/s of `nbytes` through offload's I/O engine under `path`, in
    64 MiB transfers, four in flight: the engine and O_DIRECT of the run."""
    r = swap_rates(io, nbytes, 64 << 20, GROW_STEP, "bandwidth-probe")
    return r.read_Bps, r.write_Bps


def mixed_bandwidth(path: Path, spec: BenchSpec, io: dict[str, Any]) -> float:
    """Bytes/s of reads and writes issued together under `path` for 3 s: requests of
    the optimizer's chunk size, as many in flight each way as its pipeline keeps."""
    from ..optim import resolve_chunk_elems

    ocfg = OptimConfig()
    kinds = 2 if spec.dtype == "fp32" else 3  # fp32: the parameter is the master
    request = resolve_chunk_elems(ocfg, spec.io_buffers, masters=kinds == 3) * state_bytes(1, kinds)
    probe = DiskProbe(IoConfig(**{**io, "paths": [str(path)]}), str(path),
                      min(spec.probe_bytes, GiB))
    try:
        probe.measure()  # writes the file first: reads of unwritten extents skip the disk
        return probe.measure_mixed(request, ocfg.buffers, seconds=3.0)
    finally:
        probe.close()


def forced_bytes(engine: Any, spec: BenchSpec) -> tuple[int, int]:
    """(R, W): the fewest bytes any system must read and write per step (see the module
    notes): the optimizer's state (fp32 master where distinct, moments) both ways;
    parameter reads of byte-by-byte farthest-next-use eviction over the engine's
    static order of group uses, with every memory budget (`spec.memory`: the GPU's
    too) holding parameters; the updated parameters those budgets cannot keep,
    written. Gradients are not counted: an update may consume each as backward
    produces it."""
    from ..store import footprint

    item = DTYPE_BYTES[spec.dtype]
    kinds = 2 if spec.dtype == "fp32" else 3
    sizes = {g.gid: footprint(g.shard * item) for g in engine.groups}
    reads = forced_param_reads(list(engine.trace.plan or ()), sizes, spec.memory)
    state = sum(state_bytes(g.shard, kinds, OptimConfig().state_dtype)
                for g in engine.groups if g.requires_grad)
    return state + reads, state + max(0, sum(sizes.values()) - spec.memory)


# -- the run -------------------------------------------------------------------------------------
def run_oversized(spec: BenchSpec, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the benchmark (see the module notes); returns the JSON-ready result."""
    notes: list[str] = []
    created = missing_directories(str(spec.swap_root))
    swap_dir = swap_dir_for_run(spec.swap_root, notes, prefix=DIR_PREFIX)
    for note in notes:
        say(note)
    result: dict[str, Any] = {"benchmark": "oversized", "swap_dir": str(swap_dir)}
    try:
        cfg = spec.config(swap_dir)
        say(f"measuring the disk: {format_bytes(spec.probe_bytes)} written and read in {swap_dir}")
        read_bw, write_bw = disk_bandwidth(swap_dir, spec.probe_bytes, cfg["io"])
        mixed_bw = mixed_bandwidth(swap_dir, spec, cfg["io"])
        result.update(read_Bps=read_bw, write_Bps=write_bw, mixed_Bps=mixed_bw)
        say(f"  read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s, both at once "
            f"{mixed_bw / 1e9:.2f} GB/s")
        result.update(_train(spec, cfg, say, Rates(read_bw, write_bw, mixed_bw)))
    finally:
        result["swap_removed"] = remove_swap_dir(swap_dir, created)
    return result


def _train(spec: BenchSpec, cfg: dict[str, Any], say: Callable[[str], None],
           rates: Rates) -> dict[str, Any]:
    from ..engine import initialize

    reset_hwm()
    t0 = time.perf_counter()
    say(f"placing {spec.model.params / 1e9:.2f}B parameters on NVMe, one group at a time")
    last = [0.0]

    def progress(i: int, n: int) -> None:
        if time.perf_counter() - last[0] > 10 or i == n:
            last[0] = time.perf_counter()
            say(f"  group {i}/{n}, {time.perf_counter() - t0:.0f} s, peak RSS "
                f"{format_bytes(vm_hwm())}")
    engine = initialize(lambda: GPT(spec.model), cfg, progress=progress)
    out: dict[str, Any] = {"init_seconds": time.perf_counter() - t0, "init_peak_rss": vm_hwm()}
    try:
        fr, fw = forced_bytes(engine, spec)
        out.update(forced_read=fr, forced_written=fw)
        reset_hwm()
        out["steps"] = _steps(engine, spec, say, rates, (fr, fw))
        out["step_peak_rss"] = vm_hwm()
        out["store_stats"] = engine.store.stats().summary()
    finally:
        engine.close()
    return out


def _steps(engine: Any, spec: BenchSpec, say: Callable[[str], None], rates: Rates,
           forced: tuple[int, int]) -> list[dict[str, Any]]:
    fr, fw = forced
    bound = max(fr / rates.read_Bps, fw / rates.write_Bps)
    mixed = (fr + fw) / rates.mixed_Bps
    task = ReversalTask(spec.model.vocab - 1, spec.length, spec.batch)
    meter = StepMeter(engine)
    rows = []
    for step in range(1, spec.steps + 1):
        io0 = proc_io()
        t = time.perf_counter()
        x, y = task.next_batch()
        loss = ReversalTask.loss(engine(x.to(engine.device)), y)
        t_fwd = time.perf_counter()
        engine.backward(loss)
        t_bwd = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        moved, io1 = meter.step(), proc_io()
        own = moved.read / rates.read_Bps + moved.written / rates.write_Bps
        rows.append({"step": step, "seconds": end - t, "forward_s": t_fwd - t,
                     "backward_s": t_bwd - t_fwd, "optimizer_s": end - t_bwd,
                     "loss": loss.item(), "read": moved.read, "written": moved.written,
                     "proc_read": io1[0] - io0[0], "proc_written": io1[1] - io0[1],
                     "bound_s": bound, "mixed_s": mixed, "own_bytes_s": own,
                     "peak_rss": vm_hwm()})
        say(f"step {step}: {end - t:.1f} s (forward {t_fwd - t:.1f}, backward "
            f"{t_bwd - t_fwd:.1f}, optimizer {end - t_bwd:.1f}), read "
            f"{format_bytes(moved.read)}, written {format_bytes(moved.written)}; bound "
            f"{bound:.1f} s, forced bytes at the mixed rate {mixed:.1f} s; peak RSS "
            f"{format_bytes(vm_hwm())}")
    return rows


# -- command line --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Train a model whose training state is at least twice this machine's "
                     "RAM for a few steps, all state on NVMe; report peak RSS, step time, "
                     "bytes moved and the disk-bandwidth lower bound.")
    p.add_argument("--params", default="auto", type=count(1, example="3B", also=("auto",)),
                   help="parameters: 'auto' (training state twice the RAM: ~3B on 24 GiB in "
                   "bf16) or a count such as 200M or 3B (default auto)")
    p.add_argument("--d-model", type=integer(128, multiple=128, example=2048), default=2048,
                   help="width, a multiple of 128; depth follows --params (default 2048)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="compute dtype (default bf16: 18 bytes of state per parameter)")
    p.add_argument("--steps", type=integer(1, example=2), default=2,
                   help="optimizer steps (default 2)")
    p.add_argument("--batch", type=integer(1, example=1), default=1,
                   help="sequences per step (default 1)")
    p.add_argument("--length", type=integer(1, example=16), default=16,
                   help="tokens to reverse (default 16; activations are not offloaded, so few "
                   "tokens keep them small)")
    p.add_argument("--device-budget", default="512MiB", type=byte_size(4096, example="512MiB"),
                   help="device tier (default 512MiB)")
    p.add_argument("--host-budget", default="1GiB", type=byte_size(4096, example="1GiB"),
                   help="host tier (default 1GiB)")
    p.add_argument("--io-buffers", default="512MiB",
                   type=byte_size(IoConfig().block_size, example="512MiB"),
                   help="I/O staging, at least one I/O block (default 512MiB)")
    p.add_argument("--swap-dir", default="offload-swap", type=directory("swap directory"),
                   help="where swap files go; the run uses a new sub-directory and removes it "
                   "(default ./offload-swap)")
    # the mixed probe keeps requests of at least 4KiB each way in halves of the file
    p.add_argument("--probe", default="1GiB", type=byte_size(1 << 20, example="1GiB"),
                   help="bytes of the disk-bandwidth probe, at least 1MiB (default 1GiB)")
    p.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                   help="glibc's mmap threshold (default tuned): tuned: freed buffers of "
                   "1 MiB or more go back to the OS at once (see tune_malloc); default: "
                   "glibc's own sliding threshold")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def build_spec(args: argparse.Namespace) -> BenchSpec:
    if args.steps < 1 or args.batch < 1 or args.length < 1 or args.d_model % 128:
        raise UsageError("--steps, --batch, --length must be >= 1 and --d-model a multiple "
                         "of 128")
    return BenchSpec(
        model=model_for(parse_params(args.params, args.dtype), args.d_model,
                        args.length),
        dtype=args.dtype, steps=args.steps, batch=args.batch, length=args.length,
        device_budget=parse_bytes(args.device_budget, "--device-budget"),
        host_budget=parse_bytes(args.host_budget, "--host-budget"),
        io_buffers=parse_bytes(args.io_buffers, "--io-buffers"),
        swap_root=Path(args.swap_dir).absolute(), probe_bytes=parse_bytes(args.probe, "--probe"))


def _free(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def run(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    m, ram = spec.model, physical_memory()
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else \
        (lambda s: print(s, flush=True))
    say(f"offload bench oversized: {m.params / 1e9:.2f}B parameters ({m.n_layer} layers, "
        f"d_model {m.d_model}), {args.dtype}: training state {format_bytes(spec.state_bytes)}"
        f" = {spec.state_bytes / ram:.1f}x this machine's RAM ({format_bytes(ram)})")
    say(f"  budgets: device {format_bytes(spec.device_budget)}, host "
        f"{format_bytes(spec.host_budget)}, I/O staging {format_bytes(spec.io_buffers)}: "
        f"{format_bytes(spec.budgets)} of host memory; peak RSS must stay under "
        f"{format_bytes(spec.budgets + RSS_SLACK)}")
    need, free = spec.disk_needed(), _free(spec.swap_root)
    if free < need:
        print(f"offload bench oversized: {spec.swap_root} has {format_bytes(free)} free, the "
              f"swap files need about {format_bytes(need)} (the state, and a second version "
              "of what a step updates until it commits); give --swap-dir on a bigger disk "
              "or lower --params", file=sys.stderr)
        return 1
    say(f"  swap: {spec.swap_root}/{DIR_PREFIX}<pid>, about {format_bytes(need)} of "
        f"{format_bytes(free)} free; removed at the end")
    if args.malloc == "tuned" and not tune_malloc():
        say("  (could not fix the malloc mmap threshold: not glibc)")
    try:  # SIGTERM raises SystemExit (offload/cli/main.py): `finally` removes the swap files
        result = run_oversized(spec, say)
    except BaseException as e:  # Ctrl-C may arrive wrapped (the optimizer's OptimStepError)
        code = signal_exit_code(e)
        if code is None:
            raise
        print("interrupted; swap files removed", file=sys.stderr)
        return code
    result.update(_verdict(spec, result, ram))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(spec, result)
    return 0 if result["rss_ok"] else 1


def _verdict(spec: BenchSpec, r: dict[str, Any], ram: int) -> dict[str, Any]:
    steps = r["steps"]
    last = steps[-1]
    peak = max(r["init_peak_rss"], r["step_peak_rss"])
    m = spec.model
    return {"params": m.params, "n_layer": m.n_layer, "d_model": m.d_model, "dtype": spec.dtype,
            "state_bytes": spec.state_bytes, "ram_bytes": ram,
            "state_over_ram": spec.state_bytes / ram, "budgets_bytes": spec.budgets,
            "rss_limit_bytes": spec.budgets + RSS_SLACK, "peak_rss_bytes": peak,
            "rss_ok": peak <= spec.budgets + RSS_SLACK,
            "step_seconds": last["seconds"], "bound_seconds": last["bound_s"],
            "step_over_bound": last["seconds"] / last["bound_s"],
            "mixed_seconds": last["mixed_s"],
            "step_over_mixed": last["seconds"] / last["mixed_s"]}


def render(spec: BenchSpec, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"offload bench oversized: {r['params'] / 1e9:.2f}B parameters, state "
              f"{r['state_over_ram']:.1f}x RAM")
    for col in ("step", "time s", "fwd/bwd/opt s", "NVMe read", "NVMe written",
                "proc io r/w", "bound s", "x bound", "mixed s", "x mixed"):
        t.add_column(col, justify="right")
    for s in r["steps"]:
        t.add_row(str(s["step"]), f"{s['seconds']:.1f}",
                  f"{s['forward_s']:.1f}/{s['backward_s']:.1f}/{s['optimizer_s']:.1f}",
                  format_bytes(s["read"]), format_bytes(s["written"]),
                  f"{s['proc_read'] / GiB:.1f}/{s['proc_written'] / GiB:.1f} GiB",
                  f"{s['bound_s']:.1f}", f"{s['seconds'] / s['bound_s']:.2f}",
                  f"{s['mixed_s']:.1f}", f"{s['seconds'] / s['mixed_s']:.2f}")
    con = table_console()
    con.print(t)
    ok = "[green]ok[/green]" if r["rss_ok"] else "[red]OVER[/red]"
    con.print(f"peak RSS: placing {format_bytes(r['init_peak_rss'])}, stepping "
              f"{format_bytes(r['step_peak_rss'])}; limit {format_bytes(r['rss_limit_bytes'])} "
              f"(budgets {format_bytes(r['budgets_bytes'])} + 0.5 GiB): {ok}")
    con.print(f"disk: read {r['read_Bps'] / 1e9:.2f} GB/s, write {r['write_Bps'] / 1e9:.2f} "
              f"GB/s, both at once {r['mixed_Bps'] / 1e9:.2f} GB/s; forced bytes per step: "
              f"read {format_bytes(r['forced_read'])}, written {format_bytes(r['forced_written'])}"
              "; bound = max(forced read / read rate, forced written / write rate); mixed = "
              "forced bytes / the mixed rate (reported, not a bound)")
    con.print(f"placing the model took {r['init_seconds']:.0f} s; swap files "
              + ("removed" if r["swap_removed"] else "[red]NOT removed[/red]")
              + f" ({r['swap_dir']})")


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench oversized")
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
