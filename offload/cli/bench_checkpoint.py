"""`offload bench checkpoint`: saving and resuming a training state against the disk.

Builds a model of `--params` fp32 parameters (square Linear layers of `--dim`),
host placement, and takes one step so every tensor kind holds real values.
Then, in one run on one directory:
  * reference: dd with O_DIRECT writes (with fdatasync) and reads a file of
    the checkpoint's size, before and after the checkpoint runs (the faster
    of the two is the reference, so the ratios are not flattered);
  * save: `engine.save_checkpoint` (blocking), bytes of tensors / seconds,
    the fsyncs and the publishing rename included;
  * load: the page cache of the checkpoint's files is dropped
    (posix_fadvise DONTNEED after their fsync), then `offload.initialize(...,
    resume=)` on a meta model: seconds until the engine is ready;
  * background: `save_checkpoint(blocking=False)` and training steps until it
    is published; the seconds the steps waited for it (its stall) against
    its duration, and how long those steps took against one without a save
    (the save shares the CPU with them).
Targets: save and load >= 0.8x the reference; stall <= 10% of the save.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from ..config import format_bytes
from .args import CommandParser, count, directory, integer, parse_count, run_command
from .benchutil import emit, progress_printer, scratch_dir, vm_hwm

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


def _dd(path: str, size: int, bs: int = 4 << 20) -> tuple[float, float]:
    """(write, read) GB/s of dd with O_DIRECT over a file of `size` bytes."""
    n = max(1, size // bs)
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={n}",
                    "oflag=direct", "conv=fdatasync"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    w = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={n}",
                    "iflag=direct"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = time.perf_counter() - t
    os.unlink(path)
    return n * bs / w / 1e9, n * bs / r / 1e9


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
                         accum: int = 1, progress=None) -> dict:
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
    try:
        _step(engine, x, accum)
        size = 12 * layers * dim * dim  # fp32: param (the master), exp_avg, exp_avg_sq
        say(f"reference: dd O_DIRECT over {format_bytes(size)}")
        ref = [_dd(os.path.join(path, "dd.ref"), size)]
        say("save (blocking)")
        t = time.perf_counter()
        engine.save_checkpoint(ck / "a")
        save_s = time.perf_counter() - t
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
    say("load (resume, page cache dropped)")
    _drop_cache(ck / "a")
    t = time.perf_counter()
    resumed = offload.initialize(lambda: _Stack(dim, layers), _config(path, "swap-b"),
                                 resume=ck / "a")
    load_s = time.perf_counter() - t
    resumed.close()
    ref.append(_dd(os.path.join(path, "dd.ref"), size))
    shutil.rmtree(ck, ignore_errors=True)
    ref_w, ref_r = max(r[0] for r in ref), max(r[1] for r in ref)
    save_gbps, load_gbps = size / save_s / 1e9, size / load_s / 1e9
    return {
        "bytes": size, "parameters": layers * dim * dim, "layers": layers, "dim": dim,
        "reference": {"write_GBps": ref_w, "read_GBps": ref_r, "runs": ref},
        "save": {"seconds": save_s, "GBps": save_gbps, "ratio": save_gbps / ref_w},
        "load": {"seconds": load_s, "GBps": load_gbps, "ratio": load_gbps / ref_r},
        "background": {"seconds": saving.seconds, "stalled": saving.stalled,
                       "stall_share": saving.stalled / saving.seconds,
                       "steps_during": steps, "step_seconds": step_s,
                       "step_seconds_during": during_s},
        "peak_rss": vm_hwm(),
        "targets": {"rate": TARGET_RATE, "stall_share": TARGET_STALL},
        "pass": (save_gbps / ref_w >= TARGET_RATE and load_gbps / ref_r >= TARGET_RATE
                 and saving.stalled / saving.seconds <= TARGET_STALL),
    }


def render(r: dict) -> None:
    print(f"checkpoint of {format_bytes(r['bytes'])} ({r['parameters']:,} fp32 parameters)")
    print(f"  reference (dd O_DIRECT): write {r['reference']['write_GBps']:.2f} GB/s, "
          f"read {r['reference']['read_GBps']:.2f} GB/s")
    for k in ("save", "load"):
        print(f"  {k}: {r[k]['seconds']:.2f} s, {r[k]['GBps']:.2f} GB/s, "
              f"{r[k]['ratio']:.2f}x the reference (target >= {TARGET_RATE})")
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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    with scratch_dir(args.path) as path:
        result = run_checkpoint_bench(path, parse_count(args.params), args.dim, args.batch,
                                      args.accum, progress_printer(args.json))
    return emit(result, args.json, render)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench checkpoint", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
