"""Time to build the report of a trace of many steps (`offload view`'s model).

    python benchmarks/view_steps.py record --steps 300 -o /tmp/s300.json
    python benchmarks/view_steps.py build /tmp/s300.json

`record` trains a 5-layer MLP (parameters, gradients and optimizer state on NVMe,
budgets that make every group move at each use) for `--steps` steps, each inside a
"step" span as `offload demo` marks them, and writes the trace. `build` parses it
and builds the report's model (`build_model`: the per-step summary, prefetch
outcomes and totals, lanes, occupancy), and prints the trace's events and steps and
the seconds each part took. Run `build` with the code to compare first on
PYTHONPATH (e.g. an earlier commit unpacked with `git archive`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import offload  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from offload.trace import TraceRecorder
from offload.trace.chrome import write_chrome_trace


def record(steps: int, out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(5)])
    rec = TraceRecorder(enabled=True)
    cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme",
                      "group_size": 4200},
           "io": {"paths": [tempfile.mkdtemp(prefix="view-steps-")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "80KiB", "device_budget": "64KiB", "device": "cpu"}}
    x = torch.randn(16, 64)
    with offload.initialize(model, cfg, recorder=rec) as engine:
        for k in range(steps):
            with rec.span("step", cat="compute", track="compute", step=k + 1):
                engine.backward(engine(x).square().mean())
                engine.step()
    write_chrome_trace(out, rec)
    print(f"{steps} steps -> {out}")


def build(path: str) -> None:
    from offload.trace.analysis import steps_of
    from offload.trace.report import build_model, load_traces
    t0 = time.perf_counter()
    ranks = load_traces([path])
    t1 = time.perf_counter()
    build_model(ranks)
    t2 = time.perf_counter()
    with open(path) as f:
        events = len(json.load(f)["traceEvents"])
    print(json.dumps({"trace": path, "events": events, "steps": len(steps_of(ranks[0])),
                      "parse_s": round(t1 - t0, 3), "build_s": round(t2 - t1, 3)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("-o", "--output", required=True)
    b = sub.add_parser("build")
    b.add_argument("trace")
    a = p.parse_args()
    if a.cmd == "record":
        record(a.steps, a.output)
    else:
        build(a.trace)


if __name__ == "__main__":
    main()
