"""`offload bench step`: a whole training step, offload against DeepSpeed ZeRO-3, interleaved.

The same model (an MLP of `--layers` Linear(dim, dim) with ReLU between, fp32,
batch `--batch`, MSE loss against a fixed target), the same data and the same
placement run by offload and, where it is installed, by DeepSpeed ZeRO-3 (one
process, gloo, its CPU accelerator). Each (system, placement) run is a
subprocess of its own, so its peak RSS is its own; it builds the model without
materialising it whole (offload: on `meta`; DeepSpeed: under
`deepspeed.zero.Init`), runs `--warmup` untimed steps, then `--steps` timed
ones. Rounds interleave the systems (A B A B) so drift of the machine and the
disk hits both alike; rows report the median over rounds of each run's median
step.

Systems "offload-bf16" and "offload-int8" are offload with its Adam moments
kept as bf16 or 8-bit codes (`optim.state_dtype`); their forced bytes count
the moments at that size (4 and ~2.03 bytes per parameter), and the targets
compare their nvme row with offload's fp32 one of the same rounds. Each row
of a disk placement (nvme-opt, nvme) reports its practicality: the system's
no-offload step (its fastest none step; offload fp32's for offload's forms of
the moments) over the row's step ([Note: practicality] in
bench_step_targets.py).

Placements (offload keys; DeepSpeed's equivalent in brackets):
  none      params and grads on the device tier, optimizer state on the host,
            budgets large enough for everything [ZeRO-3, no offload];
  host      params, grads and optimizer state on the host [offload_param and
            offload_optimizer device "cpu"];
  nvme-opt  parameters in memory (device tier, large budgets), optimizer state
            on NVMe [offload_optimizer device "nvme", parameters not offloaded];
  nvme      params and optimizer state on NVMe, grads on the host, with the
            memory budgets (--host-budget, --device-budget) below the
            parameters' bytes so parameters really stream [offload_param and
            offload_optimizer device "nvme", max_in_cpu 0, tight buffers].

Bytes read and written per step are the worker process's own
`/proc/self/io` read_bytes / write_bytes over the timed steps, the same
counter for both systems (O_DIRECT traffic included); offload's own accounting
(store moves plus the optimizer's step results) is reported beside it.
Peak RSS is the worker's VmHWM: over the whole run, and over the steps alone
(reset through /proc/self/clear_refs after initialisation). CPU seconds per
step (`cpu_s_per_step`) are the worker's process CPU time (user + system, every
thread) over the timed steps; `cpu_floor_s`, that over the cores the worker
may run on, is a floor for the row's mean step: CPU time cannot exceed wall
time times the cores (give or take a few milliseconds by which the CPU clock
may lag threads running when it is read: nothing beside steps of 0.1 s and
more).

The lower bound of a placement that moves bytes to the disk is
max(fastest no-offload step, R / read rate, W / write rate) (the no-offload step
is measured in the same run: the compute's reference, not itself a bound, which
a placement that moves no bytes may beat within the run's noise), where R and W are
the fewest bytes the placement's budgets force any system to read and write
per step, the same for both systems (`forced_read_bytes`,
`forced_write_bytes`): the optimizer's Adam moments (8 bytes per parameter;
the fp32 parameter can be the master) both ways; for `nvme`, also the
parameter bytes that the memory budgets (store.host_budget plus
store.device_budget, the GPU's memory or the CPU's) cannot keep across a step: the reads of
farthest-next-use eviction byte by byte over the step's forward and backward
order (the fewest any partitioning allows: a system may keep part of a
layer; `benchutil.forced_param_reads`), and the updated parameters that do
not fit, written. The I/O buffers (io.buffer_budget) stage transfers and are
not counted as holding parameters (`bench oversized` counts them, a lower
figure). The rates are measured in the
same run with offload's I/O engine (O_DIRECT, the io section's block size and
queue depth, as the runs write) right before each offloading run: the disk
drifts minute to minute, so each row's bound uses the median of the probes
taken before its own runs (`disk` in the row; the top-level `disk` is the
median of all). The probe also measures a mixed rate (reads and writes at
once, as many requests of the optimizer's chunk size in flight each way as
its pipeline keeps, for 2 s); (R + W) / mixed rate is reported beside the
bound (`mixed_s`) but is not part of it: a step whose traffic is deeper or
better spread than the probe's moves reads and writes together faster than
that rate, so it is no lower bound. Each row reports its own bytes beside the
forced ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import IoConfig, OptimConfig, format_bytes, parse_bytes
from .args import (CommandParser, UsageError, byte_size, choice_list, directory, integer, number,
                   run_command, table_console)
from .bench_step_targets import DISK_PLACEMENTS, SYSTEMS, practicality, targets
from .benchutil import (DiskProbe, emit, forced_param_reads, proc_io, progress_printer,
                        reset_hwm, scratch_dir, vm_hwm)

GiB = 1 << 30
PLACEMENTS = ("none", "host", "nvme-opt", "nvme")
STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradient, Adam's two moments
BYTES_SOURCE = "/proc/self/io read_bytes/write_bytes of the worker process"


def state_dtype_of(system: str) -> str:
    """optim.state_dtype of an offload system ("offload-int8" -> "int8")."""
    return system.split("-", 1)[1] if system.startswith("offload-") else "fp32"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One (system, placement) run, as the parent hands it to a worker (JSON)."""

    system: str
    placement: str
    dim: int
    layers: int
    batch: int
    warmup: int
    steps: int
    swap_dir: str               # the run's own directory for swap files
    out: str                    # the worker writes its result (JSON) here
    host_budget: int            # bytes: store.host_budget of the nvme placement
    device_budget: int          # bytes: store.device_budget of the nvme placement
    buffer_budget: int          # bytes: io.buffer_budget
    block_size: int             # bytes per I/O request, both systems
    queue_depth: int            # I/O requests in flight, both systems
    threads: int = 0            # torch threads; 0: torch's default
    device: str = "cpu"         # compute device: store.device of offload's runs
    seed: int = 0

    @property
    def params(self) -> int:
        return self.layers * self.dim * (self.dim + 1)


# -- placements ---------------------------------------------------------------------------
def offload_config(spec: RunSpec) -> dict:
    """The offload config dict of `spec`'s placement."""
    big = spec.params * STATE_BYTES_PER_PARAM + GiB  # holds everything: nothing waits on room
    engine = {"none": {"params": "device", "grads": "device", "optimizer": "host"},
              "host": {"params": "host", "grads": "host", "optimizer": "host"},
              "nvme-opt": {"params": "device", "grads": "host", "optimizer": "nvme"},
              "nvme": {"params": "nvme", "grads": "host", "optimizer": "nvme"}}[spec.placement]
    store = {"device_budget": big, "host_budget": big}
    if spec.placement == "nvme":
        store = {"device_budget": spec.device_budget, "host_budget": spec.host_budget}
    return {"engine": {**engine, "dtype": "fp32"},
            "store": {**store, "device": spec.device},
            "io": {"paths": [spec.swap_dir], "buffer_budget": spec.buffer_budget,
                   "block_size": spec.block_size, "queue_depth": spec.queue_depth},
            "optim": {"lr": 1e-3, "weight_decay": 0.01,
                      "state_dtype": state_dtype_of(spec.system)}}


def deepspeed_config(spec: RunSpec) -> dict:
    """The DeepSpeed config dict of `spec`'s placement (ZeRO-3, fp32, AdamW)."""
    zero: dict = {"stage": 3}
    if spec.placement == "nvme-opt":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": spec.swap_dir,
                                     "pin_memory": False}
    if spec.placement == "host":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif spec.placement == "nvme":
        # max_in_cpu 0: parameters live on NVMe, as offload's; with its default (1e9
        # elements) DeepSpeed would copy every parameter to host memory for good.
        # One swap buffer must hold the largest parameter.
        zero["offload_param"] = {"device": "nvme", "nvme_path": spec.swap_dir,
                                 "pin_memory": False, "buffer_count": 5, "max_in_cpu": 0,
                                 "buffer_size": spec.dim * spec.dim + spec.dim}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": spec.swap_dir,
                                     "pin_memory": False, "buffer_count": 4}
        # Its defaults keep every parameter it will use again (max_reuse_distance 1e9) and
        # prefetch 5e7 elements, each holding one of the 5 swap buffers: the second step
        # fails with "Not enough buffers 0 for swapping 1". Release after use, prefetch
        # two layers, at most three live.
        layer = spec.dim * spec.dim
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=2 * layer,
                    stage3_max_live_parameters=3 * layer)
    return {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "aio": {"block_size": spec.block_size, "queue_depth": spec.queue_depth,
                    "single_submit": False, "overlap_events": True},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def build_mlp(dim: int, layers: int):
    """`layers` x Linear(dim, dim), ReLU between them."""
    from torch import nn

    mods: list = []
    for i in range(layers):
        mods.append(nn.Linear(dim, dim))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


# -- the worker (one run, in its own process) ---------------------------------------------
class _OffloadRun:
    def __init__(self, spec: RunSpec) -> None:
        import offload

        self.engine = offload.initialize(lambda: build_mlp(spec.dim, spec.layers),
                                         offload_config(spec))

    def step(self, x, y) -> float:
        import torch.nn.functional as F

        loss = F.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def accounted(self) -> tuple[int, int]:
        """(bytes read, bytes written) to NVMe by the store and the optimizer, so far."""
        return self.engine.nvme_bytes()

    def close(self) -> None:
        self.engine.close()


class _DeepSpeedRun:
    def __init__(self, spec: RunSpec) -> None:
        import socket

        with socket.socket() as s:  # a free port for the one-process gloo group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        cfg = deepspeed_config(spec)
        remote = {"none": None, "host": "cpu", "nvme-opt": None,
                  "nvme": "nvme"}[spec.placement]
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=remote):
            model = build_mlp(spec.dim, spec.layers)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg)

    def step(self, x, y) -> float:
        import torch.nn.functional as F

        loss = F.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def accounted(self) -> None:
        return None

    def close(self) -> None:
        self.engine.destroy()


def run_worker(spec: RunSpec) -> dict:
    """Initialises `spec.system`, runs the warm-up and timed steps; the result row."""
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    run = _OffloadRun(spec) if spec.system.startswith("offload") else _DeepSpeedRun(spec)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(spec.batch, spec.dim, generator=g).to(spec.device)
    y = torch.randn(spec.batch, spec.dim, generator=g).to(spec.device)
    init_peak = vm_hwm()
    reset = reset_hwm()
    try:
        for _ in range(spec.warmup):
            run.step(x, y)
        io0, acc0 = proc_io(), run.accounted()
        times, losses = [], []
        cpu0 = time.process_time()
        for _ in range(spec.steps):
            t = time.perf_counter()
            losses.append(run.step(x, y))
            times.append(time.perf_counter() - t)
        cpu_s = time.process_time() - cpu0
        cores = len(os.sched_getaffinity(0))
        io1, acc1 = proc_io(), run.accounted()
        steps_peak = vm_hwm()
    finally:
        run.close()
    row = {"system": spec.system, "placement": spec.placement, "init_s": init_s,
           "step_s": times, "losses": losses, "cpu_s": cpu_s, "cores": cores,
           "peak_rss_bytes": max(init_peak, steps_peak),
           "steps_peak_rss_bytes": steps_peak if reset else None,
           "read_bytes": io1[0] - io0[0], "write_bytes": io1[1] - io0[1]}
    if acc0 is not None:
        row["accounted_read_bytes"] = acc1[0] - acc0[0]
        row["accounted_write_bytes"] = acc1[1] - acc0[1]
    return row


def _worker_main(spec_json: str) -> int:
    spec = RunSpec(**json.loads(spec_json))
    row = run_worker(spec)
    with open(spec.out, "w") as f:
        json.dump(row, f)
    return 0


# -- the parent: rounds of worker processes -----------------------------------------------
def _spawn(spec: RunSpec, timeout: float) -> dict:
    """Runs one worker process; its result row, or {"error": why}."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding `offload/`
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "offload.cli.bench_step", "--worker", json.dumps(asdict(spec))]
    log_path = spec.swap_dir + ".log"
    try:
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    # a long error cut at a word, never inside a number
    last = textwrap.shorten(lines[-1], 400, placeholder=" ...") if lines else "no output"
    if not os.path.exists(spec.out):
        return {"error": f"worker exited with {rc}: {last}"}
    with open(spec.out) as f:
        row = json.load(f)
    if rc != 0:  # e.g. DeepSpeed's aio threads abort at interpreter exit
        row["exit"] = f"exited with {rc} after writing its result: {last}"
    return row


@dataclass
class _Runs:
    """What one (system, placement) gave over the rounds."""

    system: str
    placement: str
    samples: list[dict] = field(default_factory=list)
    note: str | None = None     # why it has no (more) rounds; later rounds skip it
    remarks: list[str] = field(default_factory=list)  # said of rounds that did count


def _row(runs: _Runs) -> dict:
    row: dict = {"system": runs.system, "placement": runs.placement, "median_step_s": None,
                 "peak_rss_GiB": None, "read_bytes_per_step": None,
                 "write_bytes_per_step": None}
    s = runs.samples
    if s:
        per_round = [statistics.median(x["step_s"]) for x in s]
        nsteps = len(s[0]["step_s"])
        steps_peak = [x["steps_peak_rss_bytes"] for x in s]
        row.update(
            median_step_s=statistics.median(per_round), round_step_s=per_round,
            peak_rss_GiB=max(x["peak_rss_bytes"] for x in s) / GiB,
            steps_peak_rss_GiB=None if None in steps_peak else max(steps_peak) / GiB,
            read_bytes_per_step=statistics.median(x["read_bytes"] / nsteps for x in s),
            write_bytes_per_step=statistics.median(x["write_bytes"] / nsteps for x in s),
            init_s=statistics.median(x["init_s"] for x in s),
            cpu_s_per_step=statistics.median(x["cpu_s"] / nsteps for x in s),
            cpu_floor_s=statistics.median(x["cpu_s"] / nsteps / x["cores"] for x in s),
            first_loss=s[0]["losses"][0], last_loss=s[0]["losses"][-1])
        probes = [x["disk"] for x in s if "disk" in x]
        if probes:
            row["disk"] = _median_disk(probes)
        if "accounted_read_bytes" in s[0]:
            row["accounted_read_bytes_per_step"] = statistics.median(
                x["accounted_read_bytes"] / nsteps for x in s)
            row["accounted_write_bytes_per_step"] = statistics.median(
                x["accounted_write_bytes"] / nsteps for x in s)
    said = [runs.note] if runs.note else []
    row["note"] = "; ".join(said + sorted(set(runs.remarks))) or None
    return row


def forced_bytes(placement: str, dim: int, layers: int, memory: int,
                 state_dtype: str = "fp32") -> tuple[int, int]:
    """(R, W): the fewest bytes any system must read and write per step for this
    placement, with `memory` bytes of memory budgets for parameters (see the module
    docstring), the moments in `state_dtype`'s form. A true lower bound: every
    figure in it is forced."""
    if placement not in DISK_PLACEMENTS:
        return 0, 0
    from ..optim.codec import moment_bytes
    from ..store import footprint

    params = layers * dim * (dim + 1)
    moments = moment_bytes(state_dtype, params)
    if placement == "nvme-opt":
        return moments, moments
    size = footprint(dim * (dim + 1) * 4)  # one layer's fp32 parameters
    if memory < size:
        raise UsageError(f"the memory budgets ({memory} bytes) hold less than one layer's "
                         f"parameters ({size} bytes); raise --host-budget or --device-budget")
    order = list(range(layers)) + list(reversed(range(layers)))  # forward, then backward
    reads = forced_param_reads(order, {k: size for k in range(layers)}, memory)
    unkept = max(0, layers * size - memory)  # updated parameters that cannot stay in memory
    return moments + reads, moments + unkept


def _memory_budget(base: dict) -> int:
    """Bytes of memory budgets the nvme placement's parameters may use: the host tier
    and the device tier (a GPU's memory too: a system may keep parameters there from
    step to step, so leaving it out would force bytes no system has to move)."""
    return base["host_budget"] + base["device_budget"]


def _add_bounds(rows: list[dict], disk: dict | None,
                forced: dict[tuple[str, str], tuple[int, int]]) -> float | None:
    """Adds `bound_s` and `step_over_bound` to every offloading row: max(fastest none
    step, forced reads / read rate, forced writes / write rate), the rates from the
    probes taken right before the row's own runs, else `disk`; and `mixed_s`, the
    forced bytes at the probed mixed rate (not a bound).
    Returns the compute term (the fastest none step), None when no such step ran."""
    none_steps = [r["median_step_s"] for r in rows
                  if r["placement"] == "none" and r["median_step_s"] is not None]
    t_none = min(none_steps) if none_steps else None
    for r in rows:
        if r["placement"] == "none" or r["median_step_s"] is None:
            continue
        fr, fw = forced.get((state_dtype_of(r["system"]), r["placement"]), (0, 0))
        r["forced_read_bytes"], r["forced_write_bytes"] = fr, fw
        d = r.get("disk") or disk  # the probes taken right before its own runs
        terms = {"compute": t_none}
        if d is not None and (fr or fw):
            terms.update(read=fr / (d["read_GBps"] * 1e9), write=fw / (d["write_GBps"] * 1e9))
            if d.get("mixed_GBps"):  # reported, not a bound: see the module docstring
                r["mixed_s"] = (fr + fw) / (d["mixed_GBps"] * 1e9)
                r["step_over_mixed"] = r["median_step_s"] / r["mixed_s"]
        terms = {k: v for k, v in terms.items() if v is not None}
        if terms:
            r["bound_terms_s"] = terms
            r["bound_s"] = max(terms.values())
            r["step_over_bound"] = r["median_step_s"] / r["bound_s"]
    return t_none


def _choices(value: str | tuple[str, ...], allowed: tuple[str, ...],
             flag: str) -> tuple[str, ...]:
    """The names picked (a comma list, or the tuple `choice_list` parsed it into), in
    canonical order."""
    picked = value if isinstance(value, tuple) else \
        tuple(x.strip() for x in value.split(",") if x.strip())
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise UsageError(f"{flag}: {','.join(picked)!r} is not a comma list of "
                         f"{', '.join(allowed)}; give e.g. {','.join(allowed)}")
    return tuple(x for x in allowed if x in picked)


def _deepspeed_status() -> tuple[str | None, str]:
    """(version, "") when deepspeed is importable, else (None, why not)."""
    try:
        found = importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["deepspeed"] = None
        found = False
    if not found:
        return None, ("deepspeed is not installed (apt-get install libaio-dev; "
                      "pip install deepspeed)")
    from importlib.metadata import version

    return version("deepspeed"), ""


def _check_disk(path: str, need: int) -> None:
    from ..io import probe_direct

    ok, why = probe_direct(path, "--path")
    if not ok:
        raise SystemExit(f"offload bench step: {why}; the nvme placement needs O_DIRECT: give "
                         "--path on a disk-backed file system")
    free = shutil.disk_usage(path).free
    if free < need:
        raise SystemExit(f"offload bench step: --path: {os.path.dirname(path)} has "
                         f"{format_bytes(free)} free, the nvme placements need "
                         f"{format_bytes(need)}; lower --dim, --layers or --disk-size, or give "
                         "--path on a disk with more free space")


def _base_spec(args: argparse.Namespace) -> dict:
    """The RunSpec fields every run shares, checked."""
    if min(args.dim, args.layers, args.batch, args.steps, args.rounds) < 1 or args.warmup < 0:
        raise UsageError("--dim, --layers, --batch, --steps and --rounds must be >= 1, "
                         "--warmup >= 0")
    io = IoConfig()  # both systems use offload's default request size and queue depth
    return dict(dim=args.dim, layers=args.layers, batch=args.batch, warmup=args.warmup,
                steps=args.steps, host_budget=parse_bytes(args.host_budget, "--host-budget"),
                device_budget=parse_bytes(args.device_budget, "--device-budget"),
                buffer_budget=parse_bytes(args.buffer_budget, "--buffer-budget"),
                block_size=io.block_size, queue_depth=io.queue_depth, threads=args.threads,
                device=_device(args.device))


def _device(name: str) -> str:
    import torch

    if name == "cpu":
        return name
    if name == "cuda" and torch.cuda.is_available():
        return name
    raise UsageError(f"--device: {name!r} "
                     + ("is not usable: no CUDA device is visible; use --device cpu"
                        if name == "cuda" else "is not one of cpu, cuda; use cpu or cuda"))


def _rounds(runs: dict[tuple[str, str], _Runs], work: str, base: dict, state: int,
            args: argparse.Namespace, progress) -> dict | None:
    """Runs every round (A B A B); the disk is probed right before each nvme run, as
    it drifts minute to minute, and each nvme row's bound uses its own runs' probes.
    Returns the disk's median bandwidths over all probes, None when no placement
    needed the disk."""
    probe = None
    probes: list[dict] = []
    from ..optim import resolve_chunk_elems

    # the nvme runs' optimizer traffic: chunks of 8 B/element (fp32: moments only; with
    # --device cuda, nvme-opt's parameters stay on the GPU and its chunks also hold a
    # master, so its requests are 12 B/element of a shorter chunk: this probe
    # sizes for the nvme runs)
    ocfg = OptimConfig()
    request = resolve_chunk_elems(ocfg, base["buffer_budget"], masters=False) * 8
    try:
        if any(p in DISK_PLACEMENTS for _, p in runs):
            disk_n = min(parse_bytes(args.disk_size, "--disk-size"), max(64 << 20, state))
            _check_disk(work, 2 * state + disk_n + GiB)
            probe = DiskProbe(IoConfig(paths=[work]), work, disk_n)
        for r in range(args.rounds):
            for one in runs.values():  # placement by placement, the systems alternating
                if one.note:  # one that failed (or cannot run) said why once
                    continue
                disk = None
                if probe is not None and one.placement in DISK_PLACEMENTS:
                    w, rd = probe.measure()
                    mx = probe.measure_mixed(request, ocfg.buffers, seconds=2.0)
                    disk = {"write_GBps": w / 1e9, "read_GBps": rd / 1e9,
                            "mixed_GBps": mx / 1e9}
                    probes.append(disk)
                    if progress:
                        progress(f"round {r + 1}/{args.rounds}: disk write {w / 1e9:.2f} "
                                 f"GB/s, read {rd / 1e9:.2f} GB/s, mixed {mx / 1e9:.2f} GB/s")
                _run_once(one, r, work, base, args, progress, disk)
        if not probes:  # no nvme run happened
            return None
        return {"engine": probe.engine.name, "direct": probe.engine.direct, "size": probe.n,
                **_median_disk(probes), "probes": len(probes), "mixed_request": request,
                "mixed_depth": ocfg.buffers}
    finally:
        if probe is not None:
            probe.close()


def _median_disk(probes: list[dict]) -> dict:
    return {k: statistics.median(p[k] for p in probes)
            for k in ("write_GBps", "read_GBps", "mixed_GBps")}


def run_step_bench(args: argparse.Namespace, path: str, progress=None) -> dict:
    """Runs the benchmark with swap files under directory `path`; the JSON-ready result."""
    import torch

    systems = _choices(args.system, SYSTEMS, "--system")
    placements = _choices(args.placement, PLACEMENTS, "--placement")
    base = _base_spec(args)
    params = args.layers * args.dim * (args.dim + 1)
    state = params * STATE_BYTES_PER_PARAM
    ds_version, ds_why = _deepspeed_status() if "deepspeed" in systems else (None, "")
    if base["device"] != "cpu" and not ds_why:
        ds_why = ("not run with --device cuda: this benchmark runs DeepSpeed on its CPU "
                  "accelerator only")
    runs = {(s, p): _Runs(s, p, note=ds_why if s == "deepspeed" and ds_why else None)
            for p in placements for s in systems}
    os.makedirs(path, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".offload-bench-step-", dir=path)
    try:
        disk = _rounds(runs, work, base, state, args, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [_row(one) for one in runs.values()]
    forced = {(state_dtype_of(s), p): forced_bytes(p, args.dim, args.layers,
                                                   _memory_budget(base), state_dtype_of(s))
              for p in placements for s in systems}
    t_none = _add_bounds(rows, disk, forced)
    practicality(rows)
    notes = []
    if t_none is None and any(r.get("bound_s") for r in rows):
        notes.append("no none-placement step ran: the bound has no compute term")
    return {"benchmark": "step",
            "model": {"kind": "mlp", "dim": args.dim, "layers": args.layers,
                      "batch": args.batch, "dtype": "fp32", "params": params,
                      "state_bytes": state},
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads or torch.get_num_threads(), "torch": torch.__version__,
            "device": base["device"],
            "deepspeed": ds_version,
            "nvme_budgets": {k: base[k] for k in ("host_budget", "device_budget",
                                                  "buffer_budget")},
            "io": {"block_size": base["block_size"], "queue_depth": base["queue_depth"]},
            "disk": disk, "huge_pages": _huge_pages(),
            # every worker, DeepSpeed's as well as offload's, inherits it: [Note: OpenMP's
            # wait policy] in offload/__init__.py
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "none_step_s": t_none,
            "bytes_source": BYTES_SOURCE,
            "forced_bytes": {p: {"read": r, "write": w}
                             for (sd, p), (r, w) in forced.items() if sd == "fp32"},
            "results": rows, "notes": notes,
            # peak RSS against the budgets of host memory: a GPU's budget is not
            "targets": targets(rows, base["host_budget"] + base["buffer_budget"]
                               + (base["device_budget"] if base["device"] == "cpu" else 0))}


def _huge_pages() -> dict:
    """Whether the workers' large host tensors get huge pages: they inherit this
    process's THP_MEM_ALLOC_ENABLE, DeepSpeed's as well as offload's."""
    from ..io import hugepages

    ok, why = hugepages.check()
    return {"on": ok, "env": os.environ.get(hugepages.ENV), "why": why}


def _run_once(one: _Runs, r: int, work: str, base: dict, args: argparse.Namespace,
              progress, disk: dict | None = None) -> None:
    """Round `r` of one (system, placement): a worker in its own swap directory;
    `disk`: the probe taken right before it, kept with its sample."""
    tag = f"{one.system}-{one.placement}-r{r}"
    swap = os.path.join(work, tag)
    os.makedirs(swap)
    spec = RunSpec(system=one.system, placement=one.placement, swap_dir=swap,
                   out=os.path.join(work, tag + ".json"), seed=args.seed, **base)
    try:
        res = _spawn(spec, args.timeout)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if "error" in res:
        one.note = f"round {r + 1}: {res['error']}"
        if progress:
            progress(f"round {r + 1}/{args.rounds}: {one.system} {one.placement}: "
                     f"{res['error']}")
        return
    if disk is not None:
        res["disk"] = disk
    one.samples.append(res)
    if "exit" in res:
        one.remarks.append("worker " + res["exit"])
    if progress:
        n = len(res["step_s"])
        progress(f"round {r + 1}/{args.rounds}: {one.system:9s} {one.placement:4s}: step "
                 f"{statistics.median(res['step_s']):.3f} s (init {res['init_s']:.1f} s), "
                 f"peak RSS {res['peak_rss_bytes'] / GiB:.2f} GiB, read "
                 f"{res['read_bytes'] / n / 1e6:.0f} MB/step, write "
                 f"{res['write_bytes'] / n / 1e6:.0f} MB/step")


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(result: dict) -> None:
    """Prints the result as a rich table."""
    from rich.table import Table

    con = table_console()
    m = result["model"]
    t = Table(title=f"offload bench step: {m['layers']} x Linear({m['dim']}, {m['dim']}) fp32, "
                    f"batch {m['batch']} on {result['device']}, {m['params'] / 1e6:.0f}M params "
                    f"({m['state_bytes'] / 1e9:.2f} GB of state); median of "
                    f"{result['rounds']} interleaved rounds x {result['steps']} steps")
    for col in ("system", "placement", "step s", "x bound", "CPU s", "RSS GiB", "step RSS",
                "MB r/w"):
        t.add_column(col, justify="left" if col in ("system", "placement") else "right",
                     no_wrap=True)
    for r in result["results"]:
        rw = "-" if r["read_bytes_per_step"] is None else \
            f"{r['read_bytes_per_step'] / 1e6:.0f}/{r['write_bytes_per_step'] / 1e6:.0f}"
        t.add_row(r["system"], r["placement"], _fmt(r["median_step_s"], ".3f"),
                  _fmt(r.get("step_over_bound"), ".2f"), _fmt(r.get("cpu_s_per_step"), ".3f"),
                  _fmt(r["peak_rss_GiB"], ".2f"),
                  _fmt(r.get("steps_peak_rss_GiB"), ".2f"), rw)
    con.print(t)
    con.print(f"CPU s: CPU seconds of the worker's threads per timed step (user + system, "
              f"all threads). RSS: the worker's peak (VmHWM) over the whole run; step RSS: "
              f"over the steps alone. MB r/w: MB read / written per step, from "
              f"{result['bytes_source']}")
    hp = result.get("huge_pages")
    if hp:
        con.print(f"huge pages: {'on' if hp['on'] else 'off'} for every worker, both systems "
                  f"({hp['why']})")
    d = result["disk"]
    if d:
        n = d.get("probes", 1)
        con.print(f"disk, {'median of ' + str(n) + ' probes' if n > 1 else 'one probe'} "
                  f"({d['engine']}, "
                  f"{'O_DIRECT' if d['direct'] else 'buffered'}, "
                  f"{format_bytes(result['io']['block_size'])} x {result['io']['queue_depth']}): "
                  f"write {d['write_GBps']:.2f} GB/s, read {d['read_GBps']:.2f} GB/s; mixed "
                  f"({d['mixed_depth']} reads + {d['mixed_depth']} writes of "
                  f"{format_bytes(d['mixed_request'])} in flight) {d['mixed_GBps']:.2f} GB/s")
    for r in result["results"]:
        if r.get("bound_s") is not None:
            rd = r.get("disk")
            probed = "" if not rd else (f" (write {rd['write_GBps']:.2f} / read "
                                        f"{rd['read_GBps']:.2f} / mixed "
                                        f"{rd.get('mixed_GBps', 0):.2f} GB/s, probed before "
                                        "its runs)")
            terms = ", ".join(f"{k} {v:.3f} s" for k, v in r["bound_terms_s"].items())
            con.print(f"{r['system']} {r['placement']}: bound {r['bound_s']:.3f} s = max("
                      f"{terms}){probed}; step / bound = {r['step_over_bound']:.2f}; forced "
                      f"{r['forced_read_bytes'] / 1e6:.0f}/{r['forced_write_bytes'] / 1e6:.0f} "
                      f"MB r/w, its own {r['read_bytes_per_step'] / 1e6:.0f}/"
                      f"{r['write_bytes_per_step'] / 1e6:.0f} MB")
            if r.get("practicality") is not None:
                limit = r.get("practicality_cpu_limit")
                con.print(f"{r['system']} {r['placement']}: practicality (no-offload step / "
                          f"this step) {r['practicality']:.2f}" + (
                              "" if limit is None else f"; its CPU time alone allows at most "
                              f"{limit:.2f} (CPU floor {r['cpu_floor_s']:.3f} s)"))
            if r.get("mixed_s") is not None:
                con.print(f"{r['system']} {r['placement']}: forced bytes at the probed mixed "
                          f"rate {r['mixed_s']:.3f} s (step / that = "
                          f"{r['step_over_mixed']:.2f}; not a bound)")
        if r.get("accounted_read_bytes_per_step") is not None:
            con.print(f"{r['system']} {r['placement']}: own accounting "
                      f"{r['accounted_read_bytes_per_step'] / 1e6:.0f} MB read, "
                      f"{r['accounted_write_bytes_per_step'] / 1e6:.0f} MB written per step")
    for tg in result["targets"]:
        con.print(f"target: {tg['target']}: {tg['value']:.2f} vs {tg['limit']:.2f} -> "
                  + ("[green]met[/green]" if tg["met"] else "[red]missed[/red]"))
    for r in result["results"]:
        if r["note"]:
            con.print(f"note: {r['system']} {r['placement']}: {r['note']}")
    for note in result["notes"]:
        con.print(f"note: {note}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=integer(1, example=4096), default=4096,
                   help="features of every Linear (default 4096)")
    p.add_argument("--layers", type=integer(1, example=6), default=6,
                   help="Linear layers (default 6)")
    p.add_argument("--batch", type=integer(1, example=16), default=16,
                   help="rows per step (default 16)")
    p.add_argument("--steps", type=integer(1, example=5), default=5,
                   help="timed steps per run (default 5)")
    p.add_argument("--warmup", type=integer(0, example=2), default=2,
                   help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=integer(1, example=3), default=3,
                   help="interleaved rounds (default 3)")
    p.add_argument("--system", default="offload,deepspeed", type=choice_list(SYSTEMS),
                   help="comma list of offload, deepspeed, offload-bf16 and offload-int8 "
                        "(offload with its moments in that form) (default offload,deepspeed)")
    p.add_argument("--placement", default=",".join(PLACEMENTS), type=choice_list(PLACEMENTS),
                   help="comma list of none, host, nvme-opt, nvme (default all)")
    p.add_argument("--path", default=None, type=directory("directory for the swap files"),
                   help="directory for the swap files (default: a temporary directory under "
                   "the current one)")
    p.add_argument("--host-budget", default="160MiB", type=byte_size(4096, example="160MiB"),
                   help="nvme placement: store.host_budget (default 160MiB: with the "
                   "device budget, below the default model's 403 MB of parameters)")
    p.add_argument("--device-budget", default="144MiB", type=byte_size(4096, example="144MiB"),
                   help="nvme placement: store.device_budget (default 144MiB)")
    p.add_argument("--buffer-budget", default="256MiB",
                   type=byte_size(IoConfig().block_size, example="256MiB"),
                   help="io.buffer_budget of every placement, at least one I/O block "
                   "(default 256MiB)")
    p.add_argument("--disk-size", default="1GiB", type=byte_size(1, example="1GiB"),
                   help="bytes of the disk-bandwidth probe (default 1GiB, at most the "
                   "model's state)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="compute device of offload's runs: cpu or cuda (default cpu; "
                   "DeepSpeed runs on the CPU only)")
    p.add_argument("--threads", type=integer(0, example=4), default=0,
                   help="torch threads (default: torch's)")
    p.add_argument("--seed", type=integer(0, example=0), default=0,
                   help="seed of the batch (default 0)")
    p.add_argument("--timeout", type=number(0, above=True, example=1800), default=1800,
                   help="seconds one run may take before it is killed (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def failed_rows(rows: list[dict]) -> list[dict]:
    """The rows that make the command fail: a row with no measurement of offload's
    (offload-bf16 and offload-int8 too), or every row where none measured anything;
    a missing peer's (DeepSpeed's) is only a note."""
    return [r for r in rows if r["median_step_s"] is None
            and (r["system"].startswith("offload")
                 or all(x["median_step_s"] is None for x in rows))]


def run(args: argparse.Namespace) -> int:
    with scratch_dir(args.path) as path:
        result = run_step_bench(args, path, progress_printer(args.json))
    rc = emit(result, args.json, render)
    failed = failed_rows(result["results"])
    for r in failed:
        print(f"offload bench step: {r['system']} {r['placement']}: no step measured "
              f"({r['note'] or 'no round ran'})", file=sys.stderr)
    return 1 if failed else rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return _worker_main(argv[1])
    p = CommandParser(prog="offload bench step", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)


if __name__ == "__main__":
    sys.exit(main())
