"""`offload demo`: the main job. Trains a small GPT-style decoder to reverse token
sequences while its training state (weights, gradients, fp32 master weights,
Adam moments) is several times larger than the device and host budgets it is
given; the rest lives in swap files on NVMe.

The run reads like a table of contents:
  1. `build_plan`: model, task, placement and budgets from the flags; the state
     and swap sizes they imply; placements that cannot fit are refused here;
  2. the header says all of it, and the disk is checked for room;
  3. with `--nproc N > 1` the command re-launches itself under torchrun (gloo),
     each rank holding 1/N of every partition; only rank 0 prints;
  4. `train`: `offload.initialize` on a builder (the model is built on the meta
     device), then step after step under a live progress line, one step traced;
  5. the summary table; swap files are removed on every way out.

[Note: stopping]
The first Ctrl-C (SIGINT) asks to stop after the step in flight: every rank
learns it at the step's end (the stop flag rides on the loss all-reduce), so all
ranks stop at the same step and no collective is left waiting. A second Ctrl-C,
or SIGTERM, stops at once. Every way out runs `engine.close()`, which removes
the swap files, and then removes this run's swap directory
(`<swap-dir>/offload-demo-<pid>`) with anything a failed close left in it. Only
SIGKILL leaves files behind; the next run removes directories of dead runs, and
under `--nproc` the launching process removes a killed rank's once the launch
ended.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import threading
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import PAGE, IoConfig, format_bytes, load_config, parse_bytes
from .args import (UsageError, byte_size, count, directory, integer, missing_directories,
                   number, output_file, parse_count, ranks, remove_directories)
from .demo_launch import peer_lost, relaunch, remove_dead_runs
from .demo_view import DIR_PREFIX, Reporter, _free_bytes, print_header
from .gpt import GPT, PRESETS, GPTConfig, ReversalTask, preset_for_params, state_bytes_per_param

log = logging.getLogger(__name__)

DEFAULT_SIZE = "small"
DEFAULT_STEPS = 60
MAX_PARAMS = 100 * 10**9  # --size: beyond it the meta model alone takes minutes to build
MAX_BATCH = 4096  # --batch: sequences per step and process
TRACE_STEP = 3          # steady state: step 1 records the access trace, 2 runs the plan
GROW_STEP = 16 << 20    # swap-file preallocation unit: small, so the disk estimate is tight
SWAP_FILES = 3          # parameters, gradients, optimizer state, per rank
_PLACES = ("device", "host", "nvme")
IO_BLOCK = IoConfig().block_size  # io.buffer_budget holds at least one request


@dataclass(frozen=True)
class SizeDefaults:
    """Per-size defaults: a learning rate that learns the task in 30-40 steps (searched
    on the presets' shapes), budgets that hold about 1/8 (device) and 1/4 (host) of
    the training state, and a group size that gives every size several groups."""

    lr: float
    device_budget: str
    host_budget: str
    io_buffers: str
    group_size: int


_DEFAULTS = {
    "tiny": SizeDefaults(3e-3, "1MiB", "2MiB", "4MiB", 1 << 16),
    "small": SizeDefaults(3e-4, "24MiB", "48MiB", "32MiB", 1 << 22),
    "base": SizeDefaults(3e-4, "64MiB", "128MiB", "32MiB", 1 << 22),
    "large": SizeDefaults(2e-4, "192MiB", "384MiB", "64MiB", 1 << 22),
}


def _defaults_for(size: str, model: GPTConfig) -> SizeDefaults:
    if size in _DEFAULTS:
        return _DEFAULTS[size]
    state = model.params * state_bytes_per_param("fp32")
    mib = lambda n: f"{max(1, n >> 20)}MiB"  # noqa: E731
    return SizeDefaults(2e-4, mib(state // 8), mib(state // 4), "64MiB", 1 << 22)


__all__ = ["DemoPlan", "StepMeter", "add_arguments", "build_plan", "run",
           "remove_swap_dir", "signal_exit_code", "swap_dir_for_run"]


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoPlan:
    """Everything one run does, decided before anything is allocated."""

    model: GPTConfig
    size: str
    length: int          # tokens per sequence to reverse
    batch: int           # sequences per step and rank
    steps: int
    lr: float
    dtype: str
    params: str
    grads: str
    optimizer: str
    device_budget: int
    host_budget: int
    io_buffers: int
    world: int
    swap_root: Path
    trace: Path | None
    trace_step: int
    seed: int
    group_size: int

    @property
    def n_params(self) -> int:
        return self.model.params

    @property
    def state_bytes(self) -> int:
        """Bytes of training state over all ranks (see `state_bytes_per_param`)."""
        return self.n_params * state_bytes_per_param(self.dtype)

    @property
    def compute_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def per_rank(self, bytes_per_param: int) -> int:
        return -(-self.n_params * bytes_per_param // self.world)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * 2 * self.length * self.world

    def disk_needed(self) -> int:
        """Bytes of swap space this run may take on the swap disk, all ranks together:
        each kind homed on NVMe twice over, but the gradients (a step keeps the
        previous version of the parameters and optimizer state it updates until it
        commits as a whole: [Note: all or nothing] in offload/engine/step.py), and
        the preallocation slack."""
        per_param = 0
        if self.params == "nvme":
            per_param += 2 * self.compute_bytes
        if self.grads == "nvme":
            per_param += 4
        if self.optimizer == "nvme":
            per_param += 2 * 12
        per_rank = self.per_rank(per_param) + SWAP_FILES * GROW_STEP
        return int(per_rank * self.world * 1.1)

    def config(self, swap_dir: Path, direct: bool | None = None) -> dict[str, Any]:
        """The `offload.initialize` configuration of one rank; `direct` None: O_DIRECT
        where `swap_dir` takes it (probed)."""
        direct = _direct_ok(swap_dir) if direct is None else direct
        return {
            "engine": {"dtype": self.dtype, "params": self.params, "grads": self.grads,
                       "optimizer": self.optimizer, "seed": self.seed,
                       "group_size": self.group_size},
            "optim": {"lr": self.lr, "weight_decay": 0.0},
            "io": {"paths": [str(swap_dir)], "buffer_budget": self.io_buffers,
                   "grow_step": GROW_STEP, "direct": direct},
            "store": {"device_budget": self.device_budget, "host_budget": self.host_budget},
        }


def _direct_ok(path: Path) -> bool:
    from ..io import probe_direct

    ok, why = probe_direct(str(path), "--swap-dir")
    if not ok:
        log.warning("%s; swap files go through the page cache", why)
    return ok


def _parse_size(text: str) -> tuple[str, GPTConfig]:
    """A preset name, or a parameter count such as '50M' or '1.2B'."""
    if text in PRESETS:
        return text, PRESETS[text]
    n = parse_count(text)
    if n is None or n < 1:
        raise UsageError(f"--size: {text!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "positive parameter count; give e.g. small or 50M")
    if n > MAX_PARAMS:
        raise UsageError(f"--size: {text!r} is more than the demo's {MAX_PARAMS / 1e9:.0f}B "
                         "parameters (1.6 TB of training state); give e.g. 1B")
    return text, preset_for_params(n, vocab=PRESETS["tiny"].vocab,
                                   max_seq=PRESETS["tiny"].max_seq, head_dim=64)


def build_plan(args: argparse.Namespace) -> DemoPlan:
    """The run's plan from the parsed flags; raises `UsageError` naming a flag to change
    (or `ConfigError` for a value the flags alone do not show), before anything is made."""
    if args.tiny and args.size not in (None, "tiny"):
        raise UsageError(f"--tiny and --size {args.size}: give one of them (--tiny is "
                         "--size tiny)")
    size, model = _parse_size("tiny" if args.tiny else args.size or DEFAULT_SIZE)
    if not 1 <= args.length <= model.max_seq // 2:
        raise UsageError(f"--length: {args.length} is out of range for this model; give "
                         f"1..{model.max_seq // 2}")
    if args.steps < 1 or args.batch < 1 or args.nproc < 1 or args.trace_step < 1:
        raise UsageError("--steps, --batch, --nproc and --trace-step must be at least 1")
    launch = launched()
    world = launch[1] if launch is not None else args.nproc
    d = _defaults_for(size, model)
    plan = DemoPlan(
        model=model, size=size, length=args.length, batch=args.batch, steps=args.steps,
        lr=d.lr if args.lr is None else args.lr, dtype=args.dtype,
        params=args.params, grads=args.grads, optimizer=args.optimizer,
        device_budget=parse_bytes(args.device_budget or d.device_budget, "--device-budget"),
        host_budget=parse_bytes(args.host_budget or d.host_budget, "--host-budget"),
        io_buffers=parse_bytes(args.io_buffers or d.io_buffers, "--io-buffers"), world=world,
        swap_root=Path(args.swap_dir).absolute(),
        trace=None if args.trace in ("", "none") else Path(args.trace).absolute(),
        trace_step=min(args.trace_step, args.steps), seed=args.seed, group_size=d.group_size)
    plan = _defaults_that_train(plan, device=not args.device_budget, host=not args.host_budget)
    _check_fits(plan)
    if plan.trace is not None:  # before any work: the run is minutes long
        from .view_demo import check_outputs
        check_outputs(plan.trace, world)
    load_config(plan.config(plan.swap_root, direct=True))  # every value, before any work
    return plan


def _check_fits(plan: DemoPlan) -> None:
    """Refuses placements whose home tier cannot hold what is homed there, and a
    device budget that cannot hold the largest group while it is gathered."""
    homes = {"device": 0, "host": 0}
    if plan.params in homes:
        homes[plan.params] += plan.per_rank(plan.compute_bytes)
    if plan.grads in homes:
        homes[plan.grads] += plan.per_rank(4)
    budgets = {"device": plan.device_budget, "host": plan.host_budget}
    for tier, need in homes.items():
        if need > budgets[tier]:
            raise UsageError(
                f"--{tier}-budget: the partitions homed on {tier} take {format_bytes(need)} per "
                f"rank, over --{tier}-budget {format_bytes(budgets[tier])}; raise the budget "
                "or move --params/--grads to nvme")
    group = _largest_group(plan.model, plan.group_size, plan.world) * plan.compute_bytes
    if 2 * group > plan.device_budget:
        raise UsageError(
            f"--device-budget: {format_bytes(plan.device_budget)} is under two "
            f"of the model's largest group ({format_bytes(group)} each, one in use and one "
            "arriving); raise it or pick a smaller --size")


def _groups(model: GPTConfig, group_size: int, world: int) -> list:
    """The model's groups, from the engine's own partitioning (built on meta)."""
    from ..engine.meta import meta_device
    from ..engine.units import build_units

    with meta_device():
        net = GPT(model)
    return build_units(net, group_size, world)[1]


def _largest_group(model: GPTConfig, group_size: int, world: int) -> int:
    """Elements of the largest gathered group."""
    return max(g.padded for g in _groups(model, group_size, world))


def _defaults_that_train(plan: DemoPlan, device: bool, host: bool) -> DemoPlan:
    """The plan with each default budget (`device`, `host`: the flag not given) raised,
    where it is under it, to the engine's minimum working set for this model and
    placement, whole MiB: a --size given as a parameter count gets about 1/8 and 1/4
    of its state, which for a small model is less than two of its groups."""
    if not (device or host):
        return plan
    from ..engine.working_set import working_set

    groups = _groups(plan.model, plan.group_size, plan.world)
    need = working_set(load_config(plan.config(plan.swap_root, direct=True)), groups)
    # and two of the largest group gathered (`_check_fits`): one in use, one arriving
    two = 2 * max(g.padded for g in groups) * plan.compute_bytes
    mib = lambda n: -(-n // (1 << 20)) << 20  # noqa: E731
    return dataclasses.replace(
        plan, device_budget=max(plan.device_budget, mib(max(need.device, two))) if device
        else plan.device_budget,
        host_budget=max(plan.host_budget, mib(need.host)) if host else plan.host_budget)


# -- swap directory ------------------------------------------------------------------------------
def swap_dir_for_run(root: Path, notes: list[str], prefix: str = DIR_PREFIX) -> Path:
    """`root/<prefix><pid>`, new; first removes such directories of processes that
    are gone (a run killed by SIGKILL), noting each in `notes`."""
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_runs(root, notes, prefix)
    path = root / f"{prefix}{os.getpid()}"
    path.mkdir()
    return path


def remove_swap_dir(path: Path, created: list[str]) -> bool:
    """Removes this run's swap directory, and the directories above it that this run
    made (`created`, from `missing_directories` before it made them) while they are
    empty; True when nothing of it is left."""
    shutil.rmtree(path, ignore_errors=True)
    remove_directories(created)
    return not path.exists()


# -- measuring a step ----------------------------------------------------------------------------
@dataclass
class StepBytes:
    """NVMe traffic of one step (bytes): the store's moves plus the optimizer's."""

    read: int = 0
    written: int = 0


class StepMeter:
    """Bytes read from and written to NVMe per step (`engine.nvme_bytes()` deltas)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._last = self.totals()

    def totals(self) -> StepBytes:
        return StepBytes(*self._engine.nvme_bytes())

    def step(self) -> StepBytes:
        """Bytes since the previous call."""
        now = self.totals()
        out = StepBytes(now.read - self._last.read, now.written - self._last.written)
        self._last = now
        return out


def nvme_used(engine: Any) -> int:
    """Swap bytes in use now: the store's NVME tier and the optimizer's state."""
    swap = engine.optimizer.swap
    return engine.store.stats().tiers["NVME"].used + (swap.used_bytes if swap else 0)


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float
    tokens_per_s: float
    read: int
    written: int
    device_peak: int
    host_peak: int
    nvme_used: int

    def as_json(self) -> dict[str, Any]:
        return {"event": "step", **self.__dict__}


# -- signals -------------------------------------------------------------------------------------
class StopRequest:
    """SIGINT once: `requested` becomes True (stop after this step). SIGINT again:
    KeyboardInterrupt now. SIGTERM: SystemExit(143) now. See [Note: stopping].
    Under `--nproc`, the launching process asks by creating `stop_file` instead, and
    for now by SIGWINCH ([Note: stopping under torchrun]).
    On exit the previous handlers come back, except that after a requested stop
    SIGINT stays ignored: the command is on its way out, its files removed."""

    def __init__(self, on_first: Callable[[], None] = lambda: None,
                 stop_file: str | None = None) -> None:
        self.requested = False
        self.by_launcher = False
        self._on_first = on_first
        self._stop_file = stop_file
        self._old: dict[int, Any] = {}

    def poll(self) -> bool:
        """Whether a stop was asked for (by a signal here or by the launcher)."""
        if not self.requested and self._stop_file and os.path.exists(self._stop_file):
            self.requested = self.by_launcher = True
        return self.requested

    def _sigint(self, signum: int, frame: Any) -> None:
        if self._stop_file:  # a rank: SIGINT comes from _now alone (a session of its own)
            self.requested = self.by_launcher = True
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._on_first()

    @staticmethod
    def _now(signum: int, frame: Any) -> None:
        # as SIGINT, so that the engine defers it to a safe point as it does Ctrl-C
        signal.raise_signal(signal.SIGINT)

    @staticmethod
    def _sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {signal.SIGINT: signal.signal(signal.SIGINT, self._sigint),
                         signal.SIGTERM: signal.signal(signal.SIGTERM, self._sigterm)}
            if self._stop_file:
                self._old[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, self._now)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if self._old and self.requested:
            # the user asked to stop and everything is cleaned up: a further Ctrl-C
            # while the process exits must not turn a clean exit into a traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# -- the run -------------------------------------------------------------------------------------
def train(plan: DemoPlan, rank: int, reporter: Reporter, stop: StopRequest,
          swap_dir: Path) -> dict[str, Any]:
    """Builds the engine, runs the steps, returns the summary (every rank)."""
    from ..engine import initialize
    from ..trace import TraceRecorder
    from .view_demo import record_run_facts, start_traced_step, write_traced_step

    recorder = TraceRecorder(enabled=False, rank=rank, process_name=f"demo rank {rank}")
    recorder.declare_track("compute")
    if plan.trace is not None:  # before the engine: its threads would disturb the measures
        record_run_facts(recorder, plan, swap_dir, rank)
    t0 = time.perf_counter()
    engine = initialize(lambda: GPT(plan.model), plan.config(swap_dir), recorder=recorder)
    try:
        summary: dict[str, Any] = {"init_seconds": time.perf_counter() - t0}
        task = ReversalTask(plan.model.vocab - 1, plan.length, plan.batch,
                            seed=plan.seed * 1000 + rank)
        meter = StepMeter(engine)
        engine.store.take_peaks()  # the steps' windows start here, not at initialize
        records: list[StepRecord] = []
        reporter.start(plan)
        try:
            for step in range(1, plan.steps + 1):
                traced = plan.trace is not None and step == plan.trace_step
                if traced:
                    start_traced_step(recorder, engine.store)
                rec, stopping = _one_step(engine, task, step, plan, meter, stop)
                if traced:
                    engine.store.wait_all()  # the step's last evictions end inside the trace
                    summary.update(write_traced_step(plan, recorder, step, rank, engine.store))
                records.append(rec)
                reporter.step(rec)
                if stopping:
                    break
        finally:
            reporter.stop()
        summary.update(_summarise(plan, records, engine, stop.poll()))
    finally:
        engine.close()
    return summary


def _one_step(engine: Any, task: ReversalTask, step: int, plan: DemoPlan, meter: StepMeter,
              stop: StopRequest) -> tuple[StepRecord, bool]:
    """One optimizer step; the loss, bytes and stop flag agreed by every rank."""
    t = time.perf_counter()
    x, y = task.next_batch()
    # on for the traced step only; the engine records the phases inside the step
    with engine.recorder.span("step", cat="compute", track="compute", step=step):
        loss = ReversalTask.loss(engine(x.to(engine.device)), y)
        engine.backward(loss)
        engine.step()
    moved = meter.step()
    value, flag, read, written = _all_sum([loss.item(), float(stop.poll()),
                                           float(moved.read), float(moved.written)])
    seconds = time.perf_counter() - t
    peak = engine.store.take_peaks()
    rec = StepRecord(step, value / plan.world, seconds, plan.tokens_per_step / seconds,
                     int(read), int(written), peak.get("DEVICE", 0), peak.get("HOST", 0),
                     nvme_used(engine))
    return rec, flag > 0


def _all_sum(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _summarise(plan: DemoPlan, records: list[StepRecord], engine: Any,
               interrupted: bool) -> dict[str, Any]:
    stats = engine.store.stats()
    steady = records[1:] or records  # step 1 also records the access trace
    mean = sum(r.seconds for r in steady) / max(1, len(steady))
    return {
        "steps": len(records), "interrupted": interrupted,
        "loss_first": records[0].loss if records else None,
        "loss_last": records[-1].loss if records else None,
        "chance_loss": ReversalTask(plan.model.vocab - 1, plan.length, 1).chance_loss,
        "step_seconds": mean, "tokens_per_s": plan.tokens_per_step / mean if mean else 0.0,
        "read_per_step": sum(r.read for r in steady) // max(1, len(steady)),
        "written_per_step": sum(r.written for r in steady) // max(1, len(steady)),
        "device_peak": stats.tiers["DEVICE"].peak, "host_peak": stats.tiers["HOST"].peak,
        "nvme_peak": max((r.nvme_used for r in records), default=0),
        "params": plan.n_params, "state_bytes": plan.state_bytes,
    }


# -- command line --------------------------------------------------------------------------------
# (flag, options): one table for the parser and for the argv of a re-launch under torchrun.
_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--size", dict(default=None, type=count(1, example="50M", also=tuple(PRESETS)),
                    help=f"model: {', '.join(PRESETS)} or a parameter count such as 50M "
                    f"(default {DEFAULT_SIZE}: {PRESETS[DEFAULT_SIZE].params / 1e6:.1f}M)")),
    ("--tiny", dict(action="store_true", help="the tiny model (seconds; for tests)")),
    ("--steps", dict(type=integer(1, example=DEFAULT_STEPS), default=DEFAULT_STEPS,
                     help=f"optimizer steps (default {DEFAULT_STEPS})")),
    ("--batch", dict(type=integer(1, MAX_BATCH, example=16), default=16,
                     help=f"sequences per step and process, 1..{MAX_BATCH} (default 16)")),
    ("--length", dict(type=integer(1, example=8), default=8,
                      help="tokens per sequence to reverse (default 8)")),
    ("--lr", dict(type=number(0, above=True, example=3e-4), default=None,
                  help="learning rate, a positive number (default: per size)")),
    ("--dtype", dict(choices=["fp32", "bf16", "fp16"], default="fp32", help="compute "
                     "precision; master weights and gradients stay fp32 (default fp32)")),
    ("--params", dict(choices=_PLACES, default="nvme",
                      help="home tier of the weights (default nvme)")),
    ("--grads", dict(choices=_PLACES, default="nvme",
                     help="home tier of the gradients (default nvme)")),
    ("--optimizer", dict(choices=["host", "nvme"], default="nvme",
                         help="fp32 master weights and Adam moments (default nvme)")),
    ("--device-budget", dict(default=None, type=byte_size(PAGE, example="24MiB"),
                             help="bytes the device tier may hold, e.g. 24MiB "
                             "(default: about 1/8 of the state, at least the minimum "
                             "the model needs; small: 24MiB)")),
    ("--host-budget", dict(default=None, type=byte_size(PAGE, example="48MiB"),
                           help="bytes the host tier may hold, e.g. 48MiB "
                           "(default: about 1/4 of the state, at least the minimum "
                           "the model needs; small: 48MiB)")),
    ("--io-buffers", dict(default=None, type=byte_size(IO_BLOCK, example="32MiB"),
                          help="bytes of host staging buffers for the optimizer's NVMe "
                          "pipeline, at least one I/O block (default: small 32MiB)")),
    ("--swap-dir", dict(default="offload-swap", type=directory("swap directory"),
                        help="directory for swap files; the run uses a new sub-directory "
                        "and removes it on exit (default ./offload-swap)")),
    ("--trace", dict(default="offload-demo.trace.json", type=output_file(none=("none", "")),
                     help="Chrome-trace file of one step, for https://ui.perfetto.dev "
                     "(default offload-demo.trace.json; 'none': no trace)")),
    ("--trace-step", dict(type=integer(1, example=TRACE_STEP), default=TRACE_STEP,
                          help=f"the step traced (default {TRACE_STEP})")),
    ("--seed", dict(type=integer(0, (1 << 32) - 1, example=0), default=0,
                    help="seed of the weights and the data (default 0)")),
    ("--nproc", dict(type=ranks(), default=1,
                     help="processes (ranks): >1 runs under torchrun with gloo, each rank "
                     "holding 1/N of the state (default 1)")),
    ("--json", dict(action="store_true", help="print one JSON object per step and a summary "
                    "object at the end (with \"error\" when the run failed) instead of the "
                    "progress bar and table")),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Train a GPT-style decoder on sequence reversal while its training state "
                     "is several times the device and host budgets; the rest is on NVMe.")
    for flag, options in _OPTIONS:
        p.add_argument(flag, **options)


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = []
    for flag, options in _OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if flag == "--nproc" or value is None:
            continue
        if options.get("action") == "store_true":
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    launch = launched()
    rank = launch[0] if launch is not None else 0
    reporter = Reporter(json_lines=args.json, quiet=rank != 0)
    shown = os.environ.get("OFFLOAD_DEMO_HEADER") == "1"
    if rank == 0 and not shown:
        if not _disk_ok(plan, reporter):
            return 1
        print_header(reporter, plan)
    if plan.world > 1 and launch is None:
        return relaunch(_child_argv(args), plan, reporter)
    return _run_rank(plan, rank, reporter)


def launched() -> tuple[int, int] | None:
    """(rank, world) where a launcher started this process (torchrun, which this command
    re-launches itself under), else None: a RANK or WORLD_SIZE left in a shell is no
    launch (RANK=1 alone ran the demo silently, as a rank that does not print)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UsageError(f"under torchrun, RANK and WORLD_SIZE must be integers; got "
                         f"RANK={os.environ.get('RANK')!r}, "
                         f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from None


def _disk_ok(plan: DemoPlan, reporter: Reporter) -> bool:
    free = _free_bytes(plan.swap_root)
    need = plan.disk_needed()
    if free < need:
        reporter.error(f"offload demo: {plan.swap_root} has {format_bytes(free)} free; the "
                       f"swap files need about {format_bytes(need)}. Free some space, give "
                       "--swap-dir on a bigger disk, or pick a smaller --size")
        return False
    return True


def _run_rank(plan: DemoPlan, rank: int, reporter: Reporter) -> int:
    import torch.distributed as dist

    if plan.world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    summary: dict[str, Any] = {}
    code = 1
    failure: BaseException | None = None
    with StopRequest(lambda: reporter.note("stopping after this step (Ctrl-C again to stop "
                                           "now); swap files are removed either way"),
                     os.environ.get("OFFLOAD_DEMO_STOP_FILE")) as stop:
        created = missing_directories(str(plan.swap_root))
        notes: list[str] = []
        swap_dir = swap_dir_for_run(plan.swap_root, notes)
        for note in notes:
            reporter.note(note)
        try:
            summary = train(plan, rank, reporter, stop, swap_dir)
            # stopped through the launcher's file: exit 0 so torchrun ends quietly
            code = 130 if summary["interrupted"] and not stop.by_launcher else 0
        except BaseException as e:
            code = signal_exit_code(e)
            if code is not None and stop.by_launcher:
                code = 0  # stopped by the launcher, which says how: torchrun ends quietly
            if code is None:
                code = 1
                summary = {"interrupted": False,
                           "error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
                if plan.world > 1 and peer_lost(e):  # the rank that ended first says why
                    reporter.error(f"offload demo: rank {rank}: stopped, its connection to "
                                   "another rank was lost (that rank ended first)")
                else:  # raised after the summary, which says where the swap files went
                    failure = e
            else:
                if not isinstance(e, (KeyboardInterrupt, SystemExit)):
                    reporter.note(f"while stopping: {type(e).__name__}: {e}")
                summary = {"interrupted": True}
        finally:
            left = sorted(p.name for p in swap_dir.glob("*.swap"))
            if left:
                reporter.note(f"engine.close() left {', '.join(left)} in {swap_dir}; removing")
            summary["swap_dir"] = str(swap_dir)
            summary["swap_removed"] = remove_swap_dir(swap_dir, created)
            if dist.is_initialized():
                dist.destroy_process_group()
        reporter.summary(plan, summary)
    if failure is not None:
        raise failure
    return code


def signal_exit_code(e: BaseException) -> int | None:
    """The exit code when `e` is, or was caused by, a stop at once (second Ctrl-C:
    130, SIGTERM: 143); None for any other error. Layers below may wrap the
    KeyboardInterrupt (the optimizer's pipeline raises OptimStepError from it)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return 130
        if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code > 128:
            return e.code
        e = e.__cause__ or e.__context__
    return None
