"""`offload demo`: the main job on an embedded default.

Until the engine lands, the demo measures what every later stage rests on:
the NVMe I/O layer against the disk's own reference (`offload bench io`) on a
temporary directory under the current one (or `--path`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from . import bench_io


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default=None, help="directory for the temporary files "
                   "(default: a temporary directory under the current one)")
    p.add_argument("--size", default="1GiB", help="bytes per transfer (default 1GiB)")
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds (default 2)")


def run(args: argparse.Namespace) -> int:
    print("offload demo: measuring the NVMe I/O layer (Linux AIO and thread engines) "
          f"against dd/fio with O_DIRECT, {args.size} per transfer, {args.repeat} rounds.")
    base = args.path or os.getcwd()
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".offload-demo-", dir=base)
    try:
        ns = argparse.Namespace(path=tmp, size=args.size, repeat=args.repeat,
                                engines="aio,threads", block_sizes="1MiB,4MiB",
                                queue_depths="8,32", json=False)
        return bench_io.run(ns)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
