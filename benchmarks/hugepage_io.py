"""Direct I/O from a host buffer on 4 KiB pages against one on transparent huge pages.

The probe behind docs/benchmarks.md's "Huge-page buffers" table ([Note: huge-page
buffers] in offload/io/buffers.py). Two buffers of --size bytes (default 1 GiB)
live in one process:

* "4 KiB pages": an anonymous private mmap advised MADV_NOHUGEPAGE before anything
  touches it, so it stays on small pages whatever the kernel's THP mode;
* "huge pages": what `BufferPool` hands out for a buffer of 2 MiB or more (2 MiB
  aligned, advised MADV_HUGEPAGE; not pinned).

Both are filled with the same random bytes (virtual disks turn zero writes into
unmaps). One engine from `make_engine` (auto: Linux AIO with O_DIRECT where libaio
loads) with 4 MiB requests at queue depth 32, and one swap space from `open_swap`
in --dir (checksums off: the rates are the disk's and the buffer's, not xxh3's),
cut into extents of one request each. The swap file is written once, untimed,
before the first round, so no round pays for the file system's first write of
preallocated blocks. Then --rounds rounds (default 4), each timing the 4 KiB-page
buffer and then the huge-page one (A B A B), each through three phases:

* write: every extent from its slice of the buffer, all submitted at once (the
  engine keeps 32 in flight);
* read: every extent back into its slice;
* mixed: the first half of the extents read into the first half of the buffer
  while the second half of the buffer is written to the others, submitted
  alternately, so about as many reads as writes are in flight.

Rates are GB/s (1e9 bytes) of --size bytes moved per phase (mixed: read and
written together) over the phase's wall time, submission included. Requests per
GiB: the reads and writes the block layer completed (fields 1 and 5 of
/sys/block/<disk>/stat, the disk holding --dir, found from its st_dev; a
partition counts for its disk) during a buffer's phases of every round, per GiB
moved: on huge pages a 4 MiB request stays one request, where a request of
scattered small pages passes the queue's segment limit (max_segments) and is
split. Other I/O on the disk meanwhile is counted too. 'n/a' where the disk
cannot be found (an overlay, tmpfs or btrfs st_dev has no /sys/dev/block entry).
"On huge pages" is the share of the buffer /proc/self/smaps shows as
AnonHugePages after the run.

    python benchmarks/hugepage_io.py                 # 1 GiB, 4 rounds, under ./
    python benchmarks/hugepage_io.py --dir /nvme/x --rounds 6 --json

--dir is made if missing and removed again if this made it; without --dir a
temporary directory under the current one is used and removed. The swap files
are removed at the end either way.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from offload.cli.args import (byte_size, directory, integer, missing_directories,
                              remove_directories)
from offload.cli.benchutil import check_memory
from offload.config import IoConfig, format_bytes
from offload.io import BufferPool, hugepages, make_engine, open_swap, probe_direct

MiB, GiB = 1 << 20, 1 << 30
REQUEST = 4 * MiB
QUEUE_DEPTH = 32
KINDS = ("4 KiB pages", "huge pages")
PHASES = ("write", "read", "mixed")
PROG = "hugepage_io"


# -- the block device ------------------------------------------------------------------------
def disk_of(path: str) -> str | None:
    """The name of the disk under /sys/block that holds `path` (a partition's disk),
    or None where its st_dev has no block device in /sys."""
    dev = os.stat(path).st_dev
    node = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(node):
        return None
    real = os.path.realpath(node)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    name = os.path.basename(real)
    return name if os.path.exists(f"/sys/block/{name}/stat") else None


def requests_done(disk: str | None) -> int | None:
    """Reads plus writes the block layer has completed on `disk` (fields 1 and 5 of
    /sys/block/<disk>/stat), None without a disk."""
    if disk is None:
        return None
    with open(f"/sys/block/{disk}/stat") as f:
        fields = f.read().split()
    return int(fields[0]) + int(fields[4])


def queue_limit(disk: str | None, name: str) -> int | None:
    try:
        with open(f"/sys/block/{disk}/queue/{name}") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return None


# -- the buffers -----------------------------------------------------------------------------
def small_page_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous private mapping kept on 4 KiB pages (advised before first touch),
    and a uint8 tensor over it."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def fill_random(dst: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """Fills `dst` with random bytes, or copies `src` into it, in 64 MiB pieces."""
    rng = np.random.default_rng(0)
    out = dst.numpy()
    for off in range(0, out.size, 64 * MiB):
        end = min(out.size, off + 64 * MiB)
        out[off:end] = (src.numpy()[off:end] if src is not None
                        else rng.integers(0, 256, end - off, dtype=np.uint8))


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def huge_share(t: torch.Tensor) -> float:
    """The share of `t`'s bytes in mappings /proc/self/smaps shows as AnonHugePages."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    huge, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _VMA.match(line)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                inside = start < hi and end > lo
            elif inside and line.startswith("AnonHugePages:"):
                huge += int(line.split()[1]) * 1024
    return min(1.0, huge / t.numel())


# -- the phases ------------------------------------------------------------------------------
def timed(swap, ops: list[tuple[str, object, torch.Tensor]]) -> float:
    """Seconds to submit every (op, extent, slice) at once and wait for them all."""
    t = time.perf_counter()
    handles = [swap.write(ext, view, REQUEST) if op == "write" else swap.read(ext, view)
               for op, ext, view in ops]
    for h in handles:
        h.wait()
    return time.perf_counter() - t


def phase_ops(phase: str, extents: list, buf: torch.Tensor) -> list:
    views = [buf[i * REQUEST:(i + 1) * REQUEST] for i in range(len(extents))]
    if phase != "mixed":
        return [(phase, e, v) for e, v in zip(extents, views)]
    half = len(extents) // 2
    reads = [("read", e, v) for e, v in zip(extents[:half], views[:half])]
    writes = [("write", e, v) for e, v in zip(extents[half:], views[half:])]
    ops = []
    for k in range(max(len(reads), len(writes))):
        ops += reads[k:k + 1] + writes[k:k + 1]
    return ops


def measure(swap, extents: list, buffers: dict[str, torch.Tensor], disk: str | None,
            rounds: int, size: int, say) -> dict:
    """The rounds: each kind in turn (A B A B), each through write, read and mixed."""
    out = {k: {"GBps": {p: [] for p in PHASES}, "requests": {p: 0 for p in PHASES}}
           for k in KINDS}
    timed(swap, phase_ops("write", extents, buffers[KINDS[1]]))  # untimed first write
    for r in range(rounds):
        for kind in KINDS:
            for phase in PHASES:
                before = requests_done(disk)
                seconds = timed(swap, phase_ops(phase, extents, buffers[kind]))
                after = requests_done(disk)
                res = out[kind]
                res["GBps"][phase].append(size / seconds / 1e9)
                if before is not None:
                    res["requests"][phase] += after - before
                if say:
                    say(f"round {r + 1}/{rounds}: {kind:12s} {phase:5s} "
                        f"{size / seconds / 1e9:.2f} GB/s"
                        + (f", {after - before} requests" if before is not None else ""))
    moved_gib = rounds * len(PHASES) * size / GiB
    for kind in KINDS:
        res = out[kind]
        res["requests_per_GiB"] = (sum(res["requests"].values()) / moved_gib
                                   if disk is not None else None)
    return out


# -- the run ---------------------------------------------------------------------------------
def run(path: str, size: int, rounds: int, say=None) -> dict:
    """Runs the comparison with swap files in directory `path`; returns the JSON-ready
    result. Removes its swap files."""
    ok, why = probe_direct(path, "--dir")
    if not ok:
        raise SystemExit(f"{PROG}: {why}; give --dir on a disk-backed file system")
    free = shutil.disk_usage(path).free
    if free < size + 256 * MiB:
        raise SystemExit(f"{PROG}: --dir: {path} has {format_bytes(free)} free, the run "
                         f"needs {format_bytes(size + 256 * MiB)}; lower --size")
    cfg = IoConfig(paths=[path], block_size=REQUEST, queue_depth=QUEUE_DEPTH, checksum=False,
                   grow_step=size)
    disk = disk_of(path)
    engine = make_engine(cfg)
    pool = BufferPool(size, pin=False)
    huge = pool.alloc(size, tag="hugepage-io")
    swap = None
    try:
        if not engine.direct:
            raise SystemExit(f"{PROG}: the {engine.name} engine would not use O_DIRECT "
                             f"in {path}; give --dir on a disk-backed file system")
        _mapping, small = small_page_buffer(size)
        buffers = {KINDS[0]: small, KINDS[1]: huge.tensor[:size]}
        fill_random(buffers[KINDS[1]])
        fill_random(buffers[KINDS[0]], src=buffers[KINDS[1]])
        swap = open_swap(cfg, "hugepage-io", engine)
        extents = [swap.alloc(REQUEST) for _ in range(size // REQUEST)]
        result = measure(swap, extents, buffers, disk, rounds, size, say)
        for kind in KINDS:
            result[kind]["on_huge_pages"] = huge_share(buffers[kind])
    finally:
        if swap is not None:
            swap.close()
        huge.release()
        pool.close()
        engine.close()
    return {"benchmark": "hugepage_io", "dir": os.path.abspath(path), "disk": disk,
            "max_segments": queue_limit(disk, "max_segments"),
            "thp_mode": hugepages.kernel_mode(), "engine": engine.name, "direct": True,
            "size": size, "request": REQUEST, "queue_depth": QUEUE_DEPTH, "rounds": rounds,
            "order": list(KINDS), "buffers": result}


def render(res: dict) -> None:
    disk = res["disk"] or "n/a"
    print(f"{format_bytes(res['size'])} buffers, O_DIRECT through offload's {res['engine']} "
          f"engine, {format_bytes(res['request'])} requests at queue depth "
          f"{res['queue_depth']}, {res['rounds']} rounds alternating "
          f"{' / '.join(res['order'])}; disk {disk} (max_segments "
          f"{res['max_segments'] or 'n/a'}), THP mode {res['thp_mode']}")
    print("buffer | on huge pages | write GB/s | read GB/s | mixed GB/s | requests per GiB "
          "(write / read / mixed)")
    per_phase = res["rounds"] * res["size"] / GiB
    for kind, r in res["buffers"].items():
        rates = [", ".join(f"{x:.2f}" for x in r["GBps"][p]) for p in PHASES]
        if r["requests_per_GiB"] is None:
            reqs = "n/a"
        else:
            reqs = (f"{r['requests_per_GiB']:.0f} ("
                    + " / ".join(f"{r['requests'][p] / per_phase:.0f}" for p in PHASES) + ")")
        print(f"{kind} | {r['on_huge_pages']:.0%} | " + " | ".join(rates) + f" | {reqs}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=directory("directory for the swap file"), default=None,
                   help="directory on the disk to measure (default: a temporary directory "
                   "under the current one)")
    p.add_argument("--size", type=byte_size(2 * REQUEST, multiple=REQUEST, example="1GiB"),
                   default="1GiB", help="bytes of each buffer and of each phase's transfer, "
                   "a multiple of 4MiB (default 1GiB)")
    p.add_argument("--rounds", type=integer(1, example=4), default=4,
                   help="rounds, each timing both buffers (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args(argv)
    check_memory(PROG, "--size", str(a.size), 2 * a.size + 256 * MiB)
    say = None if a.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if a.dir is None:
        path = tempfile.mkdtemp(prefix=".offload-hugepage-io-", dir=os.getcwd())
        made = [path]
    else:
        path, made = a.dir, missing_directories(a.dir)
        os.makedirs(path, exist_ok=True)
    try:
        res = run(path, a.size, a.rounds, say)
    finally:
        remove_directories(made)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        render(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
