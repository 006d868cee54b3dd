"""Every flag of every sub-command is checked before any work starts: one line on stderr
naming the flag, the value and the fix, exit code 2, no traceback, nothing created."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from offload.cli import args as cli_args
from offload.cli.main import build_parser

OFFLOAD = [sys.executable, "-m", "offload.cli.main"]

FILE = "{file}"  # replaced by a regular file's path
RO = "{ro}"      # replaced by a read-only directory

# (argv, what stderr says after "<prog>: ")
BAD = [
    (["demo", "--size", "0"], "--size: '0' is not a positive count; give 'tiny'"),
    (["demo", "--size", "huge"], "--size: 'huge' is not a count"),
    (["demo", "--size", "inf"], "--size: 'inf' is not a count"),
    (["demo", "--steps", "0"], "--steps: '0' is not positive; give e.g. 60"),
    (["demo", "--batch", "-1"], "--batch: '-1' is out of range 1..4096"),
    (["demo", "--length", "x"], "--length: 'x' is not an integer"),
    (["demo", "--tiny", "--length", "100"], "--length: 100 is out of range for this model; "
     "give 1..16"),
    (["demo", "--lr", "nan"], "--lr: 'nan' is not a finite number; give e.g. 0.0003"),
    (["demo", "--lr", "inf"], "--lr: 'inf' is not a finite number"),
    (["demo", "--lr", "0"], "--lr: '0' is out of range; it must be above 0"),
    (["demo", "--dtype", "fp8"], "--dtype: invalid choice: 'fp8'"),
    (["demo", "--params", "disk"], "--params: invalid choice: 'disk'"),
    (["demo", "--host-budget", "0"], "--host-budget: '0' is below 4.0 KiB; give e.g. 48MiB"),
    (["demo", "--device-budget", "lots"], "--device-budget: 'lots' is not a byte size"),
    (["demo", "--io-buffers", "1MiB"], "--io-buffers: '1MiB' is below 4.0 MiB"),
    (["demo", "--swap-dir", FILE], "--swap-dir: '{file}' exists and is not a directory"),
    (["demo", "--swap-dir", f"{FILE}/sub"], "--swap-dir: '{file}/sub' cannot be created: "
     "{file} is a file"),
    (["demo", "--swap-dir", ""], "--swap-dir: '' names no directory"),
    (["demo", "--trace", f"{FILE}/t.json"], "--trace: '{file}/t.json' cannot be written"),
    (["demo", "--trace", "."], "--trace: '.' is a directory, not a file"),
    (["demo", "--trace-step", "0"], "--trace-step: '0' is not positive"),
    (["demo", "--seed", "-1"], "--seed: '-1' is out of range 0..4294967295"),
    (["demo", "--nproc", "0"], "--nproc: '0' is out of range 1.."),
    (["demo", "--nproc", "99999"], "--nproc: '99999' is out of range 1.."),
    (["demo", "--tiny", "--params", "device"], "--device-budget: the partitions homed on "
     "device take"),
    (["bench", "io", "--path", FILE], "--path: '{file}' exists and is not a directory"),
    (["bench", "io", "--size", "0"], "--size: '0' is below 4.0 MiB; give e.g. 2GiB"),
    (["bench", "io", "--size", "1MiB"], "--size: '1MiB' is below 4.0 MiB"),
    (["bench", "io", "--repeat", "0"], "--repeat: '0' is not positive; give e.g. 3"),
    (["bench", "io", "--engines", "foo"], "--engines: 'foo' is not one of aio, threads"),
    (["bench", "io", "--engines", ","], "--engines: ',' is an empty list"),
    (["bench", "io", "--block-sizes", "1000"], "--block-sizes: '1000' is below 4.0 KiB"),
    (["bench", "io", "--block-sizes", "4KiB,6KiB"], "--block-sizes: in '4KiB,6KiB': '6KiB' is "
     "not a multiple of 4096 bytes"),
    (["bench", "io", "--queue-depths", "0"], "--queue-depths: '0' is out of range 1..1024"),
    (["bench", "io", "--queue-depths", "8,x"], "--queue-depths: in '8,x': 'x' is not an "
     "integer"),
    (["bench", "store", "--partitions", "0"], "--partitions: '0' is not positive"),
    (["bench", "store", "--size", "1"], "--size: '1' is below 4.0 KiB"),
    (["bench", "store", "--rounds", "0"], "--rounds: '0' is not positive"),
    (["bench", "store", "--engine", "uring"], "--engine: invalid choice: 'uring'"),
    (["bench", "store", "--path", FILE], "--path: '{file}' exists and is not a directory"),
    (["bench", "step", "--dim", "0"], "--dim: '0' is not positive"),
    (["bench", "step", "--layers", "0"], "--layers: '0' is not positive"),
    (["bench", "step", "--warmup", "-1"], "--warmup: '-1' is below 0"),
    (["bench", "step", "--rounds", "0"], "--rounds: '0' is not positive"),
    (["bench", "step", "--system", "megatron"], "--system: 'megatron' is not one of offload, "
     "offload-bf16, offload-int8, deepspeed"),
    (["bench", "step", "--placement", "gpu"], "--placement: 'gpu' is not one of none, host, "
     "nvme"),
    (["bench", "step", "--host-budget", "0"], "--host-budget: '0' is below 4.0 KiB"),
    (["bench", "step", "--buffer-budget", "1MiB"], "--buffer-budget: '1MiB' is below 4.0 MiB"),
    (["bench", "step", "--disk-size", "0"], "--disk-size: '0' is below 1 bytes"),
    (["bench", "step", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
    (["bench", "step", "--timeout", "nan"], "--timeout: 'nan' is not a finite number"),
    (["bench", "step", "--timeout", "0"], "--timeout: '0' is out of range; it must be above 0"),
    (["bench", "step", "--threads", "-1"], "--threads: '-1' is below 0"),
    (["bench", "step", "--path", FILE], "--path: '{file}' exists and is not a directory"),
    (["bench", "oversized", "--params", "0"], "--params: '0' is not a positive count; give "
     "'auto'"),
    (["bench", "oversized", "--params", "many"], "--params: 'many' is not a count"),
    (["bench", "oversized", "--d-model", "100"], "--d-model: '100' is below 128"),
    (["bench", "oversized", "--d-model", "200"], "--d-model: '200' is not a multiple of 128"),
    (["bench", "oversized", "--steps", "0"], "--steps: '0' is not positive"),
    (["bench", "oversized", "--batch", "0"], "--batch: '0' is not positive"),
    (["bench", "oversized", "--length", "0"], "--length: '0' is not positive"),
    (["bench", "oversized", "--device-budget", "0"], "--device-budget: '0' is below 4.0 KiB"),
    (["bench", "oversized", "--io-buffers", "1k"], "--io-buffers: '1k' is below 4.0 MiB"),
    (["bench", "oversized", "--probe", "x"], "--probe: 'x' is not a byte size"),
    (["bench", "oversized", "--swap-dir", FILE], "--swap-dir: '{file}' exists and is not a "
     "directory"),
    (["bench", "oversized", "--malloc", "jemalloc"], "--malloc: invalid choice: 'jemalloc'"),
    (["bench", "adam", "--elements", "0"], "--elements: '0' is not a positive count"),
    (["bench", "adam", "--elements", "x"], "--elements: 'x' is not a count"),
    (["bench", "adam", "--rounds", "0"], "--rounds: '0' is not positive"),
    (["bench", "adam", "--chunk-elems", "1000"], "--chunk-elems: '1000' is not a multiple of "
     "1024"),
    (["bench", "adam", "--buffers", "0"], "--buffers: '0' is out of range 1..16"),
    (["bench", "adam", "--buffer-budget", "1MiB"], "--buffer-budget: '1MiB' is below 4.0 MiB"),
    (["bench", "adam", "--block-elems", "10"], "--block-elems: '10' is below 1024"),
    (["bench", "adam", "--threads", "-1"], "--threads: '-1' is below 0"),
    (["bench", "adam", "--nvme", FILE], "--nvme: '{file}' exists and is not a directory"),
    (["bench", "checkpoint", "--params", "0"], "--params: '0' is not a positive count"),
    (["bench", "checkpoint", "--dim", "8"], "--dim: '8' is below 16"),
    (["bench", "checkpoint", "--path", FILE], "--path: '{file}' exists and is not a directory"),
    (["checkpoint", "info", FILE], "path: '{file}' is not a directory; give a checkpoint "
     "directory"),
    (["checkpoint", "export", FILE, "--to", "out"], "path: '{file}' is not a directory"),
    (["checkpoint", "info"], "the following arguments are required: path"),
    (["config", "--bogus"], "unrecognized arguments: --bogus; see 'offload config --help'"),
    (["bench", "io", "--size"], "--size: expected one argument"),
]


def _prog(argv: list[str]) -> str:
    return "offload " + " ".join(argv[:2] if argv[0] in ("bench", "checkpoint") else argv[:1])


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_line_exit_2_and_creates_nothing(argv, says, tmp_path, monkeypatch,
                                                          offload_cli):
    f = tmp_path / "file"
    f.write_text("x")
    argv = [a.replace(FILE, str(f)) for a in argv]
    says = says.replace(FILE, str(f))
    monkeypatch.chdir(tmp_path)
    rc, out, err = offload_cli(argv)
    prog = _prog(argv)
    assert rc == 2, err
    assert err.startswith(f"{prog}: {says}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    if "--" in says:
        assert any(fix in err for fix in ("; give", "; raise", "choose from", "--help",
                                          "expected one argument"))  # the fix
    assert out == ""
    assert sorted(os.listdir(tmp_path)) == ["file"]  # no swap dir, trace or scratch dir


@pytest.mark.parametrize("argv", [["demo", "--tiny", "--swap-dir", RO],
                                  ["demo", "--tiny", "--swap-dir", f"{RO}/sub"],
                                  ["demo", "--tiny", "--trace", f"{RO}/step.json"],
                                  ["bench", "io", "--path", RO],
                                  ["bench", "adam", "--nvme", f"{RO}/x"]])
def test_read_only_directory_is_refused_before_any_work(argv, readonly_dir, tmp_path,
                                                        monkeypatch, offload_cli):
    argv = [a.replace(RO, str(readonly_dir)) for a in argv]
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    rc, out, err = offload_cli(argv)
    assert rc == 2 and err.count("\n") == 1, err
    assert ("is on a read-only file system" in err or "is not writable" in err), err
    assert out == "" and sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("argv, says", [
    (["demo", "--tiny", "--swap-dir", "gone"], "--swap-dir: 'gone' cannot be created: it is "
     "a symbolic link that leads nowhere"),
    (["demo", "--tiny", "--swap-dir", "loop/s"], "--swap-dir: 'loop/s' cannot be created: "
     "{tmp}/loop is a symbolic link that leads nowhere"),
    (["demo", "--tiny", "--swap-dir", "gone/sub"], "--swap-dir: 'gone/sub' cannot be created: "
     "{tmp}/gone is a symbolic link that leads nowhere"),
    (["demo", "--tiny", "--trace", "gone/t.json"], "--trace: 'gone/t.json' cannot be written"),
    (["demo", "--tiny", "--trace", "gone"], "--trace: 'gone' is a symbolic link that leads "
     "nowhere"),
    (["bench", "io", "--path", "gone/x"], "--path: 'gone/x' cannot be created: {tmp}/gone is")])
def test_a_link_to_nothing_is_refused_before_any_work(argv, says, tmp_path, monkeypatch,
                                                      offload_cli):
    """A symbolic link to a missing target (or in a loop) passed the checks
    (os.path.exists is False for it, so it looked creatable): the demo failed at its
    traced step, or at its swap directory, naming no flag."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.chdir(tmp_path)
    rc, out, err = offload_cli(argv)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{_prog(argv)}: {says.replace('{tmp}', str(tmp_path))}"), err
    assert out == "" and sorted(os.listdir(tmp_path)) == ["gone", "loop"]


@pytest.mark.parametrize("argv", [["demo", "--tiny", "--swap-dir", "/proc/offload-swap"],
                                  ["tune", "--write", "/proc/offload.toml"]])
def test_a_directory_on_proc_is_refused_before_any_work(argv, tmp_path, monkeypatch,
                                                        offload_cli):
    """As root, access() says /proc is writable: the demo said "/proc has 0 B free ...
    free some space", and tune ran its whole search before it failed to write."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = offload_cli(argv)
    assert rc == 2 and err.count("\n") == 1, err
    assert "/proc is on a file system without storage (such as /proc or /sys)" in err, err
    assert out == "" and os.listdir(tmp_path) == []


def test_good_values_parse_into_checked_types(tmp_path):
    p = build_parser()
    a = p.parse_args(["bench", "io", "--path", str(tmp_path / "new"), "--size", "8MiB",
                      "--engines", "threads,aio", "--block-sizes", "4KiB, 1MiB",
                      "--queue-depths", "4,8"])
    assert (a.size, a.engines, a.block_sizes, a.queue_depths) == \
        (8 << 20, ("aio", "threads"), (4096, 1 << 20), (4, 8))
    assert not (tmp_path / "new").exists()  # checked, not created
    d = p.parse_args(["demo", "--size", "50M", "--lr", "1e-3", "--host-budget", "48MiB",
                      "--trace", "none"])
    assert (d.size, d.lr, d.host_budget, d.trace) == ("50M", 1e-3, 48 << 20, "none")
    assert p.parse_args(["bench", "oversized"]).params == "auto"


def test_validators_directly(tmp_path):
    assert cli_args.integer(1, 8)("8") == 8
    assert cli_args.number(0, above=True)("1e-3") == 1e-3
    assert cli_args.byte_size(4096)("1MiB") == 1 << 20
    assert cli_args.count(1)("1.5B") == "1.5B" and cli_args.parse_count("1.5B") == 1_500_000_000
    assert cli_args.parse_count("nan") is None and cli_args.parse_count("inf") is None
    assert cli_args.directory()(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert cli_args.output_file()(str(tmp_path / "a" / "t.json")) == str(tmp_path / "a" / "t.json")
    assert os.listdir(tmp_path) == []
    for bad in ("", "x", "0", "17"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            cli_args.integer(1, 16)(bad)


@pytest.mark.parametrize("args, says", [
    (["demo", "--size", "0"], "offload demo: --size: '0' is not a positive count"),
    pytest.param(["demo", "--lr", "nan"], "offload demo: --lr: 'nan' is not a finite number",
                 marks=pytest.mark.slow),  # the default suite's time: one case a command
    (["bench", "io", "--queue-depths", "0"], "offload bench io: --queue-depths: '0' is out of "
     "range 1..1024"),
    pytest.param(["bench", "io", "--repeat", "0"], "offload bench io: --repeat: '0' is not "
                 "positive", marks=pytest.mark.slow),
    pytest.param(["bench", "io", "--engines", "foo"], "offload bench io: --engines: 'foo' is not "
                 "one of", marks=pytest.mark.slow),
])
def test_real_process_refuses_with_one_line(args, says, tmp_path):
    out = subprocess.run(OFFLOAD + args, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith(says), out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == ""
    assert os.listdir(tmp_path) == []


def test_demo_trace_path_is_checked_before_step_one(tmp_path):
    """A trace file that cannot be written stops the run before its first step."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    out = subprocess.run(OFFLOAD + ["demo", "--tiny", "--steps", "4", "--swap-dir",
                                    str(tmp_path / "swap"), "--trace",
                                    str(blocker / "step.json"), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--trace:" in out.stderr and out.stdout == ""
    assert not (tmp_path / "swap").exists()


def test_a_checkpoint_path_one_level_off_names_the_one_to_give(tmp_path):
    """The record file itself, or the parent of keep_checkpoints' step directories, was
    'holds no checkpoint.json'; the refusal names the directory to give."""
    parse = cli_args.existing_directory("checkpoint.json", "checkpoint directory")
    for step in ("step-1", "step-2"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "checkpoint.json").write_text("{}")
    assert parse(str(tmp_path / "step-1")) == str(tmp_path / "step-1")
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"2 of its subdirectories do \(step-1, step-2\); give one of them"):
        parse(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError,
                       match=rf"is the checkpoint.json file; give its directory, "
                             rf"{tmp_path / 'step-2'}"):
        parse(str(tmp_path / "step-2" / "checkpoint.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(argparse.ArgumentTypeError, match="holds no checkpoint.json; give a "):
        parse(str(tmp_path / "empty"))


def test_run_command_reports_machine_and_offload_errors_in_one_line(capsys):
    """An OSError, a MemoryError or one of offload's own errors is one line and exit
    code 1 (they were tracebacks); any other exception is a bug and propagates, as
    does one of offload's raised from a bug, and a closed pipe (main.py's to end)."""
    from offload.engine.rank_order import RankOrderError
    import torch
    from offload.io.errors import SwapPathError

    def raising(e):
        def run(_args):
            raise e
        return run
    cases = [(OSError(28, "No space left on device"), "No space left on device"),
             (MemoryError(), "ran out of memory (MemoryError)"),
             (RankOrderError("rank 1 raised in its model's forward"), "rank 1 raised"),
             # a swap directory refused for the open-file limit: the machine's (it was 2)
             (SwapPathError(24, "io.paths[0]: '/s': cannot create files in it", "/s"),
              "cannot create files"),
             # torch's allocators' failures: one line naming the limit (they were tracebacks)
             (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                           " can't allocate memory: you tried to allocate 524288 bytes. Error "
                           "code 12 (Cannot allocate memory)"), "ran out of memory ([enforce"),
             (torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2.00 GiB"),
              "ran out of memory (CUDA out of memory. Tried")]
    for e, said in cases:
        assert cli_args.run_command(raising(e), argparse.Namespace(), "offload x") == 1
        err = capsys.readouterr().err
        assert err.startswith("offload x: ") and said in err and err.count("\n") == 1, err
    oom = RankOrderError("step 1 failed")  # an error of offload's from the allocator's
    oom.__cause__ = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried")
    assert cli_args.run_command(raising(oom), argparse.Namespace(), "offload x") == 1
    assert capsys.readouterr().err == "offload x: step 1 failed\n"
    wrapped = RankOrderError("step 1 failed (KeyError: 'bug')")  # a wrapper of a bug
    wrapped.__cause__ = KeyError("bug")
    for bug in (KeyError("bug"), wrapped, BrokenPipeError(32, "Broken pipe")):
        with pytest.raises(type(bug)):  # a bug keeps its traceback; main.py ends a pipe
            cli_args.run_command(raising(bug), argparse.Namespace(), "offload x")


def test_ctrl_c_while_the_command_is_imported_exits_130_without_a_traceback(monkeypatch,
                                                                          capsys):
    """Ctrl-C in the first second (the sub-command's modules, torch with them, imported
    while parsing) printed a traceback and died by the signal."""
    from offload.cli import main as cli_main

    def importing(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_main, "build_parser", importing)
    assert cli_main.main(["demo", "--tiny"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_that_lands_in_a_finalizer_still_stops_the_command():
    """A Ctrl-C while garbage collection ran an object's __del__ (a finished dd's Popen in
    `bench io`) was printed as "Exception ignored" and dropped: the command ran on. The
    CLI's handler sends it again once the finalizer returned."""
    script = textwrap.dedent("""
        import os, signal, time
        from offload.cli.main import interrupt_outside_finalizers
        signal.signal(signal.SIGINT, interrupt_outside_finalizers)
        class Slow:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
        try:
            Slow()  # collected at once: the Ctrl-C arrives inside its __del__
            time.sleep(10)
            print("ran on")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "interrupted\n" and "Exception ignored" not in out.stderr, out
