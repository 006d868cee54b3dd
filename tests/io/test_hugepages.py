"""Huge pages for torch's large host allocations ([Note: huge pages]): importing
offload turns them on, opting out and turning them on too late are reported.
Each case runs in a fresh interpreter: torch reads the setting once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload.io import hugepages

ROOT = Path(__file__).resolve().parents[2]
KERNEL = hugepages.kernel_mode()
needs_thp = pytest.mark.skipif(KERNEL not in ("madvise", "always"),
                               reason=f"the kernel's transparent huge pages are {KERNEL}")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != hugepages.ENV}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _small_page() -> int:
    """The page an anonymous fault maps without huge pages: 4 KiB, or the smallest
    multi-size THP the kernel turns on for every mapping (`hugepages-<size>kB/enabled`
    set to always, or to inherit under a global always)."""
    root = Path("/sys/kernel/mm/transparent_hugepage")
    sizes = []
    for d in root.glob("hugepages-*kB"):
        try:
            mode = (d / "enabled").read_text()
        except OSError:
            continue
        if "[always]" in mode or ("[inherit]" in mode and KERNEL == "always"):
            sizes.append(int(d.name[len("hugepages-"):-2]) << 10)
    return min(sizes, default=4096)


SMALL_FAULTS = (64 << 20) // _small_page()  # faults of 64 MiB without huge pages

FAULTS = """
import torch
def faults():
    return int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[7])
f0 = faults()
for _ in range(4):
    t = torch.empty(64 << 20, dtype=torch.uint8); t.fill_(1); del t
print('faults', (faults() - f0) // 4)
"""


@needs_thp
def test_import_turns_huge_pages_on():
    r = _python("import os, offload\nfrom offload.io import hugepages\n"
                "print('env', os.environ['THP_MEM_ALLOC_ENABLE'])\n"
                "print('check', hugepages.check()[0])\n" + FAULTS)
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in r.stdout.split("\n") if line)
    assert out["env"] == "1" and out["check"] == "True"
    assert int(out["faults"]) < SMALL_FAULTS // 4  # 4 KiB pages would fault 16384 times


@needs_thp
def test_import_offload_alone_is_early_enough():
    """A script that imports offload, then makes its model's tensors, then calls
    `initialize` (which loads offload.io) still gets huge pages."""
    r = _python("import os, offload, torch\n" + FAULTS.replace("import torch\n", "")
                + "print('env', os.environ['THP_MEM_ALLOC_ENABLE'])\n")
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in r.stdout.split("\n") if line)
    assert out["env"] == "1"
    assert int(out["faults"]) < SMALL_FAULTS // 4


@pytest.mark.parametrize("value", ["0", "true"])  # torch takes only "1" as on
def test_opting_out_is_kept_and_reported(value):
    r = _python("import os, offload\nfrom offload.io import hugepages\n"
                "print(os.environ['THP_MEM_ALLOC_ENABLE'])\nprint(hugepages.check())\n" + FAULTS,
                THP_MEM_ALLOC_ENABLE=value)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == value
    if KERNEL != "always":  # with THP always, glibc's mappings get huge pages anyway
        assert f"THP_MEM_ALLOC_ENABLE='{value}'" in lines[1] and "False" in lines[1]
        assert int(lines[2].split()[1]) >= SMALL_FAULTS // 2


@needs_thp
def test_too_late_is_a_warning_that_names_the_fix(tmp_path):
    if KERNEL == "always":
        pytest.skip("THP always: huge pages without torch's help")
    # any allocation fixes torch's choice, however small
    cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "host"},
           "io": {"paths": [str(tmp_path)]}}  # not ./offload-swap in the working directory
    r = _python("import torch\nsmall = torch.zeros(10)\n"
                "import logging, offload\nlogging.basicConfig()\n"
                f"e = offload.initialize(torch.nn.Linear(64, 64), {cfg!r})\ne.close()\n")
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "import offload first" in r.stderr
    assert "THP_MEM_ALLOC_ENABLE=1" in r.stderr


def test_kernel_mode_reads_the_bracketed_word(tmp_path):
    p = tmp_path / "enabled"
    p.write_text("always [madvise] never\n")
    assert hugepages.kernel_mode(str(p)) == "madvise"
    p.write_text("[always] madvise never\n")
    assert hugepages.kernel_mode(str(p)) == "always"
    assert hugepages.kernel_mode(str(tmp_path / "missing")) == "unavailable"
