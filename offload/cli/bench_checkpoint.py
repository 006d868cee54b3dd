"""`offload bench checkpoint`: saving and resuming a training state against the disk.

Builds a model of `--params` fp32 parameters (square Linear layers of `--dim`),
host placement, and takes one step so every tensor kind holds real values.
Then, in one run on one directory, `--repeats` times each, interleaved:
  * save: a file of the checkpoint's size is written with O_DIRECT (4 MiB
    writes of random bytes, then fdatasync: the reference; random, as the
    checkpoint's tensors are: this host's disk turns written zeros into
    unmapped blocks, which read back slower), then `engine.save_checkpoint` (blocking) writes a
    checkpoint: bytes of tensors / seconds, the durability and the publishing
    rename included;
  * load: dd with O_DIRECT reads that file (the reference), then the page cache
    of one checkpoint's files is dropped (posix_fadvise DONTNEED after their
    fsync) and `offload.initialize(..., resume=)` on a meta model runs until
    the engine is ready (the state lands in fresh memory: its page faults
    count, which dd's reused buffer does not have);
  Reported: the medians of the seconds, rates and references, and the median
  of each run's rate over the reference measured right before it (`ratio`);
  * background: `save_checkpoint(blocking=False)` and training steps until it
    is published; the seconds the steps waited for it (its stall) against
    its duration, and how long those steps took against one without a save
    (the save shares the CPU with them).
Targets: save and load >= 0.8x the reference; stall <= 10% of the save.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from ..config import format_bytes
from ..files import existing_ancestor
from .args import (CommandParser, count, directory, integer, missing_directories, parse_count,
                   remove_directories, run_command)
from .benchutil import check_memory, emit, progress_printer, scratch_dir, vm_hwm

TARGET_RATE = 0.8
TARGET_STALL = 0.1


class _Stack(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _config(path: str, name: str) -> dict:
    return {"engine": {"params": "host", "grads": "host", "optimizer": "host"},
            "io": {"paths": [os.path.join(path, name)]},
            "store": {"host_budget": "20GiB", "device_budget": "20GiB", "device": "cpu"}}


def _dd(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["dd"] + args, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def _reference_write(path: str, size: int, bs: int = 4 << 20) -> float:
    """GB/s of writing a file of `size` bytes with O_DIRECT, as `dd oflag=direct
    conv=fdatasync` does, from one block of random bytes (not /dev/zero: see the
    module's notes)."""
    n = max(1, size // bs)
    block = mmap.mmap(-1, bs)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(bs))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, block)
        os.fdatasync(fd)
        return n * bs / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
        block.close()


def _dd_read(path: str, size: int, bs: int = 4 << 20) -> float:
    """GB/s of dd reading the file `_reference_write` wrote, with O_DIRECT."""
    n = max(1, size // bs)
    return n * bs / _dd([f"if={path}", "of=/dev/null", f"bs={bs}", f"count={n}",
                         "iflag=direct"]) / 1e9


def _drop_cache(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _step(engine, x: torch.Tensor, accum: int) -> None:
    for _ in range(accum):
        engine.backward(engine(x).square().mean())
    engine.step()


def run_checkpoint_bench(path: str, params: int, dim: int = 4096, batch: int = 256,
                         accum: int = 1, repeats: int = 3, progress=None) -> dict:
    import offload
    say = progress or (lambda _m: None)
    layers = max(1, round(params / (dim * dim)))
    cfg = _config(path, "swap-a")
    cfg["engine"]["grad_accum_steps"] = accum
    torch.manual_seed(0)
    x = torch.randn(batch, dim)
    say(f"building {layers} layers of {dim}x{dim} ({layers * dim * dim:,} parameters)")
    engine = offload.initialize(lambda: _Stack(dim, layers), cfg)
    ck = Path(path) / "ckpt"
    ref = os.path.join(path, "reference.bin")
    size = 12 * layers * dim * dim  # fp32: param (the master), exp_avg, exp_avg_sq
    saves: list[tuple[float, float]] = []  # (reference write GB/s, save seconds), interleaved
    loads: list[tuple[float, float]] = []  # (reference read GB/s, load seconds), interleaved
    try:
        _step(engine, x, accum)
        for i in range(repeats):
            say(f"save {i + 1}/{repeats} (blocking), after an O_DIRECT write of "
                f"{format_bytes(size)}")
            w = _reference_write(ref, size)
            os.unlink(ref)
            t = time.perf_counter()
            engine.save_checkpoint(ck / f"a{i}")
            saves.append((w, time.perf_counter() - t))
        say("background save while training")
        t = time.perf_counter()
        _step(engine, x, accum)
        step_s = time.perf_counter() - t  # a step without a save, for scale
        saving = engine.save_checkpoint(ck / "b", blocking=False)
        steps = 0
        t = time.perf_counter()
        while not saving.done() or steps == 0:
            _step(engine, x, accum)
            steps += 1
        during_s = (time.perf_counter() - t) / steps
        saving.wait()
    finally:
        engine.close()
    shutil.rmtree(ck / "b", ignore_errors=True)
    _reference_write(ref, size)
    for i in range(repeats):
        say(f"load {i + 1}/{repeats} (resume, page cache dropped), after dd O_DIRECT reads")
        r = _dd_read(ref, size)
        _drop_cache(ck / f"a{i}")
        t = time.perf_counter()
        resumed = offload.initialize(lambda: _Stack(dim, layers), _config(path, f"swap-b{i}"),
                                     resume=ck / f"a{i}")
        loads.append((r, time.perf_counter() - t))
        resumed.close()
    os.unlink(ref)
    shutil.rmtree(ck, ignore_errors=True)
    save, load = _pairs(saves, size), _pairs(loads, size)
    return {
        "bytes": size, "parameters": layers * dim * dim, "layers": layers, "dim": dim,
        "repeats": repeats,
        "reference": {"write_GBps": save["reference_GBps"], "read_GBps": load["reference_GBps"]},
        "save": save, "load": load,
        "background": {"seconds": saving.seconds, "stalled": saving.stalled,
                       "stall_share": saving.stalled / saving.seconds,
                       "steps_during": steps, "step_seconds": step_s,
                       "step_seconds_during": during_s},
        "peak_rss": vm_hwm(),
        "targets": {"rate": TARGET_RATE, "stall_share": TARGET_STALL},
        "pass": passes(save, load, saving.stalled / saving.seconds),
    }


def passes(save: dict, load: dict, stall_share: float) -> bool:
    """The verdict: save and load each at least TARGET_RATE x the reference run before
    it (`_pairs`' ratio), and training stalled at most TARGET_STALL of the background
    save."""
    return (save["ratio"] >= TARGET_RATE and load["ratio"] >= TARGET_RATE
            and stall_share <= TARGET_STALL)


def _pairs(pairs: list[tuple[float, float]], size: int) -> dict:
    """Medians of interleaved (reference GB/s, seconds) pairs; `ratio` is the median of
    each run's rate over the reference measured right before it."""
    rates = [size / s / 1e9 for _ref, s in pairs]
    return {"seconds": statistics.median(s for _ref, s in pairs),
            "GBps": statistics.median(rates),
            "reference_GBps": statistics.median(ref for ref, _s in pairs),
            "ratio": statistics.median(r / ref for r, (ref, _s) in zip(rates, pairs)),
            "runs": [{"reference_GBps": ref, "seconds": s, "GBps": size / s / 1e9}
                     for ref, s in pairs]}


def render(r: dict) -> None:
    print(f"checkpoint of {format_bytes(r['bytes'])} ({r['parameters']:,} fp32 parameters)")
    print(f"  reference (O_DIRECT write of random bytes, dd O_DIRECT read; medians of "
          f"{r['repeats']}): write "
          f"{r['reference']['write_GBps']:.2f} GB/s, read {r['reference']['read_GBps']:.2f} GB/s")
    for k in ("save", "load"):
        print(f"  {k}: {r[k]['seconds']:.2f} s, {r[k]['GBps']:.2f} GB/s, "
              f"{r[k]['ratio']:.2f}x the reference run before it (median of "
              f"{r['repeats']}; target >= {TARGET_RATE})")
    b = r["background"]
    print(f"  background save: {b['seconds']:.2f} s over {b['steps_during']} step(s) "
          f"({b['step_seconds_during']:.2f} s each; {b['step_seconds']:.2f} s without a save), "
          f"training stalled {b['stalled']:.2f} s "
          f"= {100 * b['stall_share']:.0f}% (target <= {100 * TARGET_STALL:.0f}%)")
    print(f"  peak RSS {format_bytes(r['peak_rss'])}; {'pass' if r['pass'] else 'FAIL'}")


def add_arguments(p) -> None:
    p.add_argument("--path", default=None, type=directory("directory on the disk to measure"),
                   help="directory on the disk to measure "
                   "(default: a temporary directory under the current one)")
    p.add_argument("--params", type=count(1, example="180M"), default="180M",
                   help="fp32 parameters (default 180M: a checkpoint of 2.1 GB)")
    p.add_argument("--dim", type=integer(16, example=4096), default=4096,
                   help="width of the square layers (default 4096)")
    p.add_argument("--batch", type=integer(1, example=256), default=256,
                   help="rows per micro-batch (default 256)")
    p.add_argument("--accum", type=integer(1, example=1), default=1,
                   help="micro-batches per step (default 1)")
    p.add_argument("--repeats", type=integer(1, example=3), default=3,
                   help="saves and loads, each after its own O_DIRECT reference (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


MEMORY_PER_PARAM = 16  # host placement: fp32 parameter, gradient and both moments


def _check_room(args) -> None:
    """Refuses --params the disk or the memory cannot hold, before minutes of building:
    one line naming --params, exit code 1 (as the other benchmarks' disk checks)."""
    params = parse_count(args.params)
    layers = max(1, round(params / (args.dim * args.dim)))
    n = layers * args.dim * args.dim
    size = 12 * n  # one checkpoint: master, exp_avg, exp_avg_sq in fp32
    need = (args.repeats + 1) * size  # the blocking saves and the background one
    where = existing_ancestor(args.path or os.getcwd())
    free = shutil.disk_usage(where).free
    if need > free:
        raise SystemExit(f"offload bench checkpoint: --params: {args.params!r} needs about "
                         f"{format_bytes(need)} of disk ({args.repeats + 1} checkpoints of "
                         f"{format_bytes(size)}), {where} has {format_bytes(free)} free; "
                         "lower --params or --repeats, or give --path on a bigger disk")
    check_memory("offload bench checkpoint", "--params", args.params, MEMORY_PER_PARAM * n)


def run(args) -> int:
    _check_room(args)
    with scratch_dir(args.path) as path:
        # the engines' swap directories (and --path's own, where this run makes it) are
        # removed again: the checkpoints and the dd file are removed by the run itself
        made = [missing_directories(os.path.join(path, name))
                for name in ["swap-a"] + [f"swap-b{i}" for i in range(args.repeats)]]
        try:
            result = run_checkpoint_bench(path, parse_count(args.params), args.dim,
                                          args.batch, args.accum, args.repeats,
                                          progress_printer(args.json))
        finally:
            for dirs in made:
                remove_directories(dirs)
    return emit(result, args.json, render)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench checkpoint", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
