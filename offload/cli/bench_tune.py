"""`offload bench tune`: does `offload tune` choose well, and fast enough?

For each model (an MLP given as module:function, and a GPT-2-shaped Hugging Face
config) and each budget setting (roomy: everything fits in memory; tight: the
host budget is below the training state, so something must live on NVMe),
`offload tune` runs as a user runs it (its own process, `--json --write
--verify`), timed. Then the benchmark measures, in one worker process per
setting (a child of the benchmark: the same process tree), the configuration
tune wrote and a sweep of `--sweep` other configurations of the same search
space (spread over tune's whole ranking, so the sweep holds good and bad ones),
interleaved over `--rounds` rounds. The sweep's best is the one of lowest median
step; the best of 20 noisy medians is biased low (it is the one whose
measurements were luckiest), so after the sweep the worker re-measures the
sweep's best and the written configuration in `--ab-rounds` interleaved A/B
rounds (A B, B A, ...) and compares medians: the figure is the written
configuration's median step over the sweep best's median step in those A/B
rounds (target <= 1.05), with tune's time (target <= 180 s), and predicted
against measured for every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .args import byte_size, directory, integer, table_console
from .benchutil import emit, progress_printer, scratch_dir

MiB = 1 << 20
TARGET_RATIO = 1.05
TARGET_TUNE_S = 180.0
GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 4096,
        "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0}


def mlp():
    """The MLP of the benchmark: 8 x Linear(1024, 1024), ReLU between."""
    from torch import nn

    layers: list = []
    for i in range(8):
        layers.append(nn.Linear(1024, 1024))
        if i < 7:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _models(work: str) -> list[dict[str, Any]]:
    hf = os.path.join(work, "gpt2-small-bench")
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(GPT2, f)
    return [{"name": "mlp-8x1024", "argv": ["offload.cli.bench_tune:mlp", "--batch", "16",
                                            "--dtype", "fp32"]},
            {"name": "gpt2-4x256", "argv": [hf, "--batch", "4", "--seq", "128",
                                            "--dtype", "bf16"]}]


def _budgets(args) -> list[dict[str, Any]]:
    return [{"name": "roomy", "host": args.roomy_host, "device": args.roomy_device},
            {"name": "tight", "host": args.tight_host, "device": args.tight_device}]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _run_tune(model: dict, budget: dict, swap: str, out: str, args) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "offload.cli.main", "tune", *model["argv"], "--swap", swap,
           "--host-budget", str(budget["host"]), "--device-budget", str(budget["device"]),
           "--device", "cpu", "--probe-size", str(args.probe_size), "--write", out,
           "--verify", str(args.verify), "--json"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    seconds = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1], "seconds": seconds}
    return {**json.loads(p.stdout), "wall_s": seconds}


def _sweep(results: list[dict], n: int, chosen: int) -> list[int]:
    """`n` indices spread over the ranking, the chosen one excluded."""
    idx = [i for i in range(len(results)) if i != (chosen or 0) - 1]
    if len(idx) <= n:
        return idx
    return sorted({idx[round(k * (len(idx) - 1) / (n - 1))] for k in range(n)})


def _worker(spec_json: str) -> int:
    """Measures every config of a job file in interleaved rounds (the sweep), then the
    sweep's best (lowest median) and the written one ("tuned") in interleaved A/B
    rounds; writes every timed step of both phases."""
    from .model_arg import ModelSpec
    from .tune_verify import measure_rounds

    job = json.loads(Path(spec_json).read_text())
    spec = ModelSpec(**job["spec"])
    sweep = measure_rounds(spec, job["configs"], rounds=job["rounds"], steps=job["steps"])
    med = {k: statistics.median(v) for k, v in sweep["samples"].items() if v and k != "tuned"}
    out = {"sweep": sweep, "best": min(med, key=med.get) if med else None}
    if out["best"] and sweep["samples"].get("tuned"):
        pair = {k: job["configs"][k] for k in ("tuned", out["best"])}
        out["ab"] = measure_rounds(spec, pair, rounds=job["ab_rounds"], steps=job["steps"],
                                   warm=False)
    Path(job["out"]).write_text(json.dumps(out))
    return 0


def _measure(spec: dict, configs: dict[str, dict], work: str, args) -> dict[str, Any]:
    job = os.path.join(work, "job.json")
    out = os.path.join(work, "measured.json")
    Path(job).write_text(json.dumps({"spec": spec, "configs": configs, "rounds": args.rounds,
                                     "ab_rounds": args.ab_rounds, "steps": args.steps,
                                     "out": out}))
    subprocess.run([sys.executable, "-m", "offload.cli.bench_tune", "--worker", job],
                   env=_env(), timeout=1800, check=False)
    if not os.path.exists(out):
        return {"sweep": {"samples": {}, "errors": {"worker": "no result"}}, "best": None}
    return json.loads(Path(out).read_text())


def _setting(model: dict, budget: dict, work: str, args, progress) -> dict[str, Any]:
    swap = os.path.join(work, f"swap-{model['name']}-{budget['name']}")
    toml = os.path.join(work, f"{model['name']}-{budget['name']}.toml")
    tuned = _run_tune(model, budget, swap, toml, args)
    row: dict[str, Any] = {"model": model["name"], "budget": budget["name"],
                           "host_budget": budget["host"], "device_budget": budget["device"]}
    if "error" in tuned:
        return {**row, "error": tuned["error"]}
    from .model_arg import ModelSpec

    res = tuned["results"]
    picks = _sweep(res, args.sweep, tuned["chosen"])
    from ..config import toml_loads

    configs = {"tuned": toml_loads(Path(toml).read_text(), str(toml))}
    configs.update({f"#{i + 1}": res[i]["config"] for i in picks})
    spec = ModelSpec("hf" if model["argv"][0].endswith("bench") else "function",
                     model["argv"][0], tuned["batch"], None, tuned["dtype"]).__dict__
    if spec["source"] == "hf":
        spec["target"] = os.path.join(model["argv"][0], "config.json")
        spec["seq"] = 128
    if progress:
        progress(f"{model['name']} {budget['name']}: tune {tuned['wall_s']:.1f} s, "
                 f"{tuned['candidates']} candidates; measuring {len(configs)} configurations")
    m = _measure(spec, configs, work, args)
    med = {k: statistics.median(v) for k, v in m["sweep"]["samples"].items() if v}
    best_key = m["best"]
    ab = {k: statistics.median(v) for k, v in m.get("ab", {}).get("samples", {}).items() if v}
    ratio = ab["tuned"] / ab[best_key] if best_key in ab and "tuned" in ab else None
    pred = {f"#{i + 1}": res[i]["predicted_step_s"] for i in picks}
    chosen = res[tuned["chosen"] - 1] if tuned["chosen"] else None
    pred["tuned"] = chosen["predicted_step_s"] if chosen else None
    if progress and ratio:
        progress(f"{model['name']} {budget['name']}: A/B medians: tuned {ab['tuned']:.3f} s, "
                 f"best of sweep {ab[best_key]:.3f} s ({best_key}), ratio {ratio:.2f}")
    return {**row, "tune_s": tuned["wall_s"], "candidates": tuned["candidates"],
            "chosen": tuned["chosen"], "tuned": chosen["placement"] if chosen else None,
            "sweep_size": len(med) - ("tuned" in med), "sweep_best": best_key,
            "sweep_tuned_step_s": med.get("tuned"), "sweep_best_sweep_step_s": med.get(best_key),
            "tuned_step_s": ab.get("tuned"), "sweep_best_step_s": ab.get(best_key),
            "ab_rounds": m.get("ab", {}).get("rounds"), "ab_samples": m.get("ab", {}).get(
                "samples"),
            "ratio": ratio, "measured": med, "predicted": pred,
            "errors": m["sweep"]["errors"], "final": tuned.get("final"),
            "verify": tuned.get("verify", []),
            "placements": {k: (configs[k]["engine"]["params"] + "/" + configs[k]["engine"]["grads"]
                               + "/" + configs[k]["engine"]["optimizer"]) for k in configs}}


def run_tune_bench(args, path: str, progress=None) -> dict[str, Any]:
    import torch

    os.makedirs(path, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".offload-bench-tune-", dir=path)
    try:
        rows = [_setting(m, b, work, args, progress) for m in _models(work)
                for b in _budgets(args)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in rows if r.get("ratio") is not None]
    targets = [{"target": "tuned step / best of sweep", "value": max(r["ratio"] for r in ok),
                "limit": TARGET_RATIO, "met": all(r["ratio"] <= TARGET_RATIO for r in ok)
                and len(ok) == len(rows)},
               {"target": "tune seconds", "value": max(r.get("tune_s", 1e9) for r in rows),
                "limit": TARGET_TUNE_S,
                "met": all(r.get("tune_s", 1e9) <= TARGET_TUNE_S for r in rows)}] if ok else []
    return {"benchmark": "tune", "rounds": args.rounds, "ab_rounds": args.ab_rounds,
            "steps": args.steps,
            "sweep": args.sweep, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "results": rows, "targets": targets}


def render(result: dict[str, Any]) -> None:
    from rich.table import Table

    con = table_console()
    t = Table(title=f"offload bench tune: the written configuration against the best of a "
                    f"sweep of {result['sweep']} of the same space ({result['rounds']} "
                    f"interleaved rounds), medians of {result['ab_rounds']} interleaved A/B "
                    f"rounds x {result['steps']} steps")
    for c in ("model", "budget", "tune s", "tuned", "step s", "sweep best", "step s", "ratio"):
        t.add_column(c, justify="left" if c in ("model", "budget", "tuned", "sweep best")
                     else "right")
    for r in result["results"]:
        if "error" in r:
            t.add_row(r["model"], r["budget"], "-", r["error"][:60], "", "", "", "")
            continue
        best = r["sweep_best"]
        t.add_row(r["model"], r["budget"], f"{r['tune_s']:.0f}", r["tuned"] or "-",
                  _num(r["tuned_step_s"], ".3f"), f"{best} {r['placements'].get(best, '')}",
                  _num(r["sweep_best_step_s"], ".3f"), _num(r["ratio"], ".2f"))
    con.print(t)
    for tg in result["targets"]:
        con.print(f"target: {tg['target']}: {tg['value']:.2f} vs {tg['limit']:.2f} -> "
                  + ("[green]met[/green]" if tg["met"] else "[red]missed[/red]"))


def _num(value: float | None, spec: str) -> str:
    """`value` formatted, or "-" where it was not measured."""
    return "-" if value is None else format(value, spec)


def _unmeasured(result: dict[str, Any]) -> list[str]:
    """One line for each setting whose written configuration was not compared with the
    sweep's best (it failed, or the A/B rounds measured one of them not at all)."""
    return [f"offload bench tune: {r['model']} {r['budget']}: "
            + (r["error"] if "error" in r else "the written configuration was not compared "
               f"with the sweep's best (no A/B median of "
               f"{'the written one' if r.get('tuned_step_s') is None else 'the best'}; "
               "sweep errors: " + ("; ".join(f"{k}: {v}" for k, v in r["errors"].items())
                                   if r.get("errors") else "none") + ")")
            for r in result["results"] if r.get("ratio") is None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default=None, type=directory("directory for the swap files"),
                   help="scratch directory (default: a temporary one under the current)")
    p.add_argument("--sweep", type=integer(2, example=20), default=20,
                   help="configurations of the sweep per setting (default 20)")
    p.add_argument("--rounds", type=integer(1, example=2), default=2,
                   help="interleaved rounds of the sweep (default 2)")
    p.add_argument("--ab-rounds", type=integer(1, example=10), default=10,
                   help="interleaved A/B rounds of the written configuration and the sweep's "
                   "best (default 10)")
    p.add_argument("--steps", type=integer(1, example=4), default=4,
                   help="timed steps per configuration and round (default 4)")
    p.add_argument("--verify", type=integer(0, example=3), default=3,
                   help="tune's --verify (default 3)")
    p.add_argument("--probe-size", type=byte_size(8 * MiB, example="64MiB"), default=64 * MiB,
                   help="tune's --probe-size (default 64MiB)")
    p.add_argument("--roomy-host", type=byte_size(4096), default=2048 * MiB,
                   help="host budget of the roomy setting (default 2GiB)")
    p.add_argument("--roomy-device", type=byte_size(4096), default=1024 * MiB,
                   help="device budget of the roomy setting (default 1GiB)")
    p.add_argument("--tight-host", type=byte_size(4096), default=96 * MiB,
                   help="host budget of the tight setting (default 96MiB)")
    p.add_argument("--tight-device", type=byte_size(4096), default=16 * MiB,
                   help="device budget of the tight setting (default 16MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    with scratch_dir(args.path) as path:
        result = run_tune_bench(args, path, progress_printer(args.json))
    rc = emit(result, args.json, render)
    failed = _unmeasured(result)  # a setting with no ratio is a failed run, not exit code 0
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return _worker(argv[1])
    from .args import CommandParser, run_command

    p = CommandParser(prog="offload bench tune", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)


if __name__ == "__main__":
    sys.exit(main())
