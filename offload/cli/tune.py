"""`offload tune MODEL --swap DIR`: chooses a whole configuration from measurements and
the step simulator, and writes it as TOML that `offload.initialize` reads unchanged.

Phases (each with a progress bar on stderr): probe the machine (disk under DIR
at each block size and queue depth, host copy, CPU Adam, the compute device's
matrix rate: offload/cli/tune_probe.py); record the model's step on `meta`
(its groups at a few group sizes, the FLOPs of each unit: model_arg.py);
search placements, budget splits, group size, buffers, prefetch depth and I/O
settings with the simulator (offload/planner/search.py); calibrate it by real
steps of a few classes; with `--verify K`, run the best K for real and print
predicted against measured; measure the fastest measured configurations
(at most 2 of a class) again in interleaved rounds and choose on the upper
quartile and median of their steps (tune_verify.py); show the ranked table; write the chosen one.
`--minutes` bounds the whole run ([Note: the time budget] in docs/tuning.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..config import EngineConfig, IoConfig, OptimConfig, format_bytes, load_config, toml_loads
from ..files import replace_atomically
from ..io.process import memory_limit_note, physical_memory
from ..planner.estimate import PLACEMENTS, Placement
from ..planner.search import (Budgets, Candidate, Machine, Space, StepShape, candidates, score,
                              search, shortfall)
from ..planner.sizes import STATE_DTYPES
from .args import (UsageError, byte_size, choice_list, directory, escape, integer,
                   missing_directories, number, output_file, remove_directories, table_console,
                   value_list)
from .estimate import add_training_arguments, minimum
from .model_arg import MeasuredModel, add_model_arguments, measure_model, model_spec
from .tune_probe import MachineProbe, probe_adam, probe_copy, probe_disk, probe_matmul

__all__ = ["add_arguments", "calibration_picks", "run", "tune", "to_toml", "write_config"]

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_HOST, DEFAULT_DEVICE = 16 * GiB, 4 * GiB  # budgets where the machine has the memory
UNIT_OVERHEAD_S = 5e-4  # hooks and the gather's bookkeeping per unit use (see docs/tuning.md)
CHUNK_OVERHEAD_S = 5e-4  # per optimizer chunk streamed from NVMe (see docs/tuning.md)
# [Note: the time budget] in docs/tuning.md: the fraction of --minutes after which each
# phase of real steps starts no new measurement (the probes and the search come first)
CALIBRATE_END, VERIFY_END, FINAL_END = 0.45, 0.6, 0.75
FINAL_ROUNDS, FINAL_STEPS = 4, 3  # rounds of the finalists, timed steps each
PER_CLASS = 2  # finalists of one class: its knobs (I/O, prefetch, buffers) matter too
HEADER = "written by offload tune"  # the first line of the files --write writes (after "# ")


class MachineError(Exception):
    """A condition of the machine, not of the flags (a disk that refuses the probe's
    writes): one line, exit code 1."""


def _bar(quiet: bool):
    """A rich progress display on stderr (nothing when quiet)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<24}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=quiet, transient=False)


@contextmanager
def _phase(progress, name: str, total: int) -> Iterator[Any]:
    task = progress.add_task(name, total=total)
    yield lambda n=1: progress.advance(task, n)
    progress.update(task, completed=total)


def group_sizes(params: int, given: tuple[int, ...] | None) -> list[int]:
    """The group sizes searched: given, or the default and finer/coarser splits."""
    if given:
        return sorted(set(given))
    out = {EngineConfig().group_size, max(4096, params // 32), max(4096, params // 8),
           max(4096, params // 2)}
    kept: list[int] = []
    for g in sorted(g for g in out if g <= max(params, 4096)):
        if not kept or g > kept[-1] * 1.05:  # one within 5% of another groups the same
            kept.append(g)
    return kept


def record(spec, sizes: list[int], flops_rate: float, device: str, tick,
           max_grad_norm: float = 0.0, grad_accum_steps: int = 1) -> list[StepShape]:
    """The model on meta at each group size: partitions, unit compute seconds (FLOPs
    over `flops_rate`), and each placement's minimum working set, for training that
    clips at `max_grad_norm` (0: none) and sums `grad_accum_steps` micro-batches."""
    shapes = []
    for gs in sizes:
        mm = measure_model(spec, gs)
        if mm.containers:  # a ModuleList as a unit is never called: not a grouping
            tick()
            continue
        units = tuple((tuple(g), f / flops_rate) for g, f in zip(mm.unit_groups, mm.unit_flops))
        keys = {"group_size": gs, "grad_accum_steps": grad_accum_steps}
        mins = {p.name: tuple(minimum(mm, {**p.engine_keys(), **keys}, device,
                                      max_grad_norm).values()) for p in PLACEMENTS}
        shapes.append(StepShape(gs, spec.dtype, mm.shards, units, mins, max_grad_norm > 0,
                                grad_accum_steps))
        tick()
    return shapes


def _largest_linear(mm: MeasuredModel) -> tuple[int, int]:
    from torch import nn

    from ..engine.meta import meta_device

    with meta_device():
        model = mm.spec.build()
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not lin:
        return 1024, 1024
    big = max(lin, key=lambda m: m.in_features * m.out_features)
    return big.in_features, big.out_features


def probe_machine(args, spec, mm: MeasuredModel, device: str, progress) -> MachineProbe:
    """Disk, copy, Adam (fp32 moments and each compressed form) and matrix rates
    ([module docstring])."""
    free = shutil.disk_usage(args.swap).free
    size = min(args.probe_size, max(8 * MiB, free // 8))
    seconds = {}
    t = time.perf_counter()
    with _phase(progress, "probe disk", 4) as tick:
        try:  # a quarter of the free space at most: the swap's disk may be nearly full
            disk = probe_disk(os.path.join(args.swap, ".offload-tune-probe"), size, tick=tick,
                              limit=free // 4)
        except OSError as e:
            raise MachineError(
                f"--swap: the disk probe cannot write under {os.path.abspath(args.swap)} "
                f"({e.strerror or e}; {format_bytes(free)} was free there): free space on "
                "that disk or give --swap on another (the probe's files were removed)") from e
    seconds["disk"] = time.perf_counter() - t
    t = time.perf_counter()
    with _phase(progress, "probe host, adam, compute", 3) as tick:
        copy = probe_copy(device)
        tick()
        adam = probe_adam()
        by_state = {sd: probe_adam(state_dtype=sd) for sd in STATE_DTYPES if sd != "fp32"}
        tick()
        inner, cols = _largest_linear(mm)
        flops = probe_matmul(mm.tokens, inner, cols, spec.dtype, device)
        tick()
    seconds["host"] = time.perf_counter() - t
    return MachineProbe(disk, free, copy, adam, flops, seconds, by_state)


def _defaults(args, device: str) -> Candidate:
    e, o, io = EngineConfig(), OptimConfig(), IoConfig()
    return Candidate(Placement(e.params, e.grads, e.optimizer), e.group_size, e.prefetch_depth,
                     o.buffers, min(io.buffer_budget, 64 * MiB), io.block_size, io.queue_depth,
                     0, 0)


def config_of(scored, spec, args, device: str) -> dict[str, Any]:
    """The whole configuration dict of a scored candidate (what --write writes): its
    keys, the model's dtype, the swap directory and the clipping and accumulation asked
    for."""
    keys = scored.candidate.keys()
    if args.max_grad_norm:
        keys["optim"]["max_grad_norm"] = args.max_grad_norm
    if args.grad_accum_steps > 1:
        keys["engine"]["grad_accum_steps"] = args.grad_accum_steps
    keys["engine"]["dtype"] = spec.dtype
    keys["io"]["paths"] = [os.path.abspath(args.swap)]
    keys["store"]["device"] = device
    return keys


def _toml_value(v: Any) -> str:
    """A scalar or list as TOML. Strings are written by hand: JSON's escapes of a
    character beyond the BMP are a surrogate pair, which TOML refuses (a swap path
    with such a character made a file that does not load), and JSON leaves DEL raw."""
    if isinstance(v, str):
        return '"' + "".join(_toml_char(c) for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # numbers and booleans are written the same


def _toml_control(c: str) -> bool:
    """Whether `c` is one of the control characters a TOML basic string escapes."""
    return ord(c) < 0x20 or ord(c) == 0x7F


def _toml_char(c: str) -> str:
    """One character of a TOML basic string."""
    if c in '"\\':
        return "\\" + c
    if _toml_control(c):
        return f"\\u{ord(c):04X}"
    return c  # any other character (printable or not) may stand as itself


def to_toml(cfg: dict[str, Any], header: str = "") -> str:
    """A configuration dict (sections of scalars and lists) as TOML text."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, values in cfg.items():
        lines += ["", f"[{section}]"]
        for k, v in values.items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _row(s, tokens: int) -> dict[str, Any]:
    c = s.candidate
    return {"placement": c.placement.name, "group_size": c.group_size,
            "prefetch_depth": c.prefetch_depth, "buffers": c.buffers,
            "buffer_budget": c.buffer_budget, "block_size": c.block_size,
            "queue_depth": c.queue_depth, "store_host_budget": c.host_budget,
            "store_device_budget": c.device_budget, "predicted_step_s": s.step_s,
            "tokens_per_s": tokens / s.step_s if s.step_s else None,
            "compute_s": s.compute_s, "adam_s": s.adam_s, "exposed_io_s": s.exposed_io_s,
            "peak": s.peak, "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
            "limit": s.limit, "simulated_step_s": s.simulated_s, "calibration": s.calibration}


def tune(args: argparse.Namespace, quiet: bool = False,
         t0: float | None = None) -> dict[str, Any]:
    """Runs the phases up to calibration (started at `t0`, perf_counter seconds); the
    JSON-ready result (raises UsageError when nothing fits)."""
    import torch

    from .estimate import default_device

    spec = model_spec(args)
    device = default_device(args.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: 'cuda' is not available to torch here "
                         "(torch.cuda.is_available() is False); give --device cpu, or run "
                         "where a GPU is visible")
    t0 = time.perf_counter() if t0 is None else t0
    budgets = default_budgets(args.host_budget, args.device_budget, device)
    space = Space(state_dtypes=tuple(args.state_dtype))
    # a batch the model cannot take fails here: before the bars, and before --swap is made
    base = measure_model(spec, EngineConfig().group_size)
    check_memory_budgets(budgets, device)
    try:
        os.makedirs(args.swap, exist_ok=True)
    except OSError as e:  # what the checks before cannot see (/proc, /sys, a race)
        raise UsageError(f"--swap: {escape(args.swap)} cannot be created "
                         f"({e.strerror or e}); give a writable swap directory on the "
                         "NVMe") from None
    with _bar(quiet) as progress:
        sizes = group_sizes(base.params, args.group_sizes)
        with _phase(progress, "record step (meta)", len(sizes)) as tick:
            shapes = record(spec, sizes, 1.0, device, tick,  # unit "seconds" in FLOPs
                            args.max_grad_norm, args.grad_accum_steps)
        if not shapes:
            raise UsageError(f"--group-sizes: every group size makes a module that is never "
                             f"called (e.g. a ModuleList) a unit of {spec.target}; give other "
                             "sizes, e.g. smaller ones")
        # nothing fits: say so before minutes of probing. Only memory decides that here:
        # a disk too full for everything on NVMe leaves the placements in memory
        free = shutil.disk_usage(args.swap).free
        miss = _shortfall(shapes, budgets, device, free, space)
        if miss.keys() & {"device", "host"}:
            _impossible(miss, budgets)
        probe = probe_machine(args, spec, base, device, progress)
        shapes = [dataclasses.replace(s, units=tuple((g, f / probe.flops) for g, f in s.units))
                  for s in shapes]
        machine = Machine({(d.block_size, d.queue_depth): d.rates() for d in probe.disk},
                          probe.adam_eps, probe.copy_Bps, UNIT_OVERHEAD_S, probe.disk_free,
                          CHUNK_OVERHEAD_S, probe.adam_eps_by_state)
        defaults = _defaults(args, device)
        total = sum(sum(1 for _ in candidates(s, space, budgets, machine.disk, defaults))
                    for s in shapes)
        with _phase(progress, "search", total) as tick:
            ranked = search(shapes, space, budgets, machine, defaults, progress=tick)
        if not ranked:
            _impossible(_shortfall(shapes, budgets, device, probe.disk_free, space), budgets)
        ranked, factors, runs = calibrate_by_real_steps(ranked, spec, args, device, progress,
                                                        t0 + 60 * args.minutes * CALIBRATE_END)
    best_cfg = config_of(ranked[0], spec, args, device)
    tokens = base.tokens * args.grad_accum_steps
    offers = compressed_offers(ranked[0], shapes, budgets, machine, space)
    load_config(best_cfg)  # what initialize will be given: refused here, not later
    return {"command": "tune", "model": spec.target, "dtype": spec.dtype, "batch": spec.batch,
            "max_grad_norm": args.max_grad_norm, "grad_accum_steps": args.grad_accum_steps,
            "tokens_per_step": tokens, "params": base.params, "device": device,
            "budgets": {"host": budgets.host, "device": budgets.device},
            "probe": {"disk": [d.__dict__ for d in probe.disk], "disk_free": probe.disk_free,
                      "copy_Bps": probe.copy_Bps, "adam_elems_per_s": probe.adam_eps,
                      "adam_elems_per_s_by_state": probe.adam_eps_by_state,
                      "flops": probe.flops, "seconds": probe.seconds},
            "candidates": len(ranked), "calibration": factors, "calibration_runs": runs,
            "results": [{**_row(s, tokens), "config": config_of(s, spec, args, device)}
                        for s in ranked],
            "best": best_cfg, "offers": offers,
            "seconds": time.perf_counter() - t0, "torch": torch.__version__}


def default_budgets(host: int | None, dev: int | None, device: str) -> Budgets:
    """The budgets given, and for those not given 16 GiB of host and 4 GiB of device
    tier, or half and an eighth of a smaller machine's memory (on a CPU device both
    tiers are host memory; on a GPU the device tier defaults to 4 GiB)."""
    ram = physical_memory()
    if host is None:
        host = DEFAULT_HOST if ram is None else min(DEFAULT_HOST, ram // 2 // 4096 * 4096)
    if dev is None:
        dev = DEFAULT_DEVICE if ram is None or device != "cpu" else min(
            DEFAULT_DEVICE, ram // 8 // 4096 * 4096)
    return Budgets(host, dev)


def check_memory_budgets(budgets: Budgets, device: str) -> None:
    """Refuses budgets the machine cannot hold (`UsageError`): the search would put the
    training state in memory that is not there, and the written configuration would
    run out of memory instead of streaming from NVMe. On a CPU device both tiers are
    host memory; on a GPU the device tier is the GPU's."""
    import torch

    ram = physical_memory()  # the machine's, or a container's limit where lower
    if ram is not None:
        note = memory_limit_note()
        if budgets.host > ram:
            raise UsageError(f"--host-budget: {format_bytes(budgets.host)} is more than this "
                             f"machine's memory ({format_bytes(ram)}){note}; give at most "
                             f"{format_bytes(ram)}, less what else runs here")
        if device == "cpu" and budgets.host + budgets.device > ram:
            raise UsageError(f"--host-budget and --device-budget: together "
                             f"{format_bytes(budgets.host + budgets.device)}, more than this "
                             f"machine's memory ({format_bytes(ram)}){note}, which holds both "
                             "tiers on a CPU device; lower them to at most that together")
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(torch.device(device)).total_memory
        if budgets.device > gpu:
            raise UsageError(f"--device-budget: {format_bytes(budgets.device)} is more than "
                             f"the GPU's memory ({format_bytes(gpu)}); give at most "
                             f"{format_bytes(gpu)}, less activations and workspace")


def compressed_offers(best, shapes: list[StepShape], budgets: Budgets, machine: Machine,
                      space: Space, gain: float = 0.95) -> list[dict[str, Any]]:
    """The best configuration again with its Adam moments in each form the search was
    not allowed (`optim.state_dtype`: compressed moments change the numbers, so they
    are offered, not chosen): those predicted at most `gain` x its step, with the
    same calibration. Each: the state dtype, the predicted step and its ratio, the
    disk bytes per step."""
    shape = next((s for s in shapes if s.group_size == best.candidate.group_size), None)
    out = []
    for sd in STATE_DTYPES:
        if sd in space.state_dtypes or shape is None:
            continue
        s = score(shape, dataclasses.replace(best.candidate, state_dtype=sd), budgets, machine)
        if s is None:
            continue
        step = s.step_s * best.calibration
        if step <= gain * best.step_s:
            out.append({"state_dtype": sd, "predicted_step_s": step,
                        "x_best": step / best.step_s, "bytes_read": s.bytes_read,
                        "bytes_written": s.bytes_written})
    return out


def _shortfall(shapes: list[StepShape], budgets: Budgets, device: str, free: int,
               space: Space) -> dict[str, int]:
    """The bytes missing per tier for everything on NVMe at the finest grouping."""
    return shortfall(min(shapes, key=lambda s: s.group_size), budgets,
                     Machine({}, 1.0, float(device != "cpu"), 0.0, free),
                     min(space.buffer_budgets))


def _impossible(miss: dict[str, int], budgets: Budgets) -> None:
    flags = {"host": "--host-budget", "device": "--device-budget", "nvme": "--swap"}
    parts = [f"{tier}: {format_bytes(n)} missing" for tier, n in miss.items()]
    fixes = [f"raise {flags[t]} to at least {format_bytes(getattr(budgets, t) + n, up=True)}"
             if t != "nvme" else f"give --swap on a disk with {format_bytes(n, up=True)} more free"
             for t, n in miss.items()]
    if not miss:
        parts, fixes = ["no configuration of the search space fits"], ["raise --host-budget"]
    raise UsageError(f"the model does not fit the budgets plus the disk even with everything "
                     f"on NVMe ({'; '.join(parts)}); {' and '.join(fixes)}")


def render(result: dict[str, Any], top: int) -> None:
    from rich.table import Table

    con = table_console()
    micro = result.get("grad_accum_steps", 1)
    batch = f"batch {result['batch']}" + (f" x {micro} micro-batches" if micro > 1 else "")
    clip = f", clipping at {result['max_grad_norm']:g}" if result.get("max_grad_norm") else ""
    t = Table(title=f"offload tune: {escape(result['model'])} "
                    f"({result['params'] / 1e6:.1f}M params, "
                    f"{result['dtype']}, {batch}{clip}), host budget "
                    f"{format_bytes(result['budgets']['host'])}, device budget "
                    f"{format_bytes(result['budgets']['device'])}: best {top} of "
                    f"{result['candidates']}")
    cols = ("#", "placement", "group", "prefetch", "buffers", "io", "step s", "tokens/s",
            "device", "host", "nvme", "MB r/w", "limit")
    for c in cols:
        t.add_column(c, justify="left" if c in ("placement", "io", "limit") else "right")
    for i, r in enumerate(result["results"][:top], 1):
        t.add_row(str(i), r["placement"], f"{r['group_size'] / 1e6:.2f}M",
                  str(r["prefetch_depth"]),
                  f"{r['buffers']} in {format_bytes(r['buffer_budget'])}",
                  f"{r['block_size'] >> 20}MiB x {r['queue_depth']}",
                  f"{r['predicted_step_s']:.3f}", f"{r['tokens_per_s']:.0f}",
                  *(format_bytes(r["peak"][x]) for x in ("device", "host", "nvme")),
                  f"{r['bytes_read'] / 1e6:.0f}/{r['bytes_written'] / 1e6:.0f}", r["limit"])
    con.print(t)
    best = max(result["probe"]["disk"], key=lambda d: d["read_Bps"])
    con.print(f"disk ({best['engine']}): best read {best['read_Bps'] / 1e9:.2f} GB/s at "
              f"{best['block_size'] >> 20} MiB x {best['queue_depth']}; Adam "
              f"{result['probe']['adam_elems_per_s'] / 1e6:.0f} M elements/s; compute "
              f"{result['probe']['flops'] / 1e9:.1f} GFLOP/s; tuned in "
              f"{result['seconds']:.1f} s")
    for o in result.get("offers", []):
        con.print(f"offer: with optim.state_dtype = \"{o['state_dtype']}\" (compressed Adam "
                  f"moments, see docs/optim.md) the predicted step is "
                  f"{o['predicted_step_s']:.3f} s ({o['x_best']:.2f}x), "
                  f"{(o['bytes_read'] + o['bytes_written']) / 1e6:.0f} MB of disk traffic; "
                  f"--state-dtype {o['state_dtype']} searches with it")
    if result.get("written"):
        con.print(f"wrote {escape(result['written'])} (#{result['chosen']})")
    for v in result.get("verify", []):
        con.print(f"verify #{v['rank']} {v['placement']}: predicted {v['predicted_step_s']:.3f}"
                  f" s, measured {v['measured_step_s']:.3f} s "
                  f"(measured / predicted {v['ratio']:.2f})")
    if result.get("verify_left"):
        con.print(f"verify: {result['verify_left']} of the configurations --verify asked for "
                  "did not run (--minutes was spent, or their run failed); give more "
                  "--minutes")
    final = result.get("final")
    for i, f in enumerate(final["finalists"] if final else []):
        got = (f"median {f['median_s']:.3f} s ({f['p25_s']:.3f}-{f['p75_s']:.3f}, "
               f"{f['n']} steps)" if "median_s" in f else f"failed: {f['error']}")
        con.print(f"final {f['class']}: {got}" + (" <- written" if i == final["chosen"] else ""))


def verify(result: dict[str, Any], spec, k: int, quiet: bool,
           deadline: float | None = None) -> list[dict[str, Any]]:
    """Runs the best `k` configurations for real (those left at `deadline` are not
    run): predicted against measured."""
    from .tune_verify import measure_warm

    rows = result["results"][:k]
    with _bar(quiet) as progress, _phase(progress, "verify", len(rows)) as tick:
        got = measure_warm(spec, [r["config"] for r in rows], tick, deadline=deadline,
                           steps=5)
    out = []
    for i, (r, m) in enumerate(zip(rows, got)):
        if not m or "step_s" not in m:
            continue
        pred = r["predicted_step_s"]
        out.append({"rank": i + 1, "placement": r["placement"], "predicted_step_s": pred,
                    "measured_step_s": m["step_s"], "ratio": m["step_s"] / pred,
                    "measured": m})
    return out


def choose(result: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    """The configuration to write: the one the final rounds chose, else the fastest
    measured of every real run (calibration and verify), else the best predicted.
    Returns its rank in the results (None when it ranks nowhere) and its config."""
    final = result.get("final")
    runs = _measured_runs(result)
    if final:
        best = final["finalists"][final["chosen"]]["config"]
    elif runs:
        best = min(runs, key=lambda r: r[0])[1]
    else:
        return 1, result["results"][0]["config"]
    rank = next((i + 1 for i, r in enumerate(result["results"]) if r["config"] == best), None)
    return rank, best


def calibrate_by_real_steps(scored: list, spec, args, device: str, progress,
                            deadline: float) -> tuple[list, dict[str, float], list[dict]]:
    """[Note: calibration] in docs/tuning.md: a short real run of the best-predicted
    candidate of up to `--calibrate` classes (`calibration_picks`); their measured /
    simulated ratios scale every candidate of the class. Returns the ranking again,
    the ratios, and every measured run."""
    from ..planner.search import calibrate

    picks = calibration_picks(scored, args.calibrate)
    if not picks:
        return scored, {}, []
    runs: list[dict] = []
    with _phase(progress, "calibrate (real steps)", args.calibrate) as tick:
        runs += _calibration_runs(picks, spec, args, device, tick, deadline, warm=True)
        if runs and len(picks) < args.calibrate:  # the best placement's other group sizes
            best = min(runs, key=lambda r: r["measured_step_s"])["class"].split("@")[0]
            more = calibration_picks(scored, args.calibrate - len(picks), placement=best,
                                     skip=picks)
            runs += _calibration_runs(more, spec, args, device, tick, deadline, warm=False)
    factors = {r["class"]: r["measured_step_s"] / r["simulated_step_s"] for r in runs
               if r["simulated_step_s"] > 0}
    return calibrate(scored, factors), factors, runs


def calibration_picks(scored: list, n: int, placement: str | None = None,
                      skip: list = ()) -> list:
    """The best-predicted candidate of the classes to calibrate first, in predicted
    order: one per placement, the best-predicted of each optimizer tier among them,
    leaving room for the best placement's other group sizes within `n`. With
    `placement`: that placement's classes not in `skip`, up to `n`."""
    from ..planner.search import calibration_key

    firsts: dict[str, Any] = {}
    for s in scored:
        firsts.setdefault(calibration_key(s.candidate), s)
    if placement is not None:
        return [s for s in firsts.values() if s.candidate.placement.name == placement
                and s not in skip][:n]
    per_placement: dict[str, Any] = {}
    for s in firsts.values():
        per_placement.setdefault(s.candidate.placement.name, s)
    order = list(per_placement.values())
    tiers: dict[str, Any] = {}
    for s in order:
        tiers.setdefault(s.candidate.placement.optimizer, s)
    sizes = len({s.candidate.group_size for s in firsts.values()})
    picks = list(tiers.values()) + [s for s in order if s not in tiers.values()]
    picks = picks[:min(n, max(len(tiers), n - (sizes - 1)))]
    return sorted(picks, key=order.index)


def _calibration_runs(picks: list, spec, args, device: str, tick, deadline: float,
                      warm: bool) -> list[dict]:
    from ..planner.search import calibration_key
    from .tune_verify import measure_warm

    configs = [config_of(s, spec, args, device) for s in picks]
    got = measure_warm(spec, configs, tick, deadline=deadline, steps=3, warm=warm)
    runs = [{"config": c, "measured_step_s": m["step_s"], "simulated_step_s": s.simulated_s,
             "class": calibration_key(s.candidate)}
            for s, c, m in zip(picks, configs, got) if m and "step_s" in m]
    errors = [m["error"] for m in got if m and "error" in m]
    if warm and errors and not runs:
        # not one real step ran: a configuration written now would be one that cannot
        # train (the model, or its batch shape, fails for real where it ran on meta)
        raise UsageError(f"MODEL: every real step of {spec.describe()} failed ({errors[0]}; "
                         f"{len(errors)} of {len(configs)} configurations); check the model "
                         "and --batch/--seq (nothing was written)")
    return runs


def final_rounds(result: dict[str, Any], spec, n: int, quiet: bool,
                 deadline: float) -> dict[str, Any] | None:
    """[Note: final rounds] in docs/tuning.md: the `n` fastest measured configurations
    (calibration and verify runs, by their median step; at most `PER_CLASS` of one
    class) measured again in interleaved rounds until `deadline`; each one's every
    timed step, median and spread, and the index of the one chosen
    (`steadiest_fastest`)."""
    from .tune_verify import measure_rounds, spread, steadiest_fastest

    finalists: list[tuple[str, dict]] = []  # (class, config)
    for _, cfg, cls in sorted(_measured_runs(result), key=lambda r: r[0]):
        if len(finalists) < n and (cls, cfg) not in finalists and \
                sum(c == cls for c, _ in finalists) < PER_CLASS:
            finalists.append((cls, cfg))
    if len(finalists) < 2 or time.perf_counter() > deadline:
        return None
    configs = {str(i): cfg for i, (_, cfg) in enumerate(finalists)}
    with _bar(quiet) as progress, \
            _phase(progress, "final rounds", FINAL_ROUNDS * len(configs)) as tick:
        got = measure_rounds(spec, configs, rounds=FINAL_ROUNDS, steps=FINAL_STEPS,
                             deadline=deadline, tick=tick)
    stats = {k: spread(v) for k, v in got["samples"].items() if v}
    if not stats:
        return None
    chosen = int(steadiest_fastest(stats))
    rows = [{"class": cls, "config": configs[str(i)], "samples_s": got["samples"][str(i)],
             **stats.get(str(i), {}), "error": got["errors"].get(str(i))}
            for i, (cls, _) in enumerate(finalists)]
    return {"rounds": got["rounds"], "steps": FINAL_STEPS, "finalists": rows,
            "chosen": chosen}


def _measured_runs(result: dict[str, Any]) -> list[tuple[float, dict, str]]:
    """(measured step s, config, class) of every real run of calibration and verify."""
    runs = [(r["measured_step_s"], r["config"], r["class"])
            for r in result.get("calibration_runs", [])]
    for v in result.get("verify", []):
        row = result["results"][v["rank"] - 1]
        runs.append((v["measured_step_s"], row["config"],
                     f"{row['placement']}@{row['group_size']}"))
    return runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--swap", required=True, type=toml_text(directory("swap directory on the "
                                                                     "NVMe")),
                   help="directory for swap files (probed, and written into the config)")
    p.add_argument("--host-budget", type=byte_size(4096, example="16GiB"), default=None,
                   help="host memory offload may use per rank: store, host optimizer state "
                   "and I/O buffers (default 16GiB, or half the memory of a smaller machine)")
    p.add_argument("--device-budget", type=byte_size(4096, example="4GiB"), default=None,
                   help="the device tier per rank (default 4GiB, or an eighth of a smaller "
                   "machine's memory on a CPU device)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="compute device (default: cuda where visible, else cpu)")
    p.add_argument("--minutes", type=number(0, above=True, example=3), default=3.0,
                   help="time tune may take, minutes: real steps start no new measurement "
                   "past their share of it (default 3)")
    p.add_argument("--probe-size", type=byte_size(8 * MiB, example="256MiB"),
                   default=256 * MiB, help="bytes of each disk probe (default 256MiB)")
    p.add_argument("--group-sizes", default=None,
                   type=value_list(integer(1, example=4194304)),
                   help="comma list of engine.group_size values to search (default: 3 "
                   "from the model's size)")
    p.add_argument("--write", type=toml_file, default=None,
                   help="write the best configuration as TOML here, e.g. offload.toml (a "
                   "file tune did not write is refused unless --force)")
    p.add_argument("--force", action="store_true",
                   help="let --write replace an existing file that offload tune did not write")
    p.add_argument("--verify", type=integer(0, example=2), default=0,
                   help="run the best K configurations for real and compare (default 0)")
    p.add_argument("--calibrate", type=integer(0, example=12), default=12,
                   help="classes (placement and group size) whose best candidate runs a few "
                   "real steps to calibrate the simulator (default 12; 0: the simulator "
                   "alone)")
    p.add_argument("--finalists", type=integer(0, example=5), default=5,
                   help="the fastest measured configurations (at most 2 of a class) measured "
                   "again in interleaved rounds to choose the one written (default 5; 0: the "
                   "fastest single measurement)")
    p.add_argument("--state-dtype", default=("fp32",),
                   type=choice_list(STATE_DTYPES),
                   help="comma list of optim.state_dtype forms of Adam's moments to search "
                   "(default fp32; bf16 and int8 change the numbers, so they are searched "
                   "only when named, and offered when they would win)")
    add_training_arguments(p)
    p.add_argument("--top", type=integer(1, example=10), default=10,
                   help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def toml_text(parse: Callable[[str], str]) -> Callable[[str], str]:
    """`parse`, for a value the written TOML holds (--swap in io.paths, --write in its
    comments): refused at once where TOML cannot hold it (bytes that are not UTF-8, or
    control characters), not after the whole run."""
    def check(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(
                f"{text!r} holds bytes that are not UTF-8, which the TOML file --write "
                "writes cannot hold; give a name in UTF-8") from None
        if any(map(_toml_control, text)):
            raise argparse.ArgumentTypeError(f"{text!r} holds control characters; give a "
                                             "name without them")
        return parse(text)
    check.__name__ = getattr(parse, "__name__", "value")
    return check


def toml_file(text: str) -> str:
    """--write: a writable file whose name ends in .toml (`offload.initialize` reads a
    config file by its suffix)."""
    path = toml_text(output_file(example="offload.toml"))(text)
    if Path(path).suffix.lower() != ".toml":  # as load_config reads it: '.toml' has none
        raise argparse.ArgumentTypeError(f"{text!r} is not a .toml file name (initialize "
                                         "reads a config by its suffix); give e.g. offload.toml")
    return path


def _written_by_tune(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(f"# {HEADER}")
    except OSError:
        return False


def check_write(path: str | None, force: bool) -> None:
    """Refuses to replace an existing file that tune did not write (the user's own
    config), unless `force`: before any work, and again before the rename."""
    if path and os.path.lexists(path) and not force and not _written_by_tune(path):
        raise UsageError(f"--write: {path!r} exists and was not written by offload tune; "
                         "give another file name, or --force to replace it")


def write_config(path: str, text: str) -> str:
    """Writes the TOML `text` to `path` as a whole or not at all: into a temporary file
    beside it, fsynced and checked by `load_config`, then renamed over it (over a
    symlink's target), so a full disk or Ctrl-C leaves the old file or none, never a
    part of one. Makes the missing directories (removed again when it fails).
    Returns the path written."""
    load_config(toml_loads(text, path))  # what initialize will read: refused before a byte
    target = os.path.realpath(path)
    parent = os.path.dirname(target)
    created = missing_directories(parent)
    try:
        os.makedirs(parent, exist_ok=True)
        replace_atomically(Path(target), lambda f: f.write(text.encode("utf-8")),
                           mode=_mode(target))
    except BaseException:
        remove_directories(created)
        raise
    return target


def _mode(path: str) -> int:
    """The mode the written file gets: the old file's, else what open() would give."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def run(args: argparse.Namespace) -> int:
    """`offload tune`; the swap directory it makes is removed again (while empty) unless
    it succeeds and writes a config (`--write`), which names it."""
    check_write(args.write, args.force)
    created = missing_directories(args.swap)
    rc = 1
    try:
        rc = _run(args)
    except MachineError as e:
        print(f"offload tune: {' '.join(str(e).split())}", file=sys.stderr)
    finally:
        if rc != 0 or not args.write:
            remove_directories(created)
    return rc


def _run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    result = tune(args, quiet=args.json, t0=t0)
    spec = model_spec(args)
    budget = 60 * args.minutes
    if args.verify:
        result["verify"] = verify(result, spec, args.verify, args.json,
                                  deadline=t0 + VERIFY_END * budget)
        result["verify_left"] = min(args.verify, len(result["results"])) - len(
            result["verify"])
    if args.finalists:
        result["final"] = final_rounds(result, spec, args.finalists, args.json,
                                       deadline=t0 + FINAL_END * budget)
    result["chosen"], result["best"] = choose(result)
    result["seconds"] = time.perf_counter() - t0
    if args.write:
        row = result["results"][result["chosen"] - 1] if result["chosen"] else None
        header = (f"{HEADER} for {spec.describe()}"
                  + (f": #{result['chosen']} of the ranking, predicted step "
                     f"{row['predicted_step_s']:.3f} s" if row else "")
                  + "\nload with offload.initialize(model, \"" + os.path.basename(args.write)
                  + "\")")
        check_write(args.write, args.force)  # a file that appeared while tune ran
        try:
            write_config(args.write, to_toml(result["best"], header))
        except OSError as e:
            fix = "free space there or give" if e.errno in (errno.ENOSPC, errno.EDQUOT) \
                else "give"
            print(f"offload tune: --write: cannot write {os.path.abspath(args.write)} "
                  f"({e.strerror or e}): {fix} another --write (nothing was written; an "
                  "old file is unchanged)", file=sys.stderr)
            return 1
        load_config(args.write)
        result["written"] = os.path.abspath(args.write)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render(result, args.top)
    return 0
