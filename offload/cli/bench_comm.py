"""`offload bench comm`: how much of a training step's communication is exposed, data
parallel and tensor parallel (Domino slicing).

`--nproc` ranks (processes; gloo on CPU, NCCL where every rank has a GPU: one code
path) train the GPT-style decoder of `offload demo` on their shares of one
global batch, parameters and optimizer state in host memory, in these modes:

  serial   no collective runs behind compute: `engine.prefetch_depth = 0` (each
           all-gather is issued when its unit starts, and waited for) and
           `engine.reductions_in_flight = 0` (each gradient reduction is waited
           for when it is issued);
  overlap  the defaults: after the first step the next unit's all-gather is
           issued while the current one computes, and gradient reductions stay in
           flight behind the backward of the next groups;
  tp       tensor parallelism over pairs of ranks (`tp.size = 2`, DP = nproc / 2:
           each pair computes its DP share of the batch, every block's Linear
           layers cut in two), `domino.pieces = 1`: each block's two all-reduces
           are waited for where they are issued;
  domino   the same, `domino.pieces = 2`: each block runs its batch in two
           pieces, the all-reduce of one behind the compute of the next
           (docs/domino.md). The tp and domino rows need an even nproc.

The modes run one after the other in the same processes, `--repeats` times
each, interleaved (serial, overlap, serial, ...), each time `--steps` measured
steps after one warm-up step. Per mode, rank 0's medians over the measured
steps of:
  step_s           wall seconds of forward, backward and the optimizer step;
  comm_s           the collectives' seconds: each from its issue until a wait
                   saw it done (the `comm` track of the event trace); collectives
                   of one rank can overlap each other, so this can exceed step_s;
  exposed_comm_s   the seconds compute waited for collectives (the
                   `wait:<collective>` spans on the training thread): communication
                   not hidden.
`engine.check_rank_order` (one small all-reduce per unit, a safety check) is
off in every mode so that the figures are the ZeRO and TP collectives'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from ..io.process import usable_cpus
from .args import CommandParser, directory, integer, ranks, run_command, table_console
from .benchutil import emit, scratch_dir

TP = 2  # ranks per tensor-parallel group in the tp and domino modes
MODES: dict[str, dict[str, Any]] = {
    "serial": {"engine": {"prefetch_depth": 0, "reductions_in_flight": 0}},
    "overlap": {},
    "tp": {"tp": {"size": TP}, "domino": {"pieces": 1}},
    "domino": {"tp": {"size": TP}, "domino": {"pieces": 2}},
}


def modes(nproc: int) -> list[str]:
    """The modes `nproc` ranks can run: tensor parallelism needs pairs of ranks."""
    return [m for m in MODES if nproc % MODES[m].get("tp", {}).get("size", 1) == 0]


def _config(swap: str, mode: str) -> dict[str, Any]:
    extra = MODES[mode]
    return {"engine": {"params": "host", "grads": "host", "optimizer": "host",
                       "check_rank_order": False, "group_size": 1 << 20,
                       **extra.get("engine", {})},
            "io": {"paths": [swap]},
            "store": {"host_budget": "4GiB", "device_budget": "4GiB"},
            **{k: v for k, v in extra.items() if k != "engine"}}


def _spans(rec: Any) -> tuple[float, float]:
    """(comm seconds, exposed seconds) of the recorder's events so far."""
    from ..trace.analysis import is_collective_wait, parse_trace
    from ..trace.chrome import to_chrome_trace
    (rt,) = parse_trace(to_chrome_trace(rec))
    comm = sum(s.dur for s in rt.spans if s.cat == "comm") / 1e6
    exposed = sum(s.dur for s in rt.spans if is_collective_wait(s)) / 1e6
    return comm, exposed


def _worker(rank: int, world: int, init: str, out: str, opts: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from .gpt import PRESETS, ReversalTask
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}",
                            rank=rank, world_size=world)
    try:
        torch.set_num_threads(max(1, usable_cpus() // world))
        cfg = PRESETS[opts["size"]]
        task = ReversalTask(cfg.vocab - 1, cfg.max_seq // 2, opts["batch"] * world, seed=1)
        rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes(world)}
        for _ in range(opts["repeats"]):
            for mode in rows:
                rows[mode] += _run_mode(rank, world, opts, cfg, task, mode)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _run_mode(rank: int, world: int, opts: dict[str, Any], cfg: Any, task: Any,
              mode: str) -> list[tuple[float, float, float]]:
    """One engine in `mode`: (step s, comm s, exposed s) of each measured step."""
    import torch
    import torch.distributed as dist

    import offload
    from ..trace import TraceRecorder
    from .gpt import GPT
    torch.manual_seed(0)
    rec = TraceRecorder(enabled=True, rank=rank)
    swap = os.path.join(opts["swap"], f"{mode}-{rank}")
    got = []
    tp = MODES[mode].get("tp", {}).get("size", 1)
    dp, me = world // tp, rank // tp  # the ranks of a TP group compute the same rows
    with offload.initialize(GPT(cfg), _config(swap, mode), recorder=rec) as engine:
        for i in range(opts["steps"] + 1):
            x, y = task.next_batch()
            x, y = x.chunk(dp)[me], y.chunk(dp)[me]
            dist.barrier()
            rec.clear()
            t = time.perf_counter()
            engine.backward(task.loss(engine(x.to(engine.device)), y))
            engine.step()
            step = time.perf_counter() - t
            if i:  # the first step records the access trace: nothing is ahead yet
                got.append((step, *_spans(rec)))
    return got


def run_comm_bench(nproc: int, steps: int, repeats: int, size: str, batch: int,
                   swap: str) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(dir=swap) as tmp:
        out = os.path.join(tmp, "rank0.pt")
        opts = {"steps": steps, "repeats": repeats, "size": size, "batch": batch, "swap": tmp}
        mp.start_processes(_worker, args=(nproc, os.path.join(tmp, "init"), out, opts),
                           nprocs=nproc, join=True, start_method="spawn")
        rows = torch.load(out)
    result: dict[str, Any] = {"nproc": nproc, "size": size, "batch_per_rank": batch,
                              "steps": steps, "repeats": repeats,
                              "backend": "nccl" if torch.cuda.device_count() >= nproc
                              else "gloo", "cpus": usable_cpus(), "rows": []}
    for mode, samples in rows.items():
        step, comm, exposed = (statistics.median(s[k] for s in samples) for k in range(3))
        result["rows"].append({"mode": mode, "step_s": step, "comm_s": comm,
                               "exposed_comm_s": exposed,
                               "exposed_share": exposed / comm if comm else 0.0,
                               "samples": len(samples)})
    by = {r["mode"]: r for r in result["rows"]}
    result["overlap_vs_serial"] = by["overlap"]["step_s"] / by["serial"]["step_s"]
    if "domino" in by:
        result["domino_vs_tp"] = by["domino"]["step_s"] / by["tp"]["step_s"]
    return result


def _render(r: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title=f"offload bench comm: {r['nproc']} ranks ({r['backend']}), GPT "
              f"{r['size']}, batch {r['batch_per_rank']} per rank, {r['cpus']} CPUs")
    for c in ("mode", "step s", "comm s", "exposed comm s", "exposed / comm"):
        t.add_column(c)
    for row in r["rows"]:
        t.add_row(row["mode"], f"{row['step_s']:.3f}", f"{row['comm_s']:.3f}",
                  f"{row['exposed_comm_s']:.3f}", f"{row['exposed_share']:.0%}")
    con = table_console()
    con.print(t)
    con.print(f"overlap step / serial step: {r['overlap_vs_serial']:.2f} (medians of "
              f"{r['steps']} steps x {r['repeats']} runs per mode, interleaved)")
    if "domino_vs_tp" in r:
        con.print(f"domino step / tp step: {r['domino_vs_tp']:.2f}")
    else:
        con.print("no tp or domino row: tensor parallelism needs an even --nproc")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=ranks(), default=2,
                   help="ranks (processes), default 2")
    p.add_argument("--steps", type=integer(1, example=4), default=4,
                   help="measured steps per run (default 4)")
    p.add_argument("--repeats", type=integer(1, example=3), default=3,
                   help="runs per mode, interleaved (default 3)")
    p.add_argument("--size", choices=("tiny", "small", "base", "large"), default="small",
                   help="the GPT preset of offload demo (default small)")
    p.add_argument("--batch", type=integer(1, example=8), default=8,
                   help="rows per rank per step in the data-parallel modes (default 8); the "
                   "global batch, this times --nproc, is the same in every mode")
    p.add_argument("--path", default=None, type=directory("directory for scratch files"),
                   help="directory for the runs' scratch files (default: a temporary "
                   "directory under the current one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    with scratch_dir(args.path) as path:
        result = run_comm_bench(args.nproc, args.steps, args.repeats, args.size, args.batch,
                                path)
    return emit(result, args.json, _render)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench comm", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
