"""Real steps of a configuration: what `offload tune --verify` and `offload bench tune`
measure against the prediction. The model is built by `offload.initialize` from its
factory (on meta, materialised group by group) and trained on a fixed batch of the
given shape; the step time is the median over the timed steps."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .model_arg import ModelSpec, call, example_batch

__all__ = ["measure_config", "measure_warm"]


def _batch(spec: ModelSpec, device: str) -> tuple[dict, Any]:
    import torch

    with torch.device("meta"):
        meta = spec.build()
    batch, loss_of = example_batch(meta, spec, "cpu")
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in batch.items():
        if v.dtype.is_floating_point:
            v = torch.randn(v.shape, generator=g)
        else:
            vocab = getattr(getattr(meta, "config", None), "vocab_size", 2)
            v = torch.randint(0, vocab, v.shape, generator=g)
        out[k] = v.to(device)
    if "labels" in out:
        out["labels"] = out["input_ids"]
    return out, loss_of


def measure_config(spec: ModelSpec, config: dict, *, steps: int = 3,
                   warmup: int = 1) -> dict[str, Any]:
    """Initialises the model under `config`, runs `warmup` then `steps` steps; the
    median step (s), every step, init seconds, the store's peak bytes per tier and the
    bytes read and written to NVMe per step."""
    import torch

    import offload

    t0 = time.perf_counter()
    engine = offload.initialize(spec.factory(), config)
    init_s = time.perf_counter() - t0
    try:
        batch, loss_of = _batch(spec, str(engine.store.device))
        dtype = engine.dtype
        if "input" in batch and batch["input"].dtype.is_floating_point:
            batch["input"] = batch["input"].to(dtype)
        times = []
        io0 = None
        for i in range(warmup + steps):
            if i == warmup:
                io0 = engine.nvme_bytes()
            t = time.perf_counter()
            engine.backward(loss_of(call(engine, batch)).float())
            engine.step()
            if engine.store.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        io1 = engine.nvme_bytes()
        peaks = {t.lower(): s.peak for t, s in engine.store.stats().tiers.items()}
    finally:
        engine.close()
    return {"step_s": statistics.median(times), "steps_s": times, "init_s": init_s,
            "store_peak": peaks, "read_bytes_per_step": (io1[0] - io0[0]) // steps,
            "write_bytes_per_step": (io1[1] - io0[1]) // steps}


def measure_warm(spec: ModelSpec, configs: list[dict], tick=None, deadline: float | None = None,
                 steps: int = 2) -> list[dict[str, Any] | None]:
    """Measures each of `configs` after one untimed warm-up run of the first (the first
    engine of a process pays for thread pools and fresh pages); None for those left
    when `deadline` (perf_counter seconds) has passed or that failed."""
    out: list[dict[str, Any] | None] = []
    if configs:
        try:
            measure_config(spec, configs[0], steps=1, warmup=1)
        except Exception:  # reported by its own timed run below
            pass
    for cfg in configs:
        if deadline is not None and time.perf_counter() > deadline:
            out.append(None)
            continue
        try:
            out.append(measure_config(spec, cfg, steps=steps))
        except Exception as e:  # a configuration that fails is a result: not chosen
            out.append({"error": f"{type(e).__name__}: {e}"})
        if tick:
            tick()
    return out
