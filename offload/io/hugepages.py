"""Transparent huge pages for torch's large host allocations.

[Note: huge pages]
A training step allocates and frees host tensors of tens of MB over and
over: autograd's weight gradients, each group's flat gradient, the update's
temporaries. glibc serves every allocation that large from a fresh mmap and
unmaps it on free, so each step touches that memory for the first time again:
with 4 KiB pages a 64 MiB tensor costs 16384 page faults, and the 6-layer
4096-wide MLP of `offload bench step` took about 197 thousand faults per step,
0.1 to 0.2 s of a 0.5 s step on two cores. torch backs CPU allocations of
2 MiB and more with transparent huge pages (madvise MADV_HUGEPAGE) when the
environment variable THP_MEM_ALLOC_ENABLE is set: the fault count drops about
30-fold and resident memory stays the same.

torch reads the variable once, at its first CPU allocation (of any size),
and turns huge pages on only for the value "1". So importing offload sets it
to 1 (offload/__init__.py, which loads no torch) unless the environment
already names a value (any other value opts out), and `check()` reports at
`initialize()` when it did not take effect: a process that made a tensor
before importing offload. The kernel must allow
THP (`madvise` or `always` in /sys/kernel/mm/transparent_hugepage/enabled);
with `always` glibc's mappings get huge pages without torch's help.
"""

from __future__ import annotations

import os

ENV = "THP_MEM_ALLOC_ENABLE"
_SYS = "/sys/kernel/mm/transparent_hugepage/enabled"


def opted_out() -> bool:
    """True where the environment keeps torch's huge pages off (torch turns them on
    only for "1")."""
    return os.environ.get(ENV, "1").strip() != "1"


def kernel_mode(path: str = _SYS) -> str:
    """The kernel's THP mode: "always", "madvise", "never", or "unavailable"."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def torch_uses_huge_pages(nbytes: int = 32 << 20) -> bool:
    """True when a fresh `nbytes` host tensor faults in at most a quarter of the
    4 KiB pages it spans (huge pages: about one fault per 2 MiB)."""
    import torch

    try:
        before = _minor_faults()
    except (OSError, IndexError, ValueError):  # no procfs: cannot tell
        return False
    probe = torch.empty(nbytes, dtype=torch.uint8)
    probe.fill_(1)
    faults = _minor_faults() - before
    del probe
    return faults <= nbytes // 4096 // 4


def check() -> tuple[bool, str]:
    """(large host allocations get huge pages, why), for a log line."""
    mode = kernel_mode()
    if mode in ("never", "unavailable"):
        return False, (f"the kernel's transparent huge pages are {mode} ({_SYS}): large host "
                       "tensors fault in 4 KiB pages")
    if torch_uses_huge_pages():
        return True, f"torch allocates large host tensors on huge pages (THP {mode})"
    if mode == "always":
        return True, "the kernel backs large host mappings with huge pages (THP always)"
    if opted_out():
        return False, (f"{ENV}={os.environ[ENV]!r} (torch turns huge pages on only for '1'): "
                       "large host tensors fault in 4 KiB pages; unset it to let offload "
                       "turn them on")
    return False, (f"torch allocated a tensor before offload was imported, so it does not "
                   f"use huge pages ({ENV} is read once, at torch's first allocation): import "
                   f"offload first or start the process with {ENV}=1; each step pays a page "
                   "fault per 4 KiB of the host tensors it allocates")
