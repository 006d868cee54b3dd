"""What `offload demo` adds to its trace for the report, and how it writes both.

* `record_run_facts`: before the engine is built, a short probe of the swap disk
  through offload's own I/O engine (the rate the report compares the step's
  NVMe traffic with) and, where the model fits easily in memory, the time of
  the same step in plain PyTorch with nothing offloaded (the report's
  no-offload step). Both go into the recorder's info (docs/trace.md).
* `start_traced_step` / `write_traced_step`: recording starts and ends with each
  tier's occupancy (the store records it only when it changes); then every rank
  writes its trace (rank 0 to `--trace`, rank r beside it as
  NAME.rank<r>.trace.json) and, once all have, rank 0 writes the HTML report of
  all of them beside its trace.
* `check_outputs`: before any work, that those files replace nothing but an
  earlier trace or report (a name given to `--trace` may be the user's file).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import regular_file_head

if TYPE_CHECKING:
    import torch

    from ..trace import TraceRecorder
    from .demo import DemoPlan

log = logging.getLogger(__name__)

__all__ = ["check_outputs", "probe_disk", "record_run_facts", "reference_step_seconds", "start_traced_step",
           "trace_path_for_rank", "write_traced_step"]

PROBE_BYTES = 32 << 20       # written then read by the disk probe
PROBE_REQUEST = 4 << 20      # bytes per request, four in flight
REFERENCE_MAX_STATE = 1 << 30  # the no-offload step is measured only up to this state size


def probe_disk(directory: Path, io: dict[str, Any], nbytes: int = PROBE_BYTES) -> dict[str, Any]:
    """Writes then reads `nbytes` in `directory` with offload's I/O engine (the run's
    settings, four requests in flight); returns `read_Bps`, `write_Bps` and how."""
    from .benchutil import swap_rates

    r = swap_rates(io, nbytes, PROBE_REQUEST, max(nbytes, 1 << 20), "disk-probe")
    return {"write_Bps": r.write_Bps, "read_Bps": r.read_Bps, "bytes": r.nbytes,
            "engine": r.engine, "direct": r.direct,
            "how": f"{r.nbytes >> 20} MiB written then read in {PROBE_REQUEST >> 20} MiB "
                   "requests, 4 in flight, before the engine was built"}


def reference_step_seconds(plan: DemoPlan, device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` steps of the demo's model and batch in plain PyTorch
    (AdamW, everything in memory on `device`), after one untimed step. The fastest,
    not the median: on a shared machine a step is only ever slowed down by others."""
    import torch

    from .gpt import GPT, ReversalTask

    torch.manual_seed(plan.seed)
    model = GPT(plan.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.0)
    task = ReversalTask(plan.model.vocab - 1, plan.length, plan.batch, seed=plan.seed)
    times = []
    for i in range(repeats + 1):
        x, y = task.next_batch()
        t = time.perf_counter()
        loss = ReversalTask.loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t)
    return min(times)


def record_run_facts(recorder: TraceRecorder, plan: DemoPlan, swap_dir: Path,
                     rank: int) -> None:
    """The no-offload step (rank 0, small models) and the disk's rate, into the recorder's
    info; a measure that fails is logged and left out, never fatal.

    Call it before the engine is built: the engine's threads and its short GIL switch
    interval (`io.switch_interval`) make a plain PyTorch step in the same process
    erratic. The step is timed before the disk probe for the same reason: right after
    a burst of direct writes, a virtual disk's host may take the CPU for a while.
    """
    from ..store.copy import resolve_device

    if rank == 0 and plan.state_bytes <= REFERENCE_MAX_STATE:
        try:
            seconds = reference_step_seconds(plan, resolve_device("auto"))
            recorder.set_info(reference_step_s=seconds, reference=(
                "the same model and batch in plain PyTorch (AdamW), everything in memory, "
                "one process: the fastest of 5 steps after one untimed"))
        except Exception as e:
            log.warning("no-offload step for the report failed: %s", e)
    try:
        recorder.set_info(disk=probe_disk(swap_dir, plan.config(swap_dir)["io"]))
    except Exception as e:  # the report then shows the achieved rate alone
        log.warning("disk probe for the report failed: %s", e)


def _sample_tiers(recorder: TraceRecorder, store: Any) -> None:
    """Each tier's bytes by kind now, as the store's own `tier:<TIER>` counters."""
    for name, tier in store.stats().tiers.items():
        recorder.counter(f"tier:{name}", dict(tier.by_kind) or {"bytes": 0},
                         track=f"tier:{name}")


def start_traced_step(recorder: TraceRecorder, store: Any) -> None:
    """Starts recording, beginning with each tier's occupancy."""
    recorder.enabled = True
    _sample_tiers(recorder, store)


def _is_trace(path: Path) -> bool:
    """Whether `path` is a regular file holding a Chrome trace as offload writes them."""
    head = regular_file_head(path, 64, gunzip=True)
    return head is not None and head.startswith(b'{"traceEvents":')


def check_outputs(trace: Path, world: int) -> None:
    """Raises UsageError, naming the file, where writing the demo's traces (one per
    rank) or its report would replace something other than an earlier trace or
    report: the run is minutes long, and the file may be the user's."""
    from ..trace.report import default_report_path, is_report
    from .args import UsageError
    for path, ok, what in [(trace_path_for_rank(trace, r), _is_trace, "trace")
                           for r in range(world)] + [
            (default_report_path(trace), is_report, "report")]:
        if os.path.lexists(path) and not ok(path):
            raise UsageError(f"--trace: the demo would replace {path} with its {what}, and "
                             f"that file is not a {what} offload wrote; move it, or give "
                             "--trace another name (or --trace none)")


def trace_path_for_rank(trace: Path, rank: int) -> Path:
    """`run.trace.json` for rank 0, `run.rank<r>.trace.json` for rank r beside it."""
    if rank == 0:
        return trace
    name = trace.name
    for suffix in (".trace.json.gz", ".trace.json", ".json.gz", ".json"):
        if name.endswith(suffix):
            return trace.with_name(f"{name[:-len(suffix)]}.rank{rank}{suffix}")
    return trace.with_name(f"{name}.rank{rank}")


def write_traced_step(plan: DemoPlan, recorder: TraceRecorder, step: int, rank: int,
                      store: Any) -> dict[str, str]:
    """Ends recording with each tier's occupancy and writes this rank's trace; on rank 0,
    once every rank has, the report of them all. Returns `trace` (and on rank 0
    `report`) paths for the summary."""
    import torch.distributed as dist

    from ..trace import write_chrome_trace
    from ..trace.report import default_report_path, write_report

    if plan.trace is None:
        raise ValueError("write_traced_step: the plan has no trace path (--trace none)")
    _sample_tiers(recorder, store)
    recorder.enabled = False
    path = trace_path_for_rank(plan.trace, rank)
    write_chrome_trace(path, recorder, metadata={"step": step, "model": plan.size})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's file is complete before rank 0 reads them
    out = {"trace": str(path)}
    if rank == 0:
        paths = [trace_path_for_rank(plan.trace, r) for r in range(plan.world)]
        out["report"] = str(write_report(paths, default_report_path(plan.trace),
                                         title=f"offload demo ({plan.size}), step {step}"))
    return out
