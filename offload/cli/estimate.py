"""`offload estimate MODEL`: the bytes of a model's training state per kind, its
activations for the batch shape, and what each tier holds per rank and per node
under every placement, from the model built on `meta` (nothing is materialised).

The tier figures are those of offload.planner.estimate ([Note: what each tier
holds]); the minimum working set (offload.engine.working_set) is the least
budget each memory tier must be given for the placement to train at all.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import EngineConfig, IoConfig, OffloadConfig, OptimConfig, format_bytes
from ..planner.estimate import (KINDS, PLACEMENTS, ModelBytes, kind_bytes, parse_placement,
                                tier_bytes)
from ..planner.sizes import STATE_DTYPES
from .args import UsageError, byte_size, escape, integer, number, table_console
from .benchutil import emit
from .model_arg import MeasuredModel, add_model_arguments, measure_model, model_spec

__all__ = ["add_arguments", "add_training_arguments", "estimate", "model_bytes", "run"]

TIERS = ("device", "host", "nvme")


def model_bytes(mm: MeasuredModel, state_dtype: str = "fp32") -> ModelBytes:
    """The planner's view of a measured model, its Adam moments in `state_dtype`."""
    return ModelBytes(mm.shards, mm.spec.dtype, mm.activations, mm.activations_checkpointed,
                      state_dtype)


def minimum(mm: MeasuredModel, engine: dict[str, Any], device: str = "cpu",
            max_grad_norm: float = 0.0) -> dict[str, int]:
    """The minimum working set (bytes per rank) of DEVICE and HOST for these engine keys
    and clipping (`max_grad_norm`, optim.max_grad_norm)."""
    from ..engine.working_set import working_set

    cfg = OffloadConfig(engine=EngineConfig(dtype=mm.spec.dtype, **engine),
                        optim=OptimConfig(max_grad_norm=max_grad_norm))
    ws = working_set(cfg, mm.groups)  # in engine.dtype, the spec's
    return {"device": ws.device, "host": ws.host}


def estimate(mm: MeasuredModel, placements, *, world: int, ranks_per_node: int,
             device: str, buffer_budget: int, group_size: int,
             state_dtype: str = "fp32", max_grad_norm: float = 0.0,
             grad_accum_steps: int = 1) -> dict[str, Any]:
    """The JSON-ready estimate of `mm` (measured for `world` ranks), the Adam moments
    in `state_dtype` (optim.state_dtype), for training that clips at `max_grad_norm`
    (optim.max_grad_norm, 0: no clipping) and sums `grad_accum_steps` micro-batches
    a step (engine.grad_accum_steps)."""
    mb = model_bytes(mm, state_dtype)
    kinds = kind_bytes(mb)
    engine = {"group_size": group_size, "grad_accum_steps": grad_accum_steps}
    rows = []
    for p in placements:
        tb = tier_bytes(mb, p, device=device, buffer_budget=buffer_budget,
                        clipping=max_grad_norm > 0, accum=grad_accum_steps)
        total = tb.total
        rows.append({"placement": p.name, **p.engine_keys(),
                     "per_rank": total, "per_node": {t: v * ranks_per_node
                                                     for t, v in total.items()},
                     "store": tb.store, "optimizer_state": tb.optimizer, "buffers": tb.buffers,
                     "minimum": minimum(mm, {**p.engine_keys(), **engine}, device,
                                        max_grad_norm)})
    return {"command": "estimate", "model": mm.spec.target, "model_class": mm.model_class,
            "dtype": mm.spec.dtype,
            "batch": mm.spec.batch, "tokens_per_batch": mm.tokens, "params": mm.params,
            "groups": len(mm.shards), "units": len(mm.unit_names), "world": world,
            "ranks_per_node": ranks_per_node, "device": device, "group_size": group_size,
            "io_buffer_budget": buffer_budget, "state_dtype": state_dtype,
            "max_grad_norm": max_grad_norm, "grad_accum_steps": grad_accum_steps,
            "bytes_per_rank": kinds, "bytes_total": {k: v * world for k, v in kinds.items()},
            "activations": {"bytes": mm.activations,
                            "checkpointed_bytes": mm.activations_checkpointed},
            "placements": rows}


def render(result: dict[str, Any]) -> None:
    from rich.table import Table

    con = table_console()
    t = Table(title=f"{escape(result['model'])} ({escape(result['model_class'])}): "
                    f"{result['params'] / 1e6:.1f}M parameters, "
                    f"{result['dtype']}, {result['groups']} groups, world {result['world']}")
    for col in ("kind", "per rank", "all ranks"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for k in KINDS:
        t.add_row(k, format_bytes(result["bytes_per_rank"][k]),
                  format_bytes(result["bytes_total"][k]))
    a = result["activations"]
    t.add_row(f"activations (batch {result['batch']}, {result['tokens_per_batch']} positions)",
              format_bytes(a["bytes"]), "")
    t.add_row("activations, checkpointed", format_bytes(a["checkpointed_bytes"]), "")
    con.print(t)
    t = Table(title=f"per tier, params/grads/optimizer (io.buffer_budget "
                    f"{format_bytes(result['io_buffer_budget'])} in host; "
                    f"{result['ranks_per_node']} ranks per node; activations apart)")
    t.add_column("placement")
    for tier in TIERS:
        t.add_column(f"{tier}/rank", justify="right")
    for tier in TIERS:
        t.add_column(f"{tier}/node", justify="right")
    t.add_column("min device", justify="right")
    t.add_column("min host", justify="right")
    for r in result["placements"]:
        t.add_row(r["placement"], *(format_bytes(r["per_rank"][x]) for x in TIERS),
                  *(format_bytes(r["per_node"][x]) for x in TIERS),
                  format_bytes(r["minimum"]["device"], up=True),
                  format_bytes(r["minimum"]["host"], up=True))
    con.print(t)
    con.print("min: the least store budget per rank that trains at all (the rest streams); "
              "the other columns hold everything where the placement puts it. nvme: the "
              "state's bytes; each swap file (params, grads, optimizer) takes disk in steps "
              "of io.grow_step (256 MiB by default). "
              f"{'Clipping' if result['max_grad_norm'] else 'No clipping'}, "
              f"{result['grad_accum_steps']} micro-batch(es) a step: with NVMe optimizer "
              "state, clipping, fp16 or accumulation store the gradients until step() "
              "(--max-grad-norm, --grad-accum-steps; docs/tuning.md)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--world", type=integer(1, example=8), default=1,
                   help="ranks (default 1)")
    p.add_argument("--ranks-per-node", type=integer(1, example=8), default=None,
                   help="ranks per node (default: all of --world on one node)")
    p.add_argument("--placement", default=None,
                   help="comma list of params/grads/optimizer, e.g. nvme/host/nvme "
                   "(default: all 18)")
    p.add_argument("--group-size", type=integer(1, example=4194304),
                   default=EngineConfig().group_size, help="engine.group_size (default 4M)")
    p.add_argument("--buffer-budget", type=byte_size(IoConfig().block_size, example="1GiB"),
                   default=IoConfig().buffer_budget, help="io.buffer_budget (default 1GiB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="compute device (default: cuda where visible, else cpu)")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                   help="optim.state_dtype: the form of Adam's moments (default fp32; bf16 "
                   "halves them, int8 keeps about a quarter)")
    add_training_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """--max-grad-norm and --grad-accum-steps: what decides whether gradients are stored
    until step()."""
    p.add_argument("--max-grad-norm", type=number(0, example=1.0), default=0.0,
                   help="optim.max_grad_norm: clipping (default 0, none; Hugging Face's "
                   "Trainer clips at 1.0)")
    p.add_argument("--grad-accum-steps", type=integer(1, example=4), default=1,
                   help="engine.grad_accum_steps: micro-batches of --batch per step "
                   "(default 1)")


def placements_arg(text: str | None):
    """--placement: a comma list, each checked (UsageError naming the bad one)."""
    if text is None:
        return PLACEMENTS
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(parse_placement(part))
        except ValueError as e:
            raise UsageError(f"--placement: {e}") from None
    if not out:
        raise UsageError("--placement: empty; give e.g. nvme/host/nvme")
    return tuple(out)


def default_device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    placements = placements_arg(args.placement)
    per_node = args.ranks_per_node or args.world
    if per_node > args.world:
        raise UsageError(f"--ranks-per-node: {per_node} is above --world {args.world}; give "
                         "at most the world size")
    mm = measure_model(spec, args.group_size, args.world)
    result = estimate(mm, placements, world=args.world, ranks_per_node=per_node,
                      device=default_device(args.device), buffer_budget=args.buffer_budget,
                      group_size=args.group_size, state_dtype=args.state_dtype,
                      max_grad_norm=args.max_grad_norm, grad_accum_steps=args.grad_accum_steps)
    return emit(result, args.json, render)
