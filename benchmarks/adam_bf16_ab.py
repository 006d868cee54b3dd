"""fp32 update vs bf16-parameter update of CpuAdam, quiet and beside one spinning process.

Imports `offload` from PYTHONPATH, so two checkouts compare in alternating
processes (A B A B), e.g.:
    for i in 1 2; do for w in /path/old /path/new; do
        PYTHONPATH=$w python benchmarks/adam_bf16_ab.py; done; done
Prints one JSON line: Gelem/s of each and their ratio, quiet and busy.
"""
import json, statistics, subprocess, sys, time, torch
from offload.config import OptimConfig
from offload.optim import CpuAdam
n = 20_000_000
p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.rand(n)
out = torch.empty(n, dtype=torch.bfloat16)
opt = CpuAdam(OptimConfig()); opt.add_partition("x", p, exp_avg=m, exp_avg_sq=v)
impls = {"fp32": lambda: opt.step({"x": g}, final=True),
         "bf16": lambda: opt.step({"x": g}, params_out={"x": out}, final=True)}
res = {}
for mode in ("quiet", "busy"):
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if mode == "busy" else None
    time.sleep(0.2)
    for f in impls.values(): f()
    T = {k: [] for k in impls}
    for r in range(7):
        for k, f in impls.items():
            t = time.perf_counter(); f(); T[k].append(time.perf_counter() - t)
    if spin: spin.kill(); spin.wait()
    med = {k: statistics.median(t) for k, t in T.items()}
    res[mode] = {"fp32_Gelem_s": n / med["fp32"] / 1e9, "bf16_Gelem_s": n / med["bf16"] / 1e9,
                 "bf16_over_fp32": med["fp32"] / med["bf16"]}
print(json.dumps(res))
