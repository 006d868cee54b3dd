"""offload inside containers: memory and CPU limits come from the process's cgroups,
not from the host's /proc/meminfo and os.cpu_count() ([Note: container memory limits]
in offload/io/process.py).

The layout tests write files laid out like cgroupfs (and a /proc/self with its
`cgroup` and `mountinfo`) into a tmp dir; the others move a child process into a real
cgroup of this machine and skip, with the reason, where cgroups cannot be made."""

import os
import subprocess
import sys
import uuid

import pytest

from offload.io.process import available_memory, cgroup_memory, physical_memory, usable_cpus

MiB = 1 << 20
PY = sys.executable


def _proc(tmp_path, cgroup_lines, mount_lines):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mount_lines))
    return str(proc)


def _write(d, **files):
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def test_v2_limit_is_the_tightest_over_the_cgroup_and_its_parents(tmp_path):
    """cgroup v2 in a container with a cgroup namespace: the limit of the parent (a pod)
    binds before the container's own, file cache (active and inactive: reclaimed before
    the OOM killer runs) counts as free, and memory.high (throttling, no kill) is no
    limit."""
    cg = tmp_path / "cg"
    proc = _proc(tmp_path, ["0::/pod/box"],
                 [f"41 31 0:38 / {cg} rw,relatime - cgroup2 cgroup2 rw"])
    _write(cg / "pod", memory_max=str(800 * MiB), memory_current=str(700 * MiB))
    _write(cg / "pod" / "box", memory_max=str(1024 * MiB), memory_high="max",
           memory_current=str(600 * MiB), memory_stat=f"anon 1\ninactive_file {100 * MiB}")
    got = cgroup_memory(proc)
    assert got is not None and (got.limit, got.free) == (800 * MiB, 100 * MiB), got
    assert got.file == str(cg / "pod" / "memory.max")
    assert available_memory(proc) == 100 * MiB
    assert physical_memory(proc) == 800 * MiB
    # the box binds: 650 MiB used, 150 MiB of it file cache (a dataset read each epoch)
    _write(cg / "pod", memory_current=str(600 * MiB))
    _write(cg / "pod" / "box", memory_max=str(600 * MiB), memory_current=str(650 * MiB),
           memory_stat=f"anon 1\ninactive_file {100 * MiB}\nactive_file {50 * MiB}")
    got = cgroup_memory(proc)
    assert (got.limit, got.free) == (600 * MiB, 100 * MiB), got
    _write(cg / "pod" / "box", memory_high=str(550 * MiB))  # throttled above 550 MiB
    assert cgroup_memory(proc).free == 100 * MiB


def test_mount_points_of_any_bytes_and_odd_tables_fall_back_not_raise(tmp_path):
    """mountinfo escapes only space, tab, newline and backslash: a USB stick mounted
    under a Latin-1 name puts raw non-UTF-8 bytes there, which made every memory and
    CPU query raise UnicodeDecodeError (initialize and saves with it). Such a line is
    read as the file system's name; a table that cannot be parsed means no limit."""
    cg = tmp_path / "cg"
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/pod\n")
    (proc / "mountinfo").write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        b"40 22 8:17 / /media/usb-\xe9t\xe9 rw,relatime shared:20 - vfat /dev/sdb1 rw\n"
        + f"30 22 0:26 / {cg} rw,nosuid shared:9 - cgroup2 cgroup2 rw\n".encode())
    _write(cg / "pod", memory_max=str(1024 * MiB), memory_current=str(100 * MiB))
    assert cgroup_memory(str(proc)).limit == 1024 * MiB
    assert usable_cpus(str(proc)) >= 1
    (proc / "cgroup").write_bytes(b"\xff\xfe:::\n0::" + b"/" * 5 + b"\x00\n")
    assert physical_memory(str(proc)) is not None
    assert usable_cpus(str(proc)) >= 1


def test_v2_without_a_limit_leaves_meminfo(tmp_path):
    cg = tmp_path / "cg"
    proc = _proc(tmp_path, ["0::/"], [f"41 31 0:38 / {cg} rw - cgroup2 cgroup2 rw"])
    _write(cg, memory_max="max", memory_current=str(600 * MiB))
    assert cgroup_memory(proc) is None
    assert available_memory(proc) == available_memory("/nonexistent")
    assert physical_memory(proc) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_v1_limit_without_a_cgroup_namespace(tmp_path):
    """cgroup v1 as Docker mounts it without a namespace: /proc/self/cgroup names
    /docker/<id>, which is the root of the memory mount; the v1 "no limit" value is no
    limit."""
    mem, cpu = tmp_path / "memory", tmp_path / "cpu"
    proc = _proc(tmp_path, ["4:memory:/docker/abc", "1:cpu,cpuacct:/docker/abc", "0::/"],
                 [f"35 31 0:32 /docker/abc {mem} rw - cgroup cgroup rw,memory",
                  f"32 31 0:29 /docker/abc {cpu} rw - cgroup cgroup rw,cpu,cpuacct"])
    _write(mem, memory_limit_in_bytes=str(512 * MiB), memory_usage_in_bytes=str(300 * MiB),
           memory_stat=f"cache 1\ntotal_inactive_file {100 * MiB}")
    got = cgroup_memory(proc)
    assert got is not None and (got.limit, got.free) == (512 * MiB, 312 * MiB), got
    assert got.file == str(mem / "memory.limit_in_bytes")
    _write(mem, memory_limit_in_bytes="9223372036854771712")
    assert cgroup_memory(proc) is None


def test_cpu_quota_lowers_the_thread_count(tmp_path):
    """Docker --cpus=1.5 (v2 cpu.max, v1 cpu.cfs_quota_us) gives 2 threads at most; no
    quota leaves the affinity mask."""
    cg = tmp_path / "cg"
    proc = _proc(tmp_path, ["0::/box"], [f"41 31 0:38 / {cg} rw - cgroup2 cgroup2 rw"])
    mine = len(os.sched_getaffinity(0))
    _write(cg / "box", cpu_max="max 100000")
    assert usable_cpus(proc) == mine
    _write(cg / "box", cpu_max="50000 100000")
    assert usable_cpus(proc) == 1
    _write(cg / "box", cpu_max="150000 100000")
    assert usable_cpus(proc) == min(mine, 2)


# -- real cgroups and affinity ---------------------------------------------------------


def _v1_root(controller):
    root = f"/sys/fs/cgroup/{controller}"
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    return root


@pytest.fixture
def memory_cgroup():
    """A real v1 memory cgroup (limit written by the test), removed after."""
    root = _v1_root("memory")
    if root is None or not os.path.exists(f"{root}/memory.limit_in_bytes"):
        pytest.skip("no writable cgroup v1 memory hierarchy here (needs root and "
                    "/sys/fs/cgroup/memory); the layout tests above cover the reading")
    d = f"{root}/offload-test-{uuid.uuid4().hex[:8]}"
    try:
        os.mkdir(d)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup: {e}")
    yield d
    for _ in range(50):  # the child has exited; its cgroup empties a moment later
        try:
            os.rmdir(d)
            break
        except OSError:
            import time
            time.sleep(0.1)


def _run_in(cgroup, code, *args, timeout=60):
    def enter():
        with open(f"{cgroup}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    return subprocess.run([PY, "-c", code, *args], preexec_fn=enter, capture_output=True,
                          text=True, timeout=timeout)


def test_bench_adam_refuses_more_than_the_cgroup_limit(memory_cgroup):
    """`offload bench adam` in a container whose memory limit is below what --elements
    needs (and the host's MemAvailable above it) exits with one line naming the flag and
    the cgroup's limit file, instead of being ended by the cgroup's OOM killer."""
    with open(f"{memory_cgroup}/memory.limit_in_bytes", "w") as f:
        f.write(str(512 * MiB))
    need = 768 * MiB
    if (available_memory() or 0) < 2 * need:
        pytest.skip("this machine has too little memory free to tell the limits apart")
    elements = need // 56  # MEMORY_PER_ELEM in offload/cli/bench_adam.py
    got = _run_in(memory_cgroup, "import sys; from offload.cli.main import main; "
                  "sys.exit(main(sys.argv[1:]))", "bench", "adam", "--elements",
                  str(elements), timeout=120)
    assert got.returncode == 1, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    assert "--elements" in got.stderr and f"{memory_cgroup}/memory.limit_in_bytes" \
        in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


def test_tune_refuses_a_host_budget_beyond_the_cgroup_limit(memory_cgroup):
    """`offload tune --host-budget` beyond a container's memory limit (below the host's
    memory) is refused naming the flag and the limit's file."""
    with open(f"{memory_cgroup}/memory.limit_in_bytes", "w") as f:
        f.write(str(1024 * MiB))
    code = ("from offload.cli.tune import check_memory_budgets\n"
            "from offload.planner.search import Budgets\n"
            "check_memory_budgets(Budgets(2 << 30, 1 << 28), 'cuda')\n")
    got = _run_in(memory_cgroup, code)
    assert got.returncode != 0, got.stdout
    last = got.stderr.strip().splitlines()[-1]
    assert "UsageError" in last and "--host-budget" in last and \
        f"{memory_cgroup}/memory.limit_in_bytes" in last, got.stderr[-2000:]


STATE_DICT = """
import sys
import offload
import torch
from torch import nn
tmp, cgroup = sys.argv[1], sys.argv[2]
width, layers = 512, 64  # 64 MiB of fp32 weights
cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme",
                  "group_size": width * width},
       "io": {"paths": [tmp], "buffer_budget": "8MiB", "grow_step": "4MiB"},
       "store": {"host_budget": "8MiB", "device_budget": "8MiB", "device": "cpu"}}
engine = offload.initialize(
    lambda: nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))), cfg)
with open(cgroup + "/memory.limit_in_bytes", "w") as f:
    f.write(str(48 << 20))
with open(cgroup + "/cgroup.procs", "w") as f:  # from here on, 48 MiB for new memory
    f.write(str(__import__("os").getpid()))
try:
    engine.state_dict()
    print("returned")
except MemoryError as e:
    print("MemoryError:", e)
engine.close()
"""


def test_state_dict_refuses_a_model_beyond_the_cgroup_limit(memory_cgroup, tmp_path):
    """`engine.state_dict()` in a cgroup that leaves less memory than the model's weights
    raises MemoryError naming the streaming calls and the limit's file, where gathering
    ends with the cgroup's OOM killer (SIGKILL)."""
    got = subprocess.run([PY, "-c", STATE_DICT, str(tmp_path), memory_cgroup],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    assert got.stdout.startswith("MemoryError:"), got.stdout
    assert "named_weights" in got.stdout and "memory.limit_in_bytes" in got.stdout


INITIALIZE = """
import sys
import offload
import torch
from torch import nn
tmp, cgroup = sys.argv[1], sys.argv[2]
width, layers = 1024, 16  # 64 MiB of fp32 weights, 128 MiB of Adam moments
cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "host",
                  "group_size": width * width},
       "io": {"paths": [tmp], "buffer_budget": "8MiB", "grow_step": "4MiB"},
       "store": {"host_budget": "512MiB", "device_budget": "8MiB", "device": "cpu"}}
with open(cgroup + "/memory.limit_in_bytes", "w") as f:
    f.write(str(128 << 20))
with open(cgroup + "/cgroup.procs", "w") as f:  # from here on, 128 MiB for new memory
    f.write(str(__import__("os").getpid()))
try:
    offload.initialize(
        lambda: nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))), cfg)
    print("returned")
except offload.ConfigError as e:
    print("ConfigError:", e)
"""


def test_initialize_refuses_state_in_memory_beyond_the_cgroup_limit(memory_cgroup, tmp_path):
    """A placement that keeps 192 MiB of training state in memory (host optimizer
    state, host parameters under a larger host budget) in a cgroup that leaves 128
    MiB: initialize raises ConfigError naming the keys and the limit's file before
    anything is placed, where placing it ended with the cgroup's OOM killer."""
    got = subprocess.run([PY, "-c", INITIALIZE, str(tmp_path), memory_cgroup],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    assert got.stdout.startswith("ConfigError:"), got.stdout
    for key in ("engine.optimizer", "store.host_budget", "memory.limit_in_bytes"):
        assert key in got.stdout, got.stdout
    assert not list(tmp_path.iterdir())  # no swap file made


# offload/io/process.py alone (it imports nothing of offload's), without torch's import
COUNT = ("import importlib.util, os, sys\n"
         "spec = importlib.util.spec_from_file_location('process', sys.argv[1])\n"
         "process = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(process)\n"
         "print(os.cpu_count(), process.usable_cpus())\n")
PROCESS_PY = os.path.join(os.path.dirname(__file__), "..", "..", "offload", "io", "process.py")


def test_threads_follow_the_affinity_mask():
    """Under taskset (a cpuset), the thread counts offload picks follow the CPUs the
    process may run on, not the machine's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: a mask cannot lower it")
    got = subprocess.run([PY, "-c", COUNT, PROCESS_PY], capture_output=True, text=True, timeout=30,
                         preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert got.stdout.split()[1] == "1", got


def test_threads_follow_a_real_cpu_quota():
    """In a cgroup with a quota of one CPU (docker --cpus=1), usable_cpus is 1."""
    root = _v1_root("cpu")
    if root is None or not os.path.exists(f"{root}/cpu.cfs_quota_us"):
        pytest.skip("no writable cgroup v1 cpu hierarchy here; "
                    "test_cpu_quota_lowers_the_thread_count covers the reading")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: a quota of one cannot lower it")
    d = f"{root}/offload-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    try:
        with open(f"{d}/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        with open(f"{d}/cpu.cfs_quota_us", "w") as f:
            f.write("100000")
        got = _run_in(d, COUNT, PROCESS_PY)
        assert got.stdout.split() == [str(os.cpu_count()), "1"], got
        # the optimizer's update threads: torch's own count ignores the quota
        got = _run_in(d, "import torch; from offload.optim.blocks import BlockUpdater; "
                         "print(torch.get_num_threads(), BlockUpdater().threads)")
        assert got.stdout.split() == [str(len(os.sched_getaffinity(0))), "1"], got
    finally:
        os.rmdir(d)
