"""Real steps of a configuration: what `offload tune --verify` and `offload bench tune`
measure against the prediction. The model is built by `offload.initialize` from its
factory (on meta, materialised group by group) and trained on a fixed batch of the
given shape; the step time is the median over the timed steps. Several
configurations compared against each other are measured in interleaved rounds
(`measure_rounds`) and chosen on the median and spread of every timed step
(`steadiest_fastest`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .model_arg import ModelSpec, call, example_batch

__all__ = ["measure_config", "measure_rounds", "measure_warm", "spread", "steadiest_fastest"]


def _batch(spec: ModelSpec, device: str, dtype: Any = None) -> tuple[dict, Any]:
    """Random inputs of the shapes `example_batch` gives, on `device`; every floating
    tensor in `dtype` (the engine's compute dtype) where given: an image model that
    does not cast its own input (Swin) failed every real step under bf16 on
    pixel_values left fp32, where the estimate had cast them."""
    import torch

    from ..engine.meta import meta_device

    with meta_device():
        meta = spec.build()
    batch, loss_of = example_batch(meta, spec, "cpu")
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in batch.items():
        if v.dtype.is_floating_point:
            v = torch.randn(v.shape, generator=g).to(dtype or torch.float32)
        else:
            vocab = getattr(getattr(meta, "config", None), "vocab_size", 2)
            v = torch.randint(0, vocab, v.shape, generator=g)
        out[k] = v.to(device)
    if "labels" in out:
        out["labels"] = out["input_ids"]
    return out, loss_of


def measure_config(spec: ModelSpec, config: dict, *, steps: int = 3,
                   warmup: int = 1) -> dict[str, Any]:
    """Initialises the model under `config`, runs `warmup` then `steps` steps (each of
    its engine.grad_accum_steps micro-batches); the median step (s), every step, init
    seconds, the store's peak bytes per tier and the bytes read and written to NVMe
    per step."""
    import torch

    import offload

    t0 = time.perf_counter()
    engine = offload.initialize(spec.factory(), config)
    init_s = time.perf_counter() - t0
    try:
        batch, loss_of = _batch(spec, str(engine.store.device), engine.dtype)
        times = []
        io0 = None
        for i in range(warmup + steps):
            if i == warmup:
                io0 = engine.nvme_bytes()
            t = time.perf_counter()
            for _ in range(engine.grad_accum_steps):
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
                 steps: int = 2, warm: bool = True) -> list[dict[str, Any] | None]:
    """Measures each of `configs` (after one untimed warm-up run of the first when `warm`:
    the first engine of a process pays for thread pools and fresh pages); None for
    those left when `deadline` (perf_counter seconds) has passed."""
    out: list[dict[str, Any] | None] = []
    if configs and warm:
        _warm_up(spec, configs[0])
    for cfg in configs:
        if deadline is not None and time.perf_counter() > deadline:
            out.append(None)
            continue
        out.append(_measure_or_error(spec, cfg, steps))
        if tick:
            tick()
    return out


def measure_rounds(spec: ModelSpec, configs: dict[str, dict], *, rounds: int, steps: int,
                   deadline: float | None = None, tick=None, warm: bool = True,
                   min_rounds: int = 1) -> dict[str, Any]:
    """[Note: interleaved rounds] Measures every configuration of `configs` once per
    round, `rounds` times, each round starting at another place of the list (two
    configurations alternate: A B, B A, ...; after one untimed warm-up run when
    `warm`), so a change of the host's load falls on all of
    them alike rather than on whichever ran then. Rounds after the first `min_rounds`
    start only when, at the pace of the round before, they end by `deadline`
    (perf_counter seconds). Returns every timed step of each configuration
    (`samples`, seconds), the errors of those that failed, and the rounds run."""
    keys = list(configs)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    errors: dict[str, str] = {}
    if keys and warm:
        _warm_up(spec, configs[keys[0]])
    done, pace = 0, 0.0
    for r in range(rounds):
        t = time.perf_counter()
        if r >= min_rounds and deadline is not None and t + pace > deadline:
            break
        shift = r * max(1, len(keys) // rounds) % len(keys)  # two configurations: A B, B A
        for key in keys[shift:] + keys[:shift]:
            if key in errors:
                continue
            m = _measure_or_error(spec, configs[key], steps)
            if "error" in m:
                errors[key] = m["error"]
            else:
                samples[key].extend(m["steps_s"])
            if tick:
                tick()
        done, pace = done + 1, time.perf_counter() - t
    return {"samples": samples, "errors": errors, "rounds": done}


def spread(samples: list[float]) -> dict[str, float]:
    """The median of `samples` (seconds), their quartiles, and the spread: the
    interquartile range over the median (0: steady)."""
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    med = statistics.median(samples)
    return {"median_s": med, "p25_s": q[0], "p75_s": q[2],
            "spread": (q[2] - q[0]) / med if med > 0 else 0.0, "n": len(samples)}


def steadiest_fastest(stats: dict[str, dict[str, float]], tie: float = 0.05) -> str:
    """The key to choose among measured configurations (`spread` of each): the lowest
    upper quartile, the pace a configuration keeps three steps out of four; of those
    within `tie` of it, the lowest median. A configuration whose step swings with the
    host's load (a low median, a high upper quartile) loses to one nearly as fast
    that holds its pace."""
    steady = min(s["p75_s"] for s in stats.values())
    near = [k for k, s in stats.items() if s["p75_s"] <= steady * (1 + tie)]
    return min(near, key=lambda k: (stats[k]["median_s"], stats[k]["p75_s"]))


def _warm_up(spec: ModelSpec, config: dict) -> None:
    try:
        measure_config(spec, config, steps=1, warmup=1)
    except Exception:  # reported by its own timed run
        pass


def _measure_or_error(spec: ModelSpec, config: dict, steps: int) -> dict[str, Any]:
    try:
        return measure_config(spec, config, steps=steps)
    except Exception as e:  # a configuration that fails is a result: not chosen
        return {"error": f"{type(e).__name__}: {e}"}
