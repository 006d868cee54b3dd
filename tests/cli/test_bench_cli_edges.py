"""Tests of `offload bench ...` as a user meets it with unusual input: real processes,
real files. A user mistake or a condition of the machine is one line on stderr naming
the flag and the fix, no traceback; `--json` stdout parses; the directories a command
made for `--path` go again, also when it is stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
FILE_LIMIT = 1 << 20  # RLIMIT_FSIZE of runs whose disk writes must fail (no file grows past it)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _run(args: list[str], cwd: Path, timeout: int = 120,
         file_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
    return subprocess.run(OFFLOAD + args, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=_env(), preexec_fn=limit if file_limit else None)


def _last_line(err: str) -> str:
    """stderr's last line; a user-facing error has no traceback above it."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def _tree(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# -- --path directories the command made -----------------------------------------------------------

def test_bench_store_removes_the_path_directories_it_made(tmp_path):
    """--path names a directory that does not exist yet: the run makes it and removes it
    again (its own files are already removed); a directory the user had stays."""
    (tmp_path / "mine").mkdir()
    out = _run(["bench", "store", "--path", str(tmp_path / "mine" / "new" / "sub"),
                "--partitions", "1", "--size", "4KiB", "--rounds", "1", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["benchmark"] == "store"
    assert _tree(tmp_path) == ["mine"]


def test_bench_io_sigint_exits_130_and_leaves_nothing(tmp_path):
    """Ctrl-C in the middle of `bench io`: exit code 130, a short message, no traceback, and
    neither its data files nor the --path directories it made are left."""
    made = tmp_path / "made" / "sub"
    p = subprocess.Popen(OFFLOAD + ["bench", "io", "--path", str(made), "--size", "32MiB",
                                    "--repeat", "100", "--engines", "threads",
                                    "--block-sizes", "1MiB", "--queue-depths", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env=_env())
    try:
        deadline = time.monotonic() + 60
        while not (made / "offload-bench.dat").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
            time.sleep(0.05)
        time.sleep(0.3)  # inside its rounds
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert _last_line(err) == "interrupted"
    assert _tree(tmp_path) == []


@pytest.mark.slow  # 4 s (two ranks); scratch_dir is checked by default through bench store
def test_bench_comm_path_that_does_not_exist_yet(tmp_path):
    """--path passes its check (it can be created) but the run used it as if it existed:
    FileNotFoundError and a traceback."""
    out = _run(["bench", "comm", "--nproc", "1", "--size", "tiny", "--steps", "1",
                "--repeats", "1", "--batch", "2", "--path", str(tmp_path / "new" / "sub"),
                "--json"], tmp_path)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr
    assert [r["mode"] for r in json.loads(out.stdout)["rows"]] == ["serial", "overlap"]
    assert _tree(tmp_path) == []


# -- the disk refuses the writes ------------------------------------------------------------------

@pytest.mark.slow  # 7 s: bench adam runs its in-memory rows first
def test_bench_adam_nvme_write_failure_is_one_line(tmp_path):
    """--nvme on a disk that refuses the state's writes (full, quota, file-size limit):
    one line naming --nvme and the fix, exit code 1, not a SwapFullError traceback; the
    directories made for --nvme go again."""
    out = _run(["bench", "adam", "--elements", "256K", "--rounds", "1", "--nvme",
                str(tmp_path / "nv" / "sub"), "--json"], tmp_path, file_limit=FILE_LIMIT)
    assert out.returncode == 1, out.stderr[-3000:]
    line = _last_line(out.stderr)
    assert line.startswith("offload bench adam: --nvme:") and "ulimit -f" in line, line
    assert out.stdout == ""
    assert _tree(tmp_path) == []


@pytest.mark.slow  # 5 s; bench plan's rows run by default in test_bench_plan.py
def test_bench_plan_exit_code_when_a_configuration_failed(tmp_path):
    """Every configuration's run failed (its swap writes refused): the result is still
    printed, but the exit code is 1 and stderr names the configuration and its error,
    also with --json (where no progress lines are printed)."""
    out = _run(["bench", "plan", "--models", "mlp", "--placements", "params", "--fractions",
                "50", "--dtypes", "fp32", "--steps", "1", "--warmup", "1", "--probe-size",
                "1MiB", "--path", str(tmp_path / "p"), "--json"], tmp_path,
               file_limit=FILE_LIMIT)
    assert out.returncode == 1, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert "error" in res["results"][0]
    line = _last_line(out.stderr)
    assert line.startswith("offload bench plan: mlp params 50% fp32:") and "large" in line, line
    assert _tree(tmp_path) == []


# -- values the parser must refuse ----------------------------------------------------------------

def test_bench_oversized_probe_too_small_is_refused(tmp_path):
    """--probe 4KiB was accepted and the run died in the disk probe with ZeroDivisionError
    after building the model: refused while parsing instead."""
    out = _run(["bench", "oversized", "--probe", "4KiB", "--swap-dir", str(tmp_path / "s")],
               tmp_path, timeout=60)
    assert out.returncode == 2
    line = _last_line(out.stderr)
    assert line.startswith("offload bench oversized: --probe: '4KiB' is below 1.0 MiB"), line
    assert _tree(tmp_path) == []


def test_value_that_starts_with_a_dash_is_explained(tmp_path):
    """`--size -1MiB`: argparse takes '-1MiB' for a flag and said only 'expected one
    argument'; the line must say how to pass such a value."""
    out = _run(["bench", "io", "--size", "-1MiB"], tmp_path, timeout=60)
    assert out.returncode == 2
    line = _last_line(out.stderr)
    assert line.startswith("offload bench io: --size: expected one argument") and \
        "--size=VALUE" in line, line


def test_every_flag_with_a_default_names_it_in_its_help(tmp_path):
    """docs/cli.md: each command's `--help` gives every flag with its default. Some flags
    had one in code and none in their help (`checkpoint export --dtype`, `--shard-size`,
    `bench io --block-sizes`, ...): every flag that takes a value and has a default says
    "default" in its help, and the ones found missing print theirs in `--help`. Every
    command's `--help` prints its usage and exits 0 (one process: the parser is built as
    `offload <words> --help` builds it)."""
    script = (
        "import argparse, contextlib, io\n"
        "from offload.cli.main import BENCHES, COMMANDS, build_parser, main\n"
        "words = [[n] for n, _ in COMMANDS] + [['bench', n] for n, _ in BENCHES] + "
        "[['bench'], ['checkpoint', 'info'], ['checkpoint', 'export'], ['config']]\n"
        "for w in words:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main(w + ['--help'])\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (w, e.code)\n"
        "    assert buf.getvalue().startswith('usage: offload ' + ' '.join(w)), w\n"
        "    print('HELP', ' '.join(w) + ':', ' '.join(buf.getvalue().split()))\n"
        "    p = build_parser(w)\n"
        "    for word in w:\n"
        "        p = p._subparsers._group_actions[0].choices[word]\n"
        "    for a in p._actions:\n"
        "        if a.option_strings and a.nargs != 0 and a.default is not None:\n"
        "            print('FLAG', ' '.join(w), a.option_strings[-1], "
        "'default' in (a.help or ''))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    missing = [ln for ln in lines if ln.startswith("FLAG") and ln.endswith("False")]
    assert len([ln for ln in lines if ln.startswith("FLAG")]) > 50 and missing == [], missing
    helps = dict(ln[5:].split(": ", 1) for ln in lines if ln.startswith("HELP"))
    for words, text in [("checkpoint export", "(default saved)"),
                        ("checkpoint export", "(default 5GB)"),
                        ("bench io", "(default 256KiB,1MiB,4MiB)"),
                        ("bench io", "(default 8,32)"),
                        ("bench oversized", "(default auto)"),
                        ("bench oversized", "(default tuned)"),
                        ("bench adam", "(default 1048576)"),
                        ("bench adam", "(default fp32)"),
                        ("demo", "(default offload-demo.trace.json;")]:
        assert text in helps[words], (words, text, helps[words])
