"""`offload bench plan`: the planner's bytes and the simulator's step against real steps.

For each configuration (a model, a placement that streams something from NVMe,
a memory budget, a compute dtype) a process of its own probes the disk and runs
real steps with the event trace on ([Note: what a run measures] in
bench_plan_run.py). From that run alone, the benchmark builds the step's access
trace as the tuner models it (`offload.planner.search.modelled_step`: the units'
uses in the order the run made them, each with the compute seconds the trace
measured; each group's update, on the update thread where updates run early;
the optimizer's chunks streamed from NVMe; the commit) and computes:

  * bytes_planned: the plan's reads and writes (`make_plan`, farthest-next-use
    eviction under the memory the budgets leave the streamed partitions, as the
    two tiers hold them record by record (`packed_budget`), fetches
    no earlier than the engine's look-ahead) plus the optimizer's state, read
    and written once per step whatever the budget;
  * bytes_lru: the same trace under least-recently-used eviction with on-demand
    fetches (`lru_bytes`), plus the same optimizer traffic;
  * predicted_step_s: the simulator's step (`simulate`) of that plan at the
    disk rates probed in the run (read, write, mixed); and beside it, at the
    rates the disk reached in the step ([Note: the disk's rates in the step]);
and compares them with what the run measured: bytes_moved (the store's moves
to and from NVMe plus the optimizer's, per step; /proc/self/io beside it) and
measured_step_s (the median of the timed steps).

Configurations: two models (the MLP of `offload bench tune`, 8 x
Linear(1024, 1024); `gpt`, the decoder of offload/cli/gpt.py at its "small"
size, 6 blocks of 384), three placements (`params`: nvme/host/host;
`optimizer`: host/host/nvme; `both`: nvme/host/nvme), memory at 50% and 25%
of the bytes the placement keeps on NVMe ([Note: the budgets of a row]),
fp32 and bf16: 24 rows. Targets: bytes_moved <= 1.05 x bytes_planned and
<= bytes_lru, and
predicted_step_s within 10% of measured_step_s, for each row.

[Note: the budgets of a row]
Each kind of state the placement streams gets the fraction of its NVMe bytes in
memory: parameters on NVMe get it as the store's memory for them
(`store.device_budget`, the tier they are gathered into, at least its minimum
working set; `store.host_budget` holds the host's minimum working set and the
gradients stored there), the optimizer's state on NVMe gets it as
`io.buffer_budget` (its chunk buffers; at least 4 MiB). What the placement
keeps in memory otherwise has room. The planner's budget is what the store's two
memory tiers (the device tier and the host tier) hold of the plan's records
together, each record whole in one tier (`packed_budget`); gradients stored in
the host tier take their bytes of it from their backward to their update
(`Use.reserved`), and the plan's records get the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .args import byte_size, choice_list, directory, integer, table_console
from .benchutil import emit, progress_printer, scratch_dir

__all__ = ["add_arguments", "gpt", "jobs", "predict", "run", "run_plan_bench"]

MiB = 1 << 20
TARGET_BYTES = 1.05
TARGET_STEP = 0.10
GROUP_SIZE = 1 << 20
MODELS = {"mlp": ("offload.cli.bench_tune:mlp", 16, None),
          "gpt": ("offload.cli.bench_plan:gpt", 8, 32)}
PLACEMENTS = {"params": ("nvme", "host", "host"), "optimizer": ("host", "host", "nvme"),
              "both": ("nvme", "host", "nvme")}
DTYPES = ("fp32", "bf16")


def gpt():
    """The decoder of offload/cli/gpt.py at its "small" size (6 blocks of 384)."""
    from .gpt import GPT, PRESETS

    return GPT(PRESETS["small"])


def _placement(name: str):
    from ..planner.estimate import Placement

    return Placement(*PLACEMENTS[name])


def _row_config(model: str, placement: str, fraction: float, dtype: str, swap: str,
                args) -> dict[str, Any]:
    """The configuration of one row ([Note: the budgets of a row]) and its planner
    budget, from the model measured on meta."""
    from ..planner.estimate import early_updates, kind_bytes
    from .estimate import minimum, model_bytes
    from .model_arg import ModelSpec, measure_model

    target, batch, seq = MODELS[model]
    spec = ModelSpec("function", target, batch, seq, dtype)
    mm = measure_model(spec, GROUP_SIZE)
    p = _placement(placement)
    kinds = kind_bytes(model_bytes(mm))
    keys = {**p.engine_keys(), "group_size": GROUP_SIZE, "dtype": dtype,
            "prefetch_depth": args.prefetch_depth}
    mins = minimum(mm, {k: v for k, v in keys.items() if k != "dtype"}, "cpu")
    P, G = kinds["param"], kinds["grad"]
    opt = kinds["exp_avg"] + kinds["exp_avg_sq"] + kinds["master"]
    stored_grads = G if not early_updates(p, dtype) else 0
    if p.params == "nvme":
        device = max(mins["device"], int(fraction * P))
        host = mins["host"] + stored_grads
        budget = device + host  # stored gradients take theirs as they come (Use.reserved)
    else:  # parameters stay in memory, with room (and their staged new versions)
        device = host = 4 * P + G + mins["device"] + mins["host"]
        budget = device + host
    buffers = max(4 * MiB, int(fraction * opt) // 4096 * 4096) if p.optimizer == "nvme" \
        else 8 * MiB
    config = {"engine": keys,
              "io": {"paths": [swap], "buffer_budget": buffers, "block_size": args.block_size,
                     "queue_depth": args.queue_depth},
              "store": {"host_budget": host, "device_budget": device, "device": "cpu"}}
    return {"spec": spec.__dict__, "config": config, "planner_budget": budget,
            "nvme_state": (P if p.params == "nvme" else 0) + (opt if p.optimizer == "nvme"
                                                               else 0)}


def jobs(args) -> list[dict[str, Any]]:
    """Every configuration of the run: model x placement x fraction x dtype."""
    return [{"model": m, "placement": p, "fraction": f, "dtype": d,
             "name": f"{m} {p} {int(f * 100)}% {d}"}
            for m in args.models for p in args.placements for f in args.fractions
            for d in args.dtypes]


def predict(row: dict[str, Any], job: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """The planner's and the simulator's figures for a measured run (module docstring)."""
    from ..config import OptimConfig
    from ..planner import Rates, Use, simulate
    from ..planner.estimate import early_updates
    from ..planner.search import (UnitUse, chunk_elems, commit_stages, lru_step_bytes,
                                  modelled_step, plan_step)
    from ..planner.sizes import keeps_master

    cfg, prof = job["config"], m["profile"]
    p = _placement(row["placement"])
    buffers = OptimConfig().buffers
    master = keeps_master(row["dtype"], p.params, "cpu")  # the rows run on the CPU
    chunk = chunk_elems(cfg["io"]["buffer_budget"], buffers, master=master) \
        if p.optimizer == "nvme" else 0
    units = [UnitUse(u["kind"], tuple(u["gids"]), u["compute_s"], f"{u['kind']}:{u['unit']}")
             for u in prof["uses"]]
    early = early_updates(p, row["dtype"])
    shards = [tuple(s) for s in m["shards"]]
    step = modelled_step(units, shards, row["dtype"], p, chunk,
                         prof["adam_eps"] or 1e9, update_lane="update" if early else "compute",
                         between=[Use((), (), "loss", "loss", prof["between_s"])],
                         commit_s=prof["commit_s"], grads_reserved=True,
                         staged=commit_stages(p, row["dtype"], shards, job["planner_budget"]),
                         master=master)
    tiers = (cfg["store"]["device_budget"], cfg["store"]["host_budget"])
    plan = plan_step(step, tiers, cfg["engine"]["prefetch_depth"], buffers)
    lru_r, lru_w = lru_step_bytes(step, tiers)
    d = m["disk"]
    probed = Rates(d["read_Bps"], d["write_Bps"], d["mixed_Bps"])
    reached = run_rates(prof["disk"], probed)
    pred = simulate(plan, step.uses, probed)
    return {"bytes_planned": plan.bytes_moved, "bytes_lru": lru_r + lru_w,
            "planned_read": plan.bytes_read, "planned_write": plan.bytes_written,
            "predicted_step_s": pred.step_s, "predicted_exposed_s": pred.exposed_io_s,
            "predicted_run_rates_step_s": simulate(plan, step.uses, reached).step_s,
            "run_rates": {"read_Bps": reached.read_Bps, "write_Bps": reached.write_Bps,
                          "mixed_Bps": reached.mixed_Bps},
            "chunk_elems": chunk, "uses": len(step.uses),
            "prediction": pred}


def run_rates(disk: dict[str, float], probed):
    """[Note: the disk's rates in the step] The rates the disk reached in the run's step:
    bytes read over the seconds a read was in flight, the same for writes, and all
    bytes over the seconds any request was (mixed); the probe's where the step moved
    none of that kind. A second prediction uses them (`predicted_run_rates_step_s`):
    where the probe's rates (a full queue of large requests, on an idle CPU) are far
    from what the step's requests get, it shows how much of the difference is the
    disk's rate rather than the model's order of operations."""
    from ..planner import Rates

    def rate(nbytes: float, secs: float, fallback: float) -> float:
        return nbytes / secs if nbytes and secs > 0 else fallback
    total = disk["read_bytes"] + disk["write_bytes"]
    return Rates(rate(disk["read_bytes"], disk["read_busy_s"], probed.read_Bps),
                 rate(disk["write_bytes"], disk["write_busy_s"], probed.write_Bps),
                 rate(total, disk["busy_s"], probed.mixed_Bps))


def _run_one(job: dict, work: str, args) -> dict[str, Any]:
    path = os.path.join(work, "job.json")
    out = os.path.join(work, "out.json")
    trace = os.path.join(args.traces, _trace_name(job["name"]) + ".trace.json") \
        if args.traces else None
    Path(path).write_text(json.dumps({**job, "warmup": args.warmup, "steps": args.steps,
                                      "probe_size": args.probe_size, "out": out,
                                      "trace": trace}))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (root, os.environ.get("PYTHONPATH")) if x)}
    subprocess.run([sys.executable, "-m", "offload.cli.bench_plan_run", path], env=env,
                   timeout=900, check=False)
    if not os.path.exists(out):
        return {"error": "the run wrote no result"}
    got = json.loads(Path(out).read_text())
    os.unlink(out)
    return got


def _row(job: dict, spec: dict, m: dict, args) -> dict[str, Any]:
    row = {"config": job["name"], **{k: job[k] for k in ("model", "placement", "fraction",
                                                          "dtype")}}
    row.update(store_host_budget=spec["config"]["store"]["host_budget"],
               store_device_budget=spec["config"]["store"]["device_budget"],
               buffer_budget=spec["config"]["io"]["buffer_budget"],
               planner_budget=spec["planner_budget"], nvme_state=spec["nvme_state"])
    if "error" in m:
        return {**row, "error": m["error"]}
    got = predict(row, spec, m)
    pred = got.pop("prediction")
    moved = m["read_bytes"] + m["write_bytes"]
    row.update(got, bytes_moved=moved, measured_read=m["read_bytes"],
               measured_write=m["write_bytes"],
               proc_bytes=m["proc_read_bytes"] + m["proc_write_bytes"],
               measured_step_s=m["step_s"], steps_s=m["steps_s"],
               measured_exposed_s=m["profile"]["exposed_s"], disk=m["disk"],
               adam_eps=m["profile"]["adam_eps"], commit_s=m["profile"]["commit_s"],
               store_moves=m["store_moves"])
    row["moved_over_planned"] = moved / got["bytes_planned"] if got["bytes_planned"] else None
    row["predicted_over_measured"] = got["predicted_step_s"] / m["step_s"]
    row["run_rates_predicted_over_measured"] = got["predicted_run_rates_step_s"] / m["step_s"]
    if args.traces:
        from ..trace import write_trace_dict

        write_trace_dict(os.path.join(args.traces, _trace_name(job["name"])
                                      + ".predicted.trace.json"),
            pred.to_trace(budget=spec["planner_budget"], metadata={"config": job["name"]}))
    return row


def _trace_name(config: str) -> str:
    return config.replace(" ", "-").replace("%", "pc")


def _over(moved: int, reference: int) -> float:
    """moved / reference; where the reference is no bytes, 1 for none moved and
    infinite for any (a row that moved bytes where none were planned misses)."""
    return moved / reference if reference else (1.0 if moved == 0 else math.inf)


def _worst(ratios: list[float]) -> float | None:
    """The largest ratio; None (JSON null) where it is infinite."""
    return None if math.isinf(max(ratios)) else max(ratios)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The three targets over the rows that ran: value is the worst row's."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return []
    ratio = [_over(r["bytes_moved"], r["bytes_planned"]) for r in ok]
    lru = [_over(r["bytes_moved"], r["bytes_lru"]) for r in ok]
    err = [abs(r["predicted_over_measured"] - 1) for r in ok]
    full = len(ok) == len(rows)
    return [{"target": "bytes moved / planned", "value": _worst(ratio), "limit": TARGET_BYTES,
             "met": full and max(ratio) <= TARGET_BYTES,
             "rows_met": sum(x <= TARGET_BYTES for x in ratio)},
            {"target": "bytes moved / LRU's", "value": _worst(lru), "limit": 1.0,
             "met": full and max(lru) <= 1.0, "rows_met": sum(x <= 1.0 for x in lru)},
            {"target": "|predicted / measured - 1|", "value": max(err), "limit": TARGET_STEP,
             "met": full and max(err) <= TARGET_STEP,
             "rows_met": sum(x <= TARGET_STEP for x in err)}]


def run_plan_bench(args, path: str, progress=None) -> dict[str, Any]:
    import torch

    os.makedirs(path, exist_ok=True)
    if args.traces:
        os.makedirs(args.traces, exist_ok=True)
    rows = []
    for job in jobs(args):
        work = tempfile.mkdtemp(prefix=".offload-bench-plan-", dir=path)
        swap = os.path.join(work, "swap")
        os.makedirs(swap)
        spec = _row_config(job["model"], job["placement"], job["fraction"], job["dtype"],
                           swap, args)
        m = _run_one({**job, **spec}, work, args)
        row = _row(job, spec, m, args)
        rows.append(row)
        if progress:
            progress(f"{job['name']}: " + (row["error"] if "error" in row else
                     f"moved {row['bytes_moved'] / 1e6:.1f} MB, planned "
                     f"{row['bytes_planned'] / 1e6:.1f}, LRU {row['bytes_lru'] / 1e6:.1f}; "
                     f"step {row['measured_step_s']:.3f} s, predicted "
                     f"{row['predicted_step_s']:.3f} s"))
        shutil.rmtree(work, ignore_errors=True)
    disks = [r["disk"]["read_Bps"] for r in rows if "disk" in r]
    return {"benchmark": "plan", "warmup": args.warmup, "steps": args.steps,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "disk_read_Bps_median": statistics.median(disks) if disks else None,
            "results": rows, "targets": targets(rows)}


def render(result: dict[str, Any]) -> None:
    from rich.table import Table

    con = table_console()
    t = Table(title=f"offload bench plan: bytes per step (MB) and step seconds, planned and "
                    f"predicted against measured (median of {result['steps']} steps)")
    cols = ("config", "planned", "moved", "LRU", "moved/plan", "predicted s", "measured s",
            "pred/meas")
    for c in cols:
        t.add_column(c, justify="left" if c == "config" else "right")
    for r in result["results"]:
        if "error" in r:
            t.add_row(r["config"], r["error"][:70], *[""] * 6)
            continue
        ratio = r["moved_over_planned"]
        t.add_row(r["config"], f"{r['bytes_planned'] / 1e6:.1f}", f"{r['bytes_moved'] / 1e6:.1f}",
                  f"{r['bytes_lru'] / 1e6:.1f}", f"{ratio:.3f}" if ratio else "-",
                  f"{r['predicted_step_s']:.3f}", f"{r['measured_step_s']:.3f}",
                  f"{r['predicted_over_measured']:.2f}")
    con.print(t)
    for tg in result["targets"]:
        worst = "bytes where none" if tg["value"] is None else f"{tg['value']:.3f}"
        con.print(f"target: {tg['target']}: worst {worst} vs {tg['limit']:.2f}, "
                  f"{tg['rows_met']}/{len(result['results'])} rows -> "
                  + ("[green]met[/green]" if tg["met"] else "[red]missed[/red]"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default=None, type=directory("directory for the swap files"),
                   help="scratch directory on the disk to measure (default: a temporary one "
                   "under the current)")
    p.add_argument("--models", type=choice_list(tuple(MODELS)), default=tuple(MODELS),
                   help="comma list of mlp, gpt (default both)")
    p.add_argument("--placements", type=choice_list(tuple(PLACEMENTS)),
                   default=tuple(PLACEMENTS),
                   help="comma list of params (nvme/host/host), optimizer (host/host/nvme), "
                   "both (nvme/host/nvme) (default all)")
    p.add_argument("--fractions", type=choice_list(("50", "25")), default=("50", "25"),
                   help="memory for the streamed state, percent of its NVMe bytes: comma "
                   "list of 50, 25 (default both)")
    p.add_argument("--dtypes", type=choice_list(DTYPES), default=DTYPES,
                   help="comma list of fp32, bf16 (default both)")
    p.add_argument("--warmup", type=integer(1, example=2), default=2,
                   help="untimed steps per configuration (default 2)")
    p.add_argument("--steps", type=integer(1, example=5), default=5,
                   help="timed steps per configuration (default 5)")
    p.add_argument("--prefetch-depth", type=integer(0, example=2), default=2,
                   help="engine.prefetch_depth (default 2)")
    p.add_argument("--block-size", type=byte_size(4096, example="1MiB"), default=MiB,
                   help="io.block_size (default 1MiB)")
    p.add_argument("--queue-depth", type=integer(1, example=8), default=8,
                   help="io.queue_depth (default 8)")
    p.add_argument("--probe-size", type=byte_size(MiB, example="32MiB"), default=32 * MiB,
                   help="bytes of the disk probe before each run (default 32MiB)")
    p.add_argument("--traces", default=None, type=directory("directory for the traces"),
                   help="write each row's measured steps and its predicted step as Chrome "
                   "traces here (CONFIG.trace.json, CONFIG.predicted.trace.json; offload "
                   "view draws them side by side)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    args.fractions = tuple(int(f) / 100 for f in args.fractions)
    with scratch_dir(args.path) as path:
        result = run_plan_bench(args, path, progress_printer(args.json))
    rc = emit(result, args.json, render)
    # a configuration whose run failed measured nothing: the command failed with it
    failed = [r for r in result["results"] if "error" in r]
    for r in failed:
        print(f"offload bench plan: {r['config']}: {r['error']}", file=sys.stderr)
    return 1 if failed else rc
