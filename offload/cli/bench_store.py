"""`offload bench store`: the tiered store against the raw I/O layer, interleaved.

Each round moves N partitions host -> NVMe -> host twice: once through a
`TieredStore` (evict every partition to NVME, then fetch every one back to
HOST) and once through the raw I/O layer it is built on (the same engine
instance, the store's own `SwapSpace`, N buffers of the same size from a
`BufferPool`: write all, wait, read all, wait). Both use the same swap file
and, since each frees its extents before the other runs, the same byte
ranges of it: where a file lands on disk changes its speed (notably on
virtual disks), and this way it favours neither. The two alternate
(A B, then B A, ...), so drift of the disk and whatever the first run of a
round pays hit both alike. Both verify checksums on
read and, with io.sync_writes, fdatasync each write. Rows report the median
over rounds; the ratio store / raw is the store's overhead (target >= 0.9).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch

from ..config import IoConfig, OffloadConfig, StoreConfig, format_bytes
from ..io import BufferPool, make_engine, probe_direct
from .args import (CommandParser, UsageError, byte_size, directory, integer, run_command,
                   table_console)
from .benchutil import emit, progress_printer, scratch_dir

TARGET = 0.9


def _round_store(store, keys: list[str]) -> tuple[float, float]:
    t = time.perf_counter()
    for h in [store.evict(k, "NVME") for k in keys]:
        h.wait()
    w = time.perf_counter() - t
    t = time.perf_counter()
    for h in [store.fetch(k, "HOST") for k in keys]:
        h.wait()
    r = time.perf_counter() - t
    for k in keys:  # dirty again, so the next round writes; frees the extents (untimed)
        with store.modify(k, "HOST"):
            pass
    return w, r


def _round_raw(swap, bufs: list, size: int) -> tuple[float, float]:
    extents = [swap.alloc(size) for _ in bufs]
    t = time.perf_counter()
    for h in [swap.write(e, b, size) for e, b in zip(extents, bufs)]:
        h.wait()
    w = time.perf_counter() - t
    t = time.perf_counter()
    for h in [swap.read(e, b, size) for e, b in zip(extents, bufs)]:
        h.wait()
    r = time.perf_counter() - t
    for e in extents:
        swap.free(e)
    return w, r


def run_store_bench(path: str, partitions: int = 16, size: int = 64 << 20, rounds: int = 3,
                    engine: str = "auto", progress=None) -> dict:
    """Runs the benchmark under directory `path`; returns the JSON-ready result."""
    from ..store import TieredStore  # the CLI stays importable without loading the store

    if partitions < 1 or rounds < 1:
        raise UsageError("--partitions and --rounds must be at least 1")
    size = max(4096, size // 4096 * 4096)
    total = partitions * size
    ok, why = probe_direct(path, "--path")
    if not ok:
        raise SystemExit(f"offload bench store: {why}; give --path on a disk-backed file system")
    free, need = shutil.disk_usage(path).free, total + (512 << 20)  # the swap file, a margin
    if free < need:
        raise SystemExit(f"offload bench store: --path: {path} has {format_bytes(free)} free, "
                         f"the benchmark needs {format_bytes(need)}; lower --partitions/--size "
                         "or give --path on a disk with more free space")
    iocfg = IoConfig(paths=[path], engine=engine)
    eng = make_engine(iocfg)
    cfg = OffloadConfig(io=iocfg, store=StoreConfig(device="cpu", device_budget=4096,
                                                    host_budget=total, swap_kinds=["param"]))
    pool = BufferPool(total, pin=None)
    times = {"store": ([], []), "raw": ([], [])}
    store = None
    bufs = []
    try:
        store = TieredStore(cfg, engine=eng)
        swap = store.swap_space("param")
        keys = [f"p{i}" for i in range(partitions)]
        for i, k in enumerate(keys):
            store.put(k, torch.full((size,), i % 251, dtype=torch.uint8), tier="HOST")
            bufs.append(pool.alloc(size, tag="bench-raw"))
            bufs[-1].numpy()[:] = i % 251
        for r in range(rounds):  # A B, B A, ...: neither always runs first in a round
            for system in ("store", "raw") if r % 2 == 0 else ("raw", "store"):
                w, rd = _round_store(store, keys) if system == "store" else \
                    _round_raw(swap, bufs, size)
                times[system][0].append(w)
                times[system][1].append(rd)
                if progress:
                    progress(f"round {r + 1}/{rounds}: {system:5s} write {total / w / 1e9:.2f} "
                             f"GB/s  read {total / rd / 1e9:.2f} GB/s")
        summary = store.stats().summary()
    finally:
        if store is not None:
            store.close()
        for b in bufs:
            b.release()
        pool.close()
        eng.close()
    return {"benchmark": "store", "path": os.path.abspath(path), "engine": eng.name,
            "partitions": partitions, "partition_size": size, "rounds": rounds,
            "sync_writes": iocfg.sync_writes, "checksum": iocfg.checksum,
            **_rows(times, total), "target": TARGET, "store_stats": summary}


def _rows(times: dict[str, tuple[list[float], list[float]]], total: int) -> dict:
    """`results` rows (medians in GB/s) and the store / raw `ratios`."""
    results = [{"system": s, "write_GBps": total / statistics.median(w) / 1e9,
                "read_GBps": total / statistics.median(rd) / 1e9, "write_s": w, "read_s": rd}
               for s, (w, rd) in times.items()]
    store_row, raw_row = results
    return {"results": results,
            "ratios": {"write": store_row["write_GBps"] / raw_row["write_GBps"],
                       "read": store_row["read_GBps"] / raw_row["read_GBps"]}}


def render(result: dict) -> None:
    """Prints the result as a rich table."""
    from rich.table import Table

    con = table_console()
    n, size = result["partitions"], result["partition_size"]
    t = Table(title=f"offload bench store: {n} x {format_bytes(size)} host -> NVMe -> host, "
                    f"{result['engine']} engine, median of {result['rounds']} interleaved rounds")
    for col in ("system", "write GB/s", "read GB/s"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in result["results"]:
        t.add_row(r["system"], f"{r['write_GBps']:.2f}", f"{r['read_GBps']:.2f}")
    con.print(t)
    ratios = result["ratios"]
    verdict = "meets" if min(ratios.values()) >= result["target"] else "is below"
    con.print(f"store / raw: write {ratios['write']:.2f}x, read {ratios['read']:.2f}x "
              f"({verdict} the {result['target']}x target)")


def add_arguments(p) -> None:
    p.add_argument("--path", default=None, type=directory("directory on the disk to measure"),
                   help="directory on the disk to measure "
                   "(default: a temporary directory under the current one)")
    p.add_argument("--partitions", type=integer(1, example=16), default=16,
                   help="partitions moved per round (default 16)")
    p.add_argument("--size", default="64MiB", type=byte_size(4096, example="64MiB"),
                   help="bytes per partition, at least 4KiB (default 64MiB)")
    p.add_argument("--rounds", type=integer(1, example=3), default=3,
                   help="interleaved rounds (default 3)")
    p.add_argument("--engine", default="auto", choices=("auto", "aio", "threads"),
                   help="I/O engine of both systems (default auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    with scratch_dir(args.path) as path:
        result = run_store_bench(path, args.partitions, args.size, args.rounds, args.engine,
                                 progress_printer(args.json))
    return emit(result, args.json, render)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="offload bench store", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_command(run, p.parse_args(argv), p.prog)
