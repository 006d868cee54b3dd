"""`offload bench adam --convergence`: final loss with compressed Adam moments against fp32.

Two models train on the demo's task (sequence reversal, `offload/cli/gpt.py`)
through the engine (`offload.initialize`, optimizer state on the host), once
per (seed, optim.state_dtype), the same seed giving the same initial weights
and batches to every state dtype: the demo's tiny decoder, and a GPT-2-style
one (4 pre-norm blocks, d_model 192, 64 symbols). The figure is each run's
final loss (the mean of the last `TAIL` steps, as a single step's loss is
noisy) over the fp32 run's of the same seed and model: the target is within
2% (ratio <= 1.02) for int8 and bf16 moments.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Callable

import torch

from .args import table_console
from .gpt import GPT, GPTConfig, ReversalTask

TAIL = 20  # steps averaged into the final loss
TARGET = 1.02
MODELS = {  # name: (model, symbols, length, batch, lr)
    "demo-tiny": (GPTConfig(n_layer=2, d_model=128, n_head=2, vocab=17, max_seq=32),
                  16, 8, 16, 5e-4),
    "gpt2-style": (GPTConfig(n_layer=4, d_model=192, n_head=4, vocab=65, max_seq=64),
                   64, 16, 8, 2e-4),
}


def train_once(model: str, state_dtype: str, seed: int, steps: int) -> list[float]:
    """Losses of `steps` steps of `model` with moments in `state_dtype`."""
    cfg, symbols, length, batch, lr = MODELS[model]
    torch.manual_seed(seed)
    net = GPT(cfg)
    conf = {"engine": {"params": "device", "grads": "host", "optimizer": "host",
                       "dtype": "fp32"},
            "optim": {"lr": lr, "weight_decay": 0.01, "state_dtype": state_dtype,
                      "max_grad_norm": 1.0},
            "store": {"device": "cpu"}}
    task = ReversalTask(symbols, length, batch, seed=seed)
    with tempfile.TemporaryDirectory(prefix="offload-convergence-") as swap_dir:
        conf["io"] = {"paths": [swap_dir]}  # its own swap files, never the working directory's
        losses = _train(net, conf, task, steps)
    return losses


def _train(net: GPT, conf: dict, task: ReversalTask, steps: int) -> list[float]:
    import offload

    losses = []
    with offload.initialize(net, conf) as engine:
        for _ in range(steps):
            x, y = task.next_batch()
            loss = ReversalTask.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def run_convergence(steps: int, seeds: int, dtypes: tuple[str, ...],
                    progress: Callable[[str], None] | None = None) -> dict:
    """Every (model, seed, state dtype) run; final losses and their ratios to fp32."""
    rows = []
    for model in MODELS:
        for seed in range(seeds):
            base = None
            for sd in ("fp32",) + tuple(d for d in dtypes if d != "fp32"):
                t = time.perf_counter()
                losses = train_once(model, sd, seed, steps)
                final = statistics.fmean(losses[-TAIL:])
                base = final if sd == "fp32" else base
                rows.append({"model": model, "seed": seed, "state_dtype": sd,
                             "final_loss": final, "first_loss": losses[0],
                             "vs_fp32": final / base, "seconds": time.perf_counter() - t})
                if progress:
                    progress(f"{model} seed {seed} {sd}: final loss {final:.4f} "
                             f"({final / base:.3f}x fp32)")
    worst = {}
    for r in rows:
        if r["state_dtype"] != "fp32":
            key = f"{r['model']} {r['state_dtype']}"
            worst[key] = max(worst.get(key, 0.0), r["vs_fp32"])
    return {"benchmark": "adam-convergence", "steps": steps, "seeds": seeds, "tail": TAIL,
            "rows": rows, "worst_vs_fp32": worst,
            "targets": [{"target": f"{k} final loss <= {TARGET}x fp32's (worst seed)",
                         "value": v, "limit": TARGET, "met": v <= TARGET}
                        for k, v in worst.items()]}


def render(result: dict) -> None:
    from rich.table import Table

    con = table_console()
    t = Table(title=f"final loss (mean of the last {result['tail']} of {result['steps']} "
                    "steps) by moment form")
    for col in ("model", "seed", "state_dtype", "first", "final", "x fp32", "s"):
        t.add_column(col, justify="left" if col in ("model", "state_dtype") else "right")
    for r in result["rows"]:
        t.add_row(r["model"], str(r["seed"]), r["state_dtype"], f"{r['first_loss']:.3f}",
                  f"{r['final_loss']:.4f}", f"{r['vs_fp32']:.3f}", f"{r['seconds']:.0f}")
    con.print(t)
    for tg in result["targets"]:
        con.print(f"target: {tg['target']}: {tg['value']:.3f} -> "
                  + ("[green]met[/green]" if tg["met"] else "[red]missed[/red]"))
