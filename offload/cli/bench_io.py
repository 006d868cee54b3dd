"""`offload bench io`: the engines against the disk's own reference, interleaved.

Each round writes then reads `size` bytes once with every configuration
(engine x block size x queue depth) and once with each reference tool (`dd`
with O_DIRECT, and `fio` with libaio when installed), in that interleaved
order (A B A B), so drift of the disk hits every row alike. Rows report the
median over rounds and the ratio to the best reference.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
from dataclasses import dataclass, field

from ..config import format_bytes
from ..io import AioEngine, BufferPool, ThreadEngine, libaio_status, probe_direct
from .args import (CommandParser, UsageError, byte_size, choice_list, directory, integer,
                   run_command, table_console, value_list)
from .benchutil import emit, progress_printer, scratch_dir

MiB = 1 << 20
ENGINES = ("aio", "threads")


@dataclass
class Row:
    engine: str
    block_size: int
    queue_depth: int
    write_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)


def _gbps(size: int, times: list[float]) -> float:
    return size / statistics.median(times) / 1e9 if times else float("nan")


def _dd(source: str, path: str, size: int, bs: int) -> tuple[float, float]:
    count = size // bs
    t = time.perf_counter()
    subprocess.run(["dd", f"if={source}", f"of={path}", f"bs={bs}", f"count={count}",
                    "oflag=direct", "conv=notrunc,fdatasync"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    w = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}",
                    "iflag=direct"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return w, time.perf_counter() - t


def _fio(path: str, size: int, bs: int, qd: int) -> tuple[float, float]:
    """fio with libaio; seconds from fio's own runtime (its write excludes the end fsync)."""
    res = []
    for rw in ("write", "read"):
        out = subprocess.run(
            ["fio", "--name=ref", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
             f"--size={size}", "--ioengine=libaio", "--direct=1", f"--iodepth={qd}",
             "--output-format=json"], check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0][rw]
        res.append(size / job["bw_bytes"])
    return res[0], res[1]


def run_io_bench(path: str, size: int = 2 << 30, *, engines: tuple[str, ...] = ("aio", "threads"),
                 block_sizes: tuple[int, ...] = (256 << 10, MiB, 4 * MiB),
                 queue_depths: tuple[int, ...] = (8, 32), repeat: int = 3,
                 progress=None) -> dict:
    """Runs the benchmark under directory `path`; returns the JSON-ready result."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--path: {path!r} exists and is not a directory; give a directory "
                         "on the disk to measure")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise UsageError(f"--engines: {','.join(engines)!r} names no engine or an unknown one "
                         f"({', '.join(unknown)}); give a comma list of {', '.join(ENGINES)}")
    if size < 4 * MiB or repeat < 1 or not block_sizes or not queue_depths:
        raise UsageError("--size must be at least 4MiB, --repeat at least 1, and "
                         "--block-sizes and --queue-depths non-empty")
    ok, why = probe_direct(path, "--path")
    if not ok:
        raise SystemExit(f"offload bench io: {why}; give --path on a disk-backed file system")
    free, need = shutil.disk_usage(path).free, 2 * size + (256 << 20)  # two files, a margin
    if free < need:
        raise SystemExit(f"offload bench io: --path: {path} has {format_bytes(free)} free, the "
                         f"benchmark needs {format_bytes(need)}; pass a smaller --size or give "
                         "--path on a disk with more free space")
    aio_ok, aio_why = libaio_status()
    if "aio" in engines and not aio_ok:
        print(f"note: skipping the aio engine: {aio_why}", file=sys.stderr)
        engines = tuple(e for e in engines if e != "aio")
    size = size // (4 * MiB) * (4 * MiB)
    rows = [Row(e, bs, qd) for e in engines for bs in block_sizes for qd in queue_depths]
    refs = {"dd bs=1M": [], "dd bs=4M": []}
    if shutil.which("fio"):
        refs["fio libaio bs=1M qd=32"] = []
    ref_times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in refs}
    ours = os.path.join(path, "offload-bench.dat")
    theirs = ours  # one file for all: the disk may treat files differently (host caching)
    source = os.path.join(path, "offload-bench-src.dat")
    pool = BufferPool(size, pin=None)
    buf = pool.alloc(size, tag="bench")
    # Everyone writes the same incompressible bytes: virtual disks often turn
    # all-zero writes into unmaps, which makes zeros both faster to write and
    # slower to read than real data. dd reads them from the page cache.
    buf.numpy()[:] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    try:
        with open(source, "wb") as f:
            f.write(buf.memoryview()[:size])
        fd = os.open(ours, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
        fd = os.open(ours, os.O_RDWR | os.O_DIRECT)
        for r in range(repeat):
            for name in refs:
                if name.startswith("dd"):
                    w, rd = _dd(source, theirs, size, 4 * MiB if "4M" in name else MiB)
                else:
                    w, rd = _fio(theirs, size, MiB, 32)
                ref_times[name][0].append(w)
                ref_times[name][1].append(rd)
                if progress:
                    progress(f"round {r + 1}/{repeat}: {name}  write {size / w / 1e9:.2f} GB/s"
                             f"  read {size / rd / 1e9:.2f} GB/s")
            for row in rows:
                cls = AioEngine if row.engine == "aio" else ThreadEngine
                kw = {} if row.engine == "aio" else {"threads": min(row.queue_depth, 16)}
                with cls(block_size=row.block_size, queue_depth=row.queue_depth,
                         sync_writes=True, direct=True, **kw) as eng:
                    t = time.perf_counter()
                    eng.write(fd, ours, 0, buf.address, size, keepalive=buf).wait()
                    row.write_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    eng.read(fd, ours, 0, buf.address, size, keepalive=buf).wait()
                    row.read_s.append(time.perf_counter() - t)
                if progress:
                    progress(f"round {r + 1}/{repeat}: {row.engine} bs={row.block_size >> 10}K "
                             f"qd={row.queue_depth}  write {size / row.write_s[-1] / 1e9:.2f} GB/s"
                             f"  read {size / row.read_s[-1] / 1e9:.2f} GB/s")
        os.close(fd)
    finally:
        buf.release()
        pool.close()
        for f in (ours, source):
            if os.path.exists(f):
                os.unlink(f)
    references = [{"tool": k, "write_GBps": _gbps(size, w), "read_GBps": _gbps(size, rd)}
                  for k, (w, rd) in ref_times.items()]
    best = best_reference(references)
    results = []
    for row in rows:
        w, rd = _gbps(size, row.write_s), _gbps(size, row.read_s)
        results.append({"engine": row.engine, "block_size": row.block_size,
                        "queue_depth": row.queue_depth, "write_GBps": w, "read_GBps": rd,
                        "write_ratio": w / best["write_GBps"], "read_ratio": rd / best["read_GBps"]})
    return {"benchmark": "io", "path": os.path.abspath(path), "size": size, "repeat": repeat,
            "sync_writes": True, "results": results, "reference": best, "references": references}


def render(result: dict) -> None:
    """Prints the result as a rich table."""
    from rich.table import Table

    con = table_console()
    t = Table(title=f"offload bench io: {format_bytes(result['size'])}, O_DIRECT, "
                    f"median of {result['repeat']} interleaved rounds, writes include fdatasync "
                    "(fio's: none)")
    for col in ("engine", "block", "qd", "write GB/s", "x ref", "read GB/s", "x ref"):
        t.add_column(col, justify="right" if col != "engine" else "left")
    for ref in result["references"]:
        t.add_row(ref["tool"], "", "", f"{ref['write_GBps']:.2f}", "", f"{ref['read_GBps']:.2f}",
                  "", style="dim")
    for r in result["results"]:
        t.add_row(r["engine"], f"{r['block_size'] >> 10}K", str(r["queue_depth"]),
                  f"{r['write_GBps']:.2f}", f"{r['write_ratio']:.2f}", f"{r['read_GBps']:.2f}",
                  f"{r['read_ratio']:.2f}")
    con.print(t)
    for engine in sorted({r["engine"] for r in result["results"]}):
        mine = [r for r in result["results"] if r["engine"] == engine]
        bw = max(mine, key=lambda r: r["write_GBps"])
        br = max(mine, key=lambda r: r["read_GBps"])
        con.print(f"{engine}: best write {bw['write_GBps']:.2f} GB/s ({bw['write_ratio']:.2f}x "
                  f"reference), best read {br['read_GBps']:.2f} GB/s ({br['read_ratio']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench io", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)


def add_arguments(p) -> None:
    p.add_argument("--path", default=None, type=directory("directory on the disk to measure"),
                   help="directory on the disk to measure "
                   "(default: a temporary directory under the current one)")
    p.add_argument("--size", default="2GiB", type=byte_size(4 * MiB, example="2GiB"),
                   help="bytes written and read per run, at least 4MiB (default 2GiB)")
    p.add_argument("--repeat", type=integer(1, example=3), default=3,
                   help="interleaved rounds (default 3)")
    p.add_argument("--engines", default="aio,threads", type=choice_list(ENGINES),
                   help="comma list of aio, threads (default both)")
    p.add_argument("--block-sizes", default="256KiB,1MiB,4MiB",
                   type=value_list(byte_size(4096, multiple=4096, example="1MiB")),
                   help="comma list of request sizes, multiples of 4KiB (default "
                   "256KiB,1MiB,4MiB)")
    p.add_argument("--queue-depths", default="8,32",
                   type=value_list(integer(1, 1024, example=32)),
                   help="comma list of requests in flight, 1..1024 (default 8,32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    with scratch_dir(args.path) as path:
        result = run_io_bench(path, args.size, engines=args.engines,
                              block_sizes=args.block_sizes, queue_depths=args.queue_depths,
                              repeat=args.repeat, progress=progress_printer(args.json))
    return emit(result, args.json, render)


def best_reference(references: list[dict]) -> dict:
    """The fastest reference tool in each direction (the ratios' denominators: the
    engine is held to the best the disk did for any tool, not the worst)."""
    return {"tool": "best of " + ", ".join(x["tool"] for x in references),
            "write_GBps": max(x["write_GBps"] for x in references),
            "read_GBps": max(x["read_GBps"] for x in references)}
