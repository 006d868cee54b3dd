"""`offload demo` as a user runs it: a real process, real swap files, real signals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .one_process import run_each

DEMO = [sys.executable, "-m", "offload.cli.main", "demo"]


def _objects(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_tiny_run_learns_traces_and_cleans_up(tmp_path):
    swap, trace = tmp_path / "swap", tmp_path / "step.trace.json"
    swap.mkdir()
    trace.write_text('{"traceEvents":[]}')  # an earlier run's trace is replaced
    out = subprocess.run(DEMO + ["--tiny", "--steps", "8", "--swap-dir", str(swap),
                                 "--trace", str(trace), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objs = _objects(out.stdout)
    steps = [o for o in objs if o["event"] == "step"]
    summary = objs[-1]
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert summary["event"] == "summary" and not summary["interrupted"]
    assert summary["loss_last"] < summary["loss_first"]
    # the state is larger than the budgets, so bytes really went to and from NVMe
    assert summary["state_bytes"] > 3 * summary["device_peak"]
    assert all(s["read"] > 0 and s["written"] > 0 for s in steps)
    # each step's peaks count every charge, however short the step
    assert all(s["device_peak"] > 0 and s["host_peak"] > 0 for s in steps), steps
    assert summary["swap_removed"] and os.listdir(swap) == []
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer step"} <= names
    assert any(e.get("cat") == "io" for e in events)  # the step's NVMe transfers
    # the header (on stderr with --json) said what the run would do, and where
    assert "budgets" in out.stderr and "swap" in out.stderr
    assert summary["swap_dir"].startswith(str(swap))


def test_sigint_stops_after_the_step_and_removes_swap_files(tmp_path):
    proc = subprocess.Popen(DEMO + ["--tiny", "--steps", "10000", "--swap-dir", str(tmp_path),
                                    "--trace", "none", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["event"] == "step" and first["step"] == 1
        assert list(tmp_path.glob("*/*.swap"))  # the run's swap files exist now
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    summary = _objects(stdout)[-1]
    assert summary["event"] == "summary" and summary["interrupted"]
    assert summary["steps"] < 10000
    assert "Traceback" not in stderr
    assert os.listdir(tmp_path) == []


def _two_ranks(tmp_path) -> subprocess.Popen:
    """A demo of two ranks, each step a JSON line, until it is stopped."""
    return subprocess.Popen(DEMO + ["--size", "8M", "--nproc", "2", "--steps", "10000",
                                    "--swap-dir", str(tmp_path), "--trace", "none", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen) -> None:
    """Kills what a failed test left running: torchrun is in a session of its own."""
    from offload.cli.demo_launch import children

    if proc.poll() is None:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("how", ["ctrl-c twice", pytest.param("sigterm", marks=pytest.mark.slow)])
def test_two_ranks_stopped_at_once_exit_quietly_and_remove_swap_files(tmp_path, how):
    """Under `--nproc 2` a second Ctrl-C or a SIGTERM went to torchrun, which printed
    its SignalException traceback (and, when a rank was on its way out, a rank killed
    by the SIGINT meant for it made a ChildFailedError report)."""
    proc = _two_ranks(tmp_path)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["event"] == "step" and first["step"] == 1
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)  # in the next step, or as the ranks finish it
            proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == (143 if how == "sigterm" else 130), stderr
    assert "Traceback" not in stderr and "Failures" not in stderr, stderr
    summary = _objects(stdout)[-1]
    assert summary["event"] == "summary" and summary["interrupted"], summary
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_launcher_that_fails_itself_stops_its_ranks(tmp_path):
    """`offload demo --nproc 2 2>&1 | head -1`: with its stderr closed, a Ctrl-C's note
    raised BrokenPipeError out of the launcher, which exited and left torchrun and the
    ranks (in sessions of their own, out of the terminal's reach) training on, their
    swap files kept, the stop file removed. The ranks are stopped as by a second
    Ctrl-C: they remove their files and end."""
    from offload.cli.demo_launch import children

    proc = _two_ranks(tmp_path)
    try:
        assert json.loads(proc.stdout.readline())["event"] == "step"
        (launch,) = children(proc.pid)
        ranks = children(launch)
        proc.stderr.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        _end(proc)
    assert len(ranks) == 2
    time.sleep(0.5)  # reaped by init
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
    assert os.listdir(tmp_path) == []


def test_a_rank_killed_is_one_line_and_its_swap_files_are_removed(tmp_path):
    """A rank killed by SIGKILL (the OOM killer): torchrun printed its ChildFailedError
    traceback and report, the other rank a gloo traceback if a collective saw the
    connection close, and the killed rank's swap directory stayed until a next run."""
    from offload.cli.demo_launch import children, peer_lost

    proc = _two_ranks(tmp_path)
    try:
        assert json.loads(proc.stdout.readline())["event"] == "step"
        (launch,) = children(proc.pid)
        victim = max(children(launch))
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "Failures" not in stderr, stderr
    assert f"(pid {victim}) was killed by SIGKILL" in stderr, stderr
    assert os.listdir(tmp_path) == []
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5555: "
                        "Connection reset by peer.")
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gone
    assert peer_lost(gone) and peer_lost(wrapped) and not peer_lost(RuntimeError("bug"))


def test_rank_variables_left_in_a_shell_are_not_a_launch(tmp_path):
    """RANK=1 in the shell ran the demo as a silent rank 1 of a job of one (no output,
    exit 0), and WORLD_SIZE=2 relaunched it on two ranks: only torchrun's launch counts."""
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    nested = tmp_path / "new" / "a" / "b"  # every directory it makes is removed again
    out = subprocess.run(DEMO + ["--tiny", "--steps", "2", "--swap-dir", str(nested), "--json"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    steps = [o for o in _objects(out.stdout) if o["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2] and "1 process" in out.stderr
    assert not (tmp_path / "new").exists()
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "abc"}
    out = subprocess.run(DEMO + ["--tiny", "--swap-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "WORLD_SIZE='abc'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_an_error_the_machine_causes_is_one_line_not_a_traceback(tmp_path):
    """A swap directory the kernel refuses at its mkdir (a name longer than 255 bytes:
    ENAMETOOLONG) was a raw traceback: the CLI printed one line only for its own usage
    errors."""
    swap = tmp_path / ("s" * 300)
    out = subprocess.run(DEMO + ["--tiny", "--steps", "2", "--trace", "none",
                                 "--swap-dir", str(swap)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"offload demo: [Errno 36] File name too long: '{swap}'" in out.stderr, out.stderr


def test_a_failed_json_run_still_ends_with_its_summary(tmp_path):
    """A run that failed (here a swap file may not grow past 1 MiB: RLIMIT_FSIZE, with
    SIGXFSZ ignored as a shell's `ulimit -f` leaves it) printed no summary object under
    `--json`: a script reading stdout saw nothing, not the error or the swap files' fate."""
    import resource

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    swap = tmp_path / "swap"
    out = subprocess.run(DEMO + ["--tiny", "--steps", "2", "--trace", "none", "--json",
                                 "--swap-dir", str(swap)],
                         capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "RLIMIT_FSIZE" in out.stderr, out.stderr
    (summary,) = _objects(out.stdout)
    assert summary["event"] == "summary" and not summary["interrupted"], summary
    assert "RLIMIT_FSIZE" in summary["error"], summary
    assert summary["swap_removed"] and not swap.exists(), summary


def test_refusals_are_clear_and_touch_nothing(tmp_path):
    swap = ["--swap-dir", str(tmp_path)]
    big, device, nproc, both = run_each([
        ["demo", "--size", "100B", *swap],  # ~100B parameters need terabytes of swap
        ["demo", "--tiny", "--params", "device", *swap],  # weights on a device tier too small
        ["demo", "--tiny", "--nproc", "99999", *swap],  # more ranks than the host can start
        ["demo", "--tiny", "--size", "100B", *swap]],  # --size was dropped without a word
        cwd=tmp_path, env=dict(os.environ), timeout=120)
    assert big[0] == 1 and "free" in big[1] and "--swap-dir" in big[1]
    assert device[0] != 0 and "--device-budget" in device[1]
    # the flag is named, not a budget it skews
    assert nproc[0] != 0 and "--nproc" in nproc[1] and "budget" not in nproc[1]
    assert both[0] == 2 and "--tiny and --size 100B: give one of them" in both[1]
    for _, err in (big, device, nproc, both):
        assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_a_size_given_as_a_parameter_count_trains_with_its_default_budgets(tmp_path):
    """`--size 2M`'s default budgets (about 1/8 and 1/4 of its state) are raised to the
    engine's minimum: before, the demo refused its own defaults ("pick a smaller
    --size", which failed too), and in bf16 initialize refused the host budget."""
    swap = ["--swap-dir", str(tmp_path), "--steps", "1", "--trace", "none"]
    runs = run_each([["demo", "--size", "2M", *swap],
                     ["demo", "--size", "2M", "--dtype", "bf16", *swap]],
                    cwd=tmp_path, env=dict(os.environ), timeout=300)
    for rc, err in runs:
        assert rc == 0, err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # 3.4 s; the demo's trace and report are checked by default above
def test_trace_and_report_replace_only_earlier_ones(tmp_path):
    """--trace names a file the user keeps (or its report's name does): refused before
    any work, naming it, and nothing is written."""
    notes, page = tmp_path / "notes.json", tmp_path / "run.report.html"
    notes.write_text('{"mine": 1}')
    page.write_text("<html>my page</html>")
    for trace, kept in ((notes, notes), (tmp_path / "run.trace.json", page)):
        out = subprocess.run(DEMO + ["--tiny", "--swap-dir", str(tmp_path / "swap"),
                                     "--trace", str(trace)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and str(kept) in out.stderr and "--trace" in out.stderr
        assert "Traceback" not in out.stderr
    assert notes.read_text() == '{"mine": 1}' and page.read_text() == "<html>my page</html>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "run.report.html"]


def test_help_lists_the_knobs():
    out = subprocess.run(DEMO + ["--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0
    for flag in ("--size", "--steps", "--device-budget", "--host-budget", "--params",
                 "--grads", "--optimizer", "--swap-dir", "--dtype", "--nproc", "--json"):
        assert flag in out.stdout


def test_a_users_file_where_another_ranks_trace_would_go_is_not_replaced(tmp_path):
    """With two ranks the demo writes run.trace.json and run.rank1.trace.json: a file of
    the user's under the second name is refused before the run, as under the first."""
    from offload.cli.args import UsageError
    from offload.cli.view_demo import check_outputs
    (tmp_path / "run.rank1.trace.json").write_text("my notes")
    check_outputs(tmp_path / "run.trace.json", world=1)  # one rank writes no such file
    with pytest.raises(UsageError, match=r"run\.rank1\.trace\.json"):
        check_outputs(tmp_path / "run.trace.json", world=2)
