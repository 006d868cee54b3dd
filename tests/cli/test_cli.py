"""The `offload` command as a user runs it (real processes, real files)."""

import json
import os
import subprocess
import sys

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]


def test_bench_io_json_schema(tmp_path):
    out = subprocess.run(OFFLOAD + ["bench", "io", "--path", str(tmp_path), "--size", "8MiB",
                                    "--repeat", "1", "--block-sizes", "1MiB",
                                    "--queue-depths", "4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert {r["engine"] for r in res["results"]} <= {"aio", "threads"}
    for r in res["results"]:
        assert set(r) >= {"engine", "block_size", "queue_depth", "write_GBps", "read_GBps"}
        assert r["write_GBps"] > 0 and r["read_GBps"] > 0
    assert res["reference"]["write_GBps"] > 0 and res["reference"]["read_GBps"] > 0
    assert os.listdir(tmp_path) == []  # its files are gone


def test_bench_io_table(tmp_path):
    out = subprocess.run(OFFLOAD + ["bench", "io", "--path", str(tmp_path), "--size", "8MiB",
                                    "--repeat", "1", "--engines", "threads",
                                    "--block-sizes", "1MiB", "--queue-depths", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "GB/s" in out.stdout and "threads: best write" in out.stdout


def test_config_command_lists_keys():
    out = subprocess.run(OFFLOAD + ["config"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "io.block_size" in out.stdout


def test_bad_bench_path_is_clear(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    out = subprocess.run(OFFLOAD + ["bench", "io", "--path", str(f), "--size", "8MiB"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == (
        f"offload bench io: --path: '{f}' exists and is not a directory; give a writable "
        "directory on the disk to measure\n")


def test_sigterm_stops_a_command_and_its_files_go(tmp_path):
    """SIGTERM (what `kill`, a scheduler or torchrun sends) ends a command through its
    cleanup: `bench io`'s data files are removed and it exits 143, where the default
    action would end the process and leave them."""
    import signal
    import time
    p = subprocess.Popen(OFFLOAD + ["bench", "io", "--path", str(tmp_path), "--size", "64MiB",
                                    "--repeat", "50", "--engines", "threads",
                                    "--block-sizes", "1MiB", "--queue-depths", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "offload-bench.dat").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)  # inside its rounds of reads and writes
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        p.kill()
        p.wait()
    assert os.listdir(tmp_path) == []


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`offload ... | head`: stdout's reader closes the pipe; the command stops with
    the shell's code for SIGPIPE (141) and no traceback. The reader leaves before the
    command writes (its imports take far longer): one that read first could leave
    after the command had written all of its output into the pipe and ended."""
    p = subprocess.Popen(OFFLOAD + ["config", "--markdown"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "Error" not in err, err


def test_tables_piped_to_another_program_are_not_cut_to_80_columns():
    """A command's table read through a pipe (not a terminal): rich's default of 80
    columns wrapped it and cut cells to '...' (offload tune's table)."""
    code = ("from rich.table import Table\n"
            "from offload.cli.args import table_console\n"
            "t = Table()\n"
            "for i in range(9):\n"
            "    t.add_column(f'column {i}')\n"
            "t.add_row(*[f'value {i} x' for i in range(9)])\n"
            "table_console().print(t)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "\u2026" not in out.stdout and "value 8 x" in out.stdout, out.stdout
    out = subprocess.run(OFFLOAD + ["config"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "engine.initial_loss_scale " in out.stdout, out.stderr
    assert "\u2026" not in out.stdout, out.stdout


def test_config_checks_a_file_and_prints_its_values(tmp_path, offload_cli):
    """docs/configuration.md says the CLI takes a configuration file; no command did, so
    a file could be checked only by starting a run."""
    good = tmp_path / "c.toml"
    good.write_text('[engine]\nparams = "nvme"\n[optim]\nlr = 3e-4\n'
                    'param_groups = [{params = ["*.bias"], weight_decay = 0.0}]\n')
    rc, out, err = offload_cli(["config", str(good), "--markdown"])
    assert rc == 0, err
    rows = {ln.split("|")[1].strip(" `"): ln.split("|")[2].strip() for ln in out.splitlines()
            if ln.startswith("| `")}
    assert rows["engine.params"] == "`nvme *`" and rows["optim.lr"] == "`0.0003 *`"
    assert rows["optim.param_groups"] == '`[{"params": ["*.bias"], "weight_decay": 0.0}] *`'
    assert rows["engine.grads"] == "`host`"  # the default, unmarked
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\neps = 1e-50\n")
    rc, out, err = offload_cli(["config", str(bad)])
    assert rc == 2 and out == "", err
    assert err == f"offload config: {bad}: optim.eps: 1e-50 must be positive in fp32 (it " \
                  f"rounds to 0 there), e.g. 1e-8\n", err


def _table_rows(text: str) -> dict[str, tuple[str, str]]:
    """key -> (value, meaning) of a rich table's rows, each cell's wrapped lines joined."""
    rows: dict[str, list[list[str]]] = {}
    last = None
    for line in text.splitlines():
        cells = line.split("\u2502")[1:4]
        if len(cells) != 3:
            continue
        if cells[0].strip():
            last = cells[0].strip()
            rows[last] = [[], []]
        for part, cell in zip(rows[last], cells[1:]):
            part.append(cell)
    return {k: tuple(" ".join(" ".join(p).split()) for p in v) for k, v in rows.items()}


def _markdown_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            key, value, doc = line[2:-2].split(" | ", 2)
            rows[key.strip("`")] = (value.strip("`"), " ".join(doc.split()))
    return rows


def test_config_table_prints_the_markdown_text(tmp_path):
    """`offload config`'s table said "{params = , lr, ...}" for optim.param_groups: rich
    read "[names or patterns]" in the meaning as markup and dropped it. Every cell of
    the table is the --markdown output's text, with and without a file."""
    f = tmp_path / "c.toml"
    f.write_text('[optim]\nparam_groups = [{params = ["*.bias"], weight_decay = 0.0}]\n')
    for extra in ([], [str(f)]):
        table = subprocess.run(OFFLOAD + ["config"] + extra, capture_output=True, text=True,
                               timeout=120)
        md = subprocess.run(OFFLOAD + ["config", "--markdown"] + extra, capture_output=True,
                            text=True, timeout=120)
        assert table.returncode == 0 and md.returncode == 0, table.stderr + md.stderr
        want = _markdown_rows(md.stdout)
        assert "[names or patterns]" in want["optim.param_groups"][1]
        assert _table_rows(table.stdout) == want
