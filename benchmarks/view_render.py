"""How fast the HTML report of a big step renders in Chromium, and how big it is.

Two parts (docs/benchmarks.md has the figures and the commands):

* ``count``: traces one steady-state step (step 3) of the `offload bench oversized`
  model (d_model 2048, everything on NVMe, the same budgets) at a few depths and
  prints the events per layer and the fixed rest, so that the event count of the
  3B model's step (59 layers) follows by extrapolation. Needs a few GiB of disk.
* ``render`` (default): writes a synthetic trace of one step with that many events,
  in the same mix of kinds (per-unit spans, gathers, fetches, moves, NVMe requests,
  optimizer chunks and their waits, occupancy samples), makes its report, and
  loads it in headless Chromium several times: the time from navigation to the
  report's rendered marker (median), and the sizes of the trace and the report.

    python benchmarks/view_render.py count --layers 2,3 --swap-dir /work/bench-view
    python benchmarks/view_render.py render --layers 59 --loads 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

GIB = 1 << 30

from offload.config import parse_bytes  # noqa: E402


# -- counting events of real steps ---------------------------------------------------------------
def _kind(ev: dict) -> str:
    name = ev["name"]
    for prefix in ("forward:", "backward:", "recompute:"):
        if name.startswith(prefix):
            return prefix[:-1]
    return f"{ev['ph']} {ev.get('cat', '')} {name}"


def count_step(layers: int, swap_root: Path, device_budget: int, host_budget: int,
               d_model: int = 2048) -> Counter:
    """Event kinds of step 3 of the oversized model with `layers` layers."""
    from offload.cli.bench_oversized import BenchSpec, model_for, tune_malloc
    from offload.cli.demo import remove_swap_dir, swap_dir_for_run
    from offload.cli.gpt import GPT, GPTConfig, ReversalTask
    from offload.cli.view_demo import start_traced_step
    from offload.engine import initialize
    from offload.trace import TraceRecorder, to_chrome_trace

    base = model_for(10 ** 9, d_model, 16)
    model = GPTConfig(n_layer=layers, d_model=d_model, n_head=base.n_head, vocab=base.vocab,
                      max_seq=base.max_seq)
    spec = BenchSpec(model=model, dtype="bf16", steps=3, batch=1, length=16,
                     device_budget=device_budget, host_budget=host_budget,
                     io_buffers=512 << 20,
                     swap_root=swap_root, probe_bytes=0)
    tune_malloc()
    notes: list[str] = []
    root_created = not swap_root.exists()
    swap_dir = swap_dir_for_run(swap_root, notes, prefix="offload-bench-view-")
    rec = TraceRecorder(enabled=False)
    try:
        engine = initialize(lambda: GPT(model), spec.config(swap_dir), recorder=rec)
        try:
            task = ReversalTask(model.vocab - 1, 16, 1)
            for step in (1, 2, 3):
                if step == 3:
                    start_traced_step(rec, engine.store)
                x, y = task.next_batch()
                with rec.span("step", cat="compute", track="compute", step=step):
                    loss = ReversalTask.loss(engine(x), y)
                    engine.backward(loss)
                    engine.step()
            engine.store.wait_all()
            rec.enabled = False
        finally:
            engine.close()
    finally:
        remove_swap_dir(swap_dir, root_created)
    trace = to_chrome_trace(rec)
    return Counter(_kind(e) for e in trace["traceEvents"] if e["ph"] != "M")


def cmd_count(args: argparse.Namespace) -> int:
    depths = [int(x) for x in args.layers.split(",")]
    counts = {}
    for n in depths:
        t = time.perf_counter()
        counts[n] = count_step(n, Path(args.swap_dir).absolute(),
                               parse_bytes(args.device_budget, "--device-budget"),
                               parse_bytes(args.host_budget, "--host-budget"))
        print(f"{n} layers: {sum(counts[n].values())} events ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr)
    lo, hi = depths[0], depths[-1]
    kinds = sorted(set(counts[lo]) | set(counts[hi]))
    per_layer = {k: (counts[hi][k] - counts[lo][k]) / (hi - lo) for k in kinds}
    fixed = {k: counts[lo][k] - lo * per_layer[k] for k in kinds}
    total = lambda n: sum(fixed.values()) + n * sum(per_layer.values())  # noqa: E731
    out = {"depths": {str(n): sum(c.values()) for n, c in counts.items()},
           "per_layer": per_layer, "fixed": fixed,
           "events_per_layer": sum(per_layer.values()), "events_fixed": sum(fixed.values()),
           "estimate": {str(n): round(total(n)) for n in (59,)}}
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


# -- a synthetic step of the same shape ----------------------------------------------------------
UNITS = ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj")
CHUNKS = 30          # optimizer chunks per layer (the count above: 30 updates per layer)
MiB = 1 << 20


def synthetic_step(rec, layers: int, step_s: float = 70.0) -> None:
    """Records one step of `layers` layers into `rec` with the per-layer mix that
    `count` measured on the real model (see docs/benchmarks.md): per unit, in forward
    and in backward, its span, the use wait, the fetch issued ahead, the NVMe read and
    the moves up; evictions and write-backs; per layer, CPU Adam's chunks with their
    reads, writes and waits; tier occupancy samples. Timestamps from perf_counter_ns."""
    import random

    rnd = random.Random(0)
    t0 = rec.now_ns()
    ns = lambda s: t0 + int(s * 1e9)  # noqa: E731
    fwd_s, bwd_s = step_s * 0.09, step_s * 0.9
    held = {"DEVICE": 0, "HOST": 0, "NVME": 20 * GIB}

    def transfer(name, cat, track, a, b, args):
        rec.async_end(rec.async_begin(name, cat, track, args, ts_ns=ns(a)), ts_ns=ns(b))

    def occupancy(t, tier, delta):
        held[tier] = max(0, held[tier] + delta)
        rec.counter(f"tier:{tier}", {"param": held[tier] * 0.7, "grad": held[tier] * 0.3},
                    track=f"tier:{tier}", ts_ns=ns(t))

    def use(layer, u, phase, start, length):
        gid = layer * len(UNITS) + u
        key = str(("p", gid))
        nbytes = (32 if "mlp" in UNITS[u] else 8) * MiB
        unit = f"blocks.{layer}.{UNITS[u]}"
        issue = max(0.0, start - length * 2)
        transfer("fetch", "fetch", "fetch", issue, issue + length * 0.8,
                 {"key": key, "kind": "param", "bytes": nbytes, "steps": "READ+H2D"})
        transfer("NVME->HOST", "store", "store:NVME->HOST", issue, issue + length * 0.6,
                 {"key": key, "kind": "param", "bytes": nbytes})
        transfer("read", "io", "io:aio", issue, issue + length * 0.6,
                 {"bytes": nbytes, "path": "/nvme/swap/offload-r0-param.swap"})
        transfer("HOST->DEVICE", "store", "store:HOST->DEVICE", issue + length * 0.6,
                 issue + length * 0.8, {"key": key, "kind": "param", "bytes": nbytes})
        wait = length * (0.02 if rnd.random() < 0.8 else 0.3)
        rec.complete("wait:gather", ns(start), ns(start + wait), cat="wait", track="compute",
                     args={"key": key})
        rec.complete(f"{phase}:{unit}", ns(start), ns(start + length), cat="compute",
                     track="compute", args={"unit": unit})
        for i, tier in enumerate(("HOST", "DEVICE", "HOST", "DEVICE")):
            occupancy(issue + length * 0.2 * i, tier, nbytes if i < 2 else -nbytes)
        if u % 2 or phase == "backward":
            rec.instant("evict dirty", "store", "store:policy",
                        {"key": key, "tier": "DEVICE", "bytes": nbytes}, ts_ns=ns(start + length))
            transfer("DEVICE->HOST", "store", "store:DEVICE->HOST", start + length,
                     start + length * 1.1, {"key": key, "kind": "param", "bytes": nbytes})
        else:
            rec.instant("evict clean", "store", "store:policy",
                        {"key": key, "tier": "HOST", "bytes": nbytes}, ts_ns=ns(start + length))
        if phase == "backward":
            transfer("HOST->NVME", "store", "store:HOST->NVME", start + length,
                     start + length * 1.5, {"key": key, "kind": "param", "bytes": nbytes})
            transfer("write", "io", "io:aio", start + length, start + length * 1.5,
                     {"bytes": nbytes, "path": "/nvme/swap/offload-r0-param.swap"})
            rec.complete("wait:budget", ns(start + length * 0.1), ns(start + length * 0.15),
                         cat="wait", track="thread:MainThread", args={"what": key})
        occupancy(start + length, "NVME", 0)

    per_fwd, per_bwd = fwd_s / layers / len(UNITS), bwd_s / layers / len(UNITS)
    rec.complete("step", ns(0), ns(step_s), cat="compute", track="compute", args={"step": 2})
    rec.complete("forward", ns(0), ns(fwd_s), cat="compute", track="compute")
    rec.complete("backward", ns(fwd_s), ns(fwd_s + bwd_s), cat="compute", track="compute")
    rec.complete("optimizer step", ns(fwd_s + bwd_s), ns(step_s), cat="compute", track="compute")
    for layer in range(layers):
        for u in range(len(UNITS)):
            use(layer, u, "forward", (layer * len(UNITS) + u) * per_fwd, per_fwd)
    for k, layer in enumerate(reversed(range(layers))):
        base = fwd_s + k * len(UNITS) * per_bwd
        for u in reversed(range(len(UNITS))):
            use(layer, u, "backward", base + (len(UNITS) - 1 - u) * per_bwd, per_bwd)
        chunk = len(UNITS) * per_bwd / CHUNKS  # CPU Adam runs behind backward, chunk by chunk
        for c in range(CHUNKS):
            a = base + c * chunk
            transfer("fetch", "fetch", "fetch", a, a + chunk * 0.45,
                     {"key": str(("g", layer, c)), "kind": "grad", "bytes": 16 * MiB,
                      "steps": "READ"})
            transfer("read", "io", "io:aio", a, a + chunk * 0.45,
                     {"bytes": 48 * MiB, "path": "/nvme/swap/offload-r0-optim.swap"})
            rec.complete("optim:wait_read", ns(a), ns(a + chunk * 0.45), cat="wait",
                         track="optim")
            rec.complete("optim:update", ns(a + chunk * 0.45), ns(a + chunk * 0.6),
                         cat="compute", track="optim",
                         args={"partition": str(layer), "chunk": c, "elems": 4 << 20})
            rec.complete("optim:wait_write", ns(a + chunk * 0.6), ns(a + chunk * 0.62),
                         cat="wait", track="optim")
            transfer("write", "io", "io:aio", a + chunk * 0.6, a + chunk,
                     {"bytes": 48 * MiB, "path": "/nvme/swap/offload-r0-optim.swap"})
            if c % 5 == 0:
                rec.complete("optim:wait_durable", ns(a + chunk * 0.95), ns(a + chunk),
                             cat="wait", track="optim")
            if c % 6 == 0:
                rec.complete("wait:busy", ns(a), ns(a + chunk * 0.01), cat="wait",
                             track="thread:MainThread", args={"what": f"fetch of {layer}"})
            occupancy(a + chunk * 0.5, "HOST", 0)


def cmd_render(args: argparse.Namespace) -> int:
    from offload.trace import TraceRecorder, write_chrome_trace
    from offload.trace.headless import HeadlessChromium
    from offload.trace.report import write_report

    work = Path(args.work or tempfile.mkdtemp(prefix="offload-view-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rec = TraceRecorder(enabled=True, process_name="synthetic 3B step")
    rec.set_info(tier_budgets={"DEVICE": 512 << 20, "HOST": GIB, "NVME": 0},
                 disk={"read_Bps": 0.97e9, "write_Bps": 1.48e9}, reference_step_s=None)
    synthetic_step(rec, args.layers)
    trace = write_chrome_trace(work / "synthetic.trace.json", rec)
    events = sum(1 for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] != "M")
    t = time.perf_counter()
    report = write_report([trace], work / "synthetic.report.html")
    build_s = time.perf_counter() - t
    times = []
    with HeadlessChromium.start() as browser:
        for _ in range(args.loads):
            page = browser.open(report.absolute().as_uri())
            page.wait_for("document.documentElement.dataset.rendered === 'true'", timeout=60)
            times.append(page.evaluate("window.offloadReport.renderedAt") / 1000.0)
            if page.errors or page.foreign_requests():
                raise SystemExit(f"the page had errors {page.errors} or requests "
                                 f"{page.foreign_requests()}")
            page.close()
    result = {"layers": args.layers, "trace_events": events,
              "report_events": json.loads(report.read_text().split(
                  '<script type="application/json" id="report-data">', 1)[1].split(
                  "</script>", 1)[0])["events"],
              "trace_bytes": trace.stat().st_size, "report_bytes": report.stat().st_size,
              "report_write_s": build_s, "render_s": times,
              "render_median_s": statistics.median(times), "work": str(work)}
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("count", help="events per layer of real traced steps")
    c.add_argument("--layers", default="2,3")
    c.add_argument("--swap-dir", default="offload-swap")
    c.add_argument("--device-budget", default="80MiB", help="small enough that, as in the 3B "
                   "run (512 MiB for 5.9 GB of bf16 weights), every group moves each use")
    c.add_argument("--host-budget", default="64MiB", help="likewise (the 3B run: 1 GiB)")
    c.set_defaults(func=cmd_count)
    r = sub.add_parser("render", help="render time and size of a synthetic step's report")
    r.add_argument("--layers", type=int, default=59, help="layers (59: the 3B model)")
    r.add_argument("--loads", type=int, default=7, help="page loads; the median is reported")
    r.add_argument("--work", default=None, help="where the trace and report go (default: a "
                   "new temporary directory)")
    r.set_defaults(func=cmd_render)
    args = p.parse_args(argv if argv is not None else (sys.argv[1:] or ["render"]))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
