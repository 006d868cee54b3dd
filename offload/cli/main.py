"""`offload`: command-line entry point. Reads like a table of contents; the
work lives in the sub-command modules and the layers below them."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Sequence

from .args import CommandParser, run_command

COMMANDS = (
    ("demo", "run the main job on an embedded default"),
    ("view", "a self-contained HTML report of trace files (timeline, tier occupancy, "
     "prefetch outcomes, summary)"),
    ("estimate", "bytes per kind and per tier of a model's training state, for every "
     "placement"),
    ("tune", "choose a whole configuration from measurements and the step simulator; "
     "write it as TOML"))
BENCHES = (
    ("io", "engines vs dd/fio with O_DIRECT: GB/s and ratio"),
    ("store", "host -> NVMe -> host through the store vs the raw engine"),
    ("step", "one training step: offload vs DeepSpeed ZeRO-3, per placement"),
    ("oversized", "a model whose training state is twice the machine's RAM, two steps "
     "from NVMe (long; not part of make test)"),
    ("adam", "CPU Adam update vs torch and a memory-stream reference"),
    ("checkpoint", "save and resume of a >= 2 GiB training state vs the disk's O_DIRECT "
     "rate; stall of a background save"),
    ("comm", "communication hidden behind compute: data parallel (serial, overlap) and "
     "tensor parallel (tp, domino), exposed seconds from the trace"),
    ("tune", "offload tune's written configuration vs the best of a sweep of the same "
     "space; tune's time"),
    ("plan", "the planner's bytes and the simulator's step against real steps at tight "
     "budgets (bytes moved, planned, LRU's; predicted and measured step)"))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `offload` parser; every sub-command's flags are checked as they are parsed
    (offload/cli/args.py), and a bad one is one line on stderr with exit code 2.

    With `argv`, only the module of the sub-command it names is imported (the others
    are listed with their help line): `offload --help`, `offload view` or `offload
    config` start without importing torch. Without it, every sub-command is built."""
    words = None if argv is None else [a for a in argv if not a.startswith("-")]

    def wanted(*path: str) -> bool:
        return words is None or words[:len(path)] == list(path)
    p = CommandParser(prog="offload", description="Train models whose training "
                      "state is far larger than accelerator memory.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in COMMANDS:
        _command(sub, name, name, what, wanted(name))

    bench = sub.add_parser("bench", help="benchmarks against the disk or a peer, interleaved")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, what in BENCHES:
        _command(bsub, name, f"bench_{name}", what, wanted("bench", name))

    ck = sub.add_parser("checkpoint", help="inspect a training checkpoint, export its weights")
    ck_sub = ck.add_subparsers(dest="checkpoint", required=True)
    if wanted("checkpoint"):
        _module("checkpoint").add_arguments(ck_sub)

    cfg = sub.add_parser("config", help="print every configuration key with its default, or "
                         "a configuration file's values once checked")
    cfg.add_argument("file", nargs="?", default=None,
                     help="a .toml or .json configuration: checked as offload.initialize "
                     "checks it (a bad key is one line naming it, exit code 2), then every "
                     "key printed with its value there (* where it is not the default)")
    cfg.add_argument("--markdown", action="store_true",
                     help="as the table in docs/configuration.md")
    cfg.set_defaults(func=_print_config)
    return p


def _module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _command(sub, name: str, module: str, what: str, load: bool) -> None:
    """Sub-command `name`: `module.add_arguments` gives its flags, `module.run` runs it
    (the module is imported only where `load`)."""
    p = sub.add_parser(name, help=what)
    if load:
        mod = _module(module)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


def _print_config(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..config import config_reference, load_config
    from .args import escape, table_console

    rows = config_reference()
    head = "default"
    if args.file is not None:
        given = config_reference(values=load_config(args.file))
        rows = [(key, value + (" *" if value != default else ""), doc)
                for (key, default, doc), (_, value, _) in zip(rows, given)]
        head = "value (* not the default)"
    if args.markdown:
        print(f"| key | {head} | meaning |\n| --- | --- | --- |")
        for key, value, doc in rows:
            print(f"| `{key}` | `{value}` | {doc} |")
        return 0
    # cells are markup to rich: escaped, "[names or patterns]" is printed, not read as a tag
    t = Table(title="offload configuration keys" + (f" in {escape(args.file)}" if args.file
                                                     else ""))
    for col in ("key", head, "meaning"):
        t.add_column(escape(col))
    for key, value, doc in rows:
        t.add_row(escape(key), escape(value), escape(doc))
    table_console().print(t)
    return 0


def _prog(args: argparse.Namespace) -> str:
    sub = {"bench": getattr(args, "bench", None), "checkpoint": getattr(args, "checkpoint", None)}
    return " ".join(["offload", args.command] + ([sub[args.command]] if sub.get(args.command)
                                                 else []))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # the sub-command's modules (torch with them) are imported while parsing
        args, extra = build_parser(argv).parse_known_args(argv)
    except KeyboardInterrupt:  # nothing was made yet
        print("interrupted", file=sys.stderr)
        return 130
    if extra:
        print(f"{_prog(args)}: unrecognized arguments: {' '.join(extra)}; see "
              f"'{_prog(args)} --help'", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.logging import RichHandler

    # logs go to stderr: stdout carries the command's output (--json must parse)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_path=False)])
    # SIGTERM's default action ends the process where it stands, leaving the swap and
    # probe files a command removes on its way out: SystemExit(143) unwinds instead
    term = intr = None
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            term = signal.signal(signal.SIGTERM, _exit_on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            intr = signal.signal(signal.SIGINT, interrupt_outside_finalizers)
    try:
        return run_command(args.func, args, _prog(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`... --json | head`): as a shell tool
        # does, stop quietly; stdout goes to /dev/null so the exit's flush cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)
        if intr is not None:
            signal.signal(signal.SIGINT, intr)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def interrupt_outside_finalizers(signum: int, frame: Any) -> None:
    """Ctrl-C as KeyboardInterrupt, except while a finalizer runs (an object's `__del__`,
    a `weakref.finalize` callback, as garbage collection calls them anywhere), where
    Python prints the exception and drops it ("Exception ignored in ...") and the
    command went on: there the signal is sent again 50 ms later, once it returned."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__"
                                          and code.co_filename.endswith("weakref.py")):
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
