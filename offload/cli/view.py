"""`offload view TRACE... [-o report.html] [--open]`: the HTML report of trace files.

Reads Chrome-trace files written by offload (one per rank of a job, or one
holding several ranks; a simulator's prediction marked ``"kind": "predicted"``
in its metadata), writes one self-contained HTML page and prints its path.
Bad input (a missing, unreadable or malformed trace, an output path that
cannot be written, or that holds a file other than a report, which is never
replaced) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import webbrowser
from pathlib import Path

from ..trace.report import ReportInputError, default_report_path, write_report

__all__ = ["add_arguments", "open_in_browser", "run"]

EXIT_BAD_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Write a self-contained HTML report of trace files: a timeline per rank, "
                     "tier occupancy against budgets, prefetch outcomes and a summary. It "
                     "opens from file:// with no network.")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="Chrome-trace files (.json or .json.gz): one per rank of a job, and "
                        "optionally a predicted trace (metadata kind = predicted)")
    p.add_argument("-o", "--output", default=None, metavar="HTML",
                   help="the report to write (default: beside the first trace, "
                        "NAME.report.html)")
    p.add_argument("--title", default="", help="the page's title (default: the file names)")
    p.add_argument("--open", action="store_true",
                   help="open the report in the default browser, where there is one")


def run(args: argparse.Namespace) -> int:
    if args.output is not None and not args.output.strip():
        return _fail("-o: an empty name; give the report's file name, e.g. -o run.html, or "
                     "leave -o out to write it beside the first trace")
    out = Path(args.output) if args.output is not None else default_report_path(args.traces[0])
    problem = _bad_output(out, dir_named=args.output is not None
                          and args.output.endswith(("/", os.sep)))
    if problem:
        return _fail(problem)
    try:
        path = write_report(args.traces, out, title=args.title, replace_only_reports=True)
    except ReportInputError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{out}: cannot write the report ({e.strerror or e}); name a place "
                     "that can be written with -o")
    except MemoryError:  # drawing the traces, after each was read
        return _fail(f"{', '.join(args.traces)}: too large to draw in the memory this process "
                     "may use; record fewer steps, or view them where there is more memory "
                     "(nothing was written)")
    print(path)
    if args.open and not open_in_browser(path):
        print("offload view: no browser found here; open the file above in one",
              file=sys.stderr)
    return 0


def _bad_output(out: Path, dir_named: bool = False) -> str | None:
    """What is wrong with writing the report to ``out``; ``dir_named``: the name given
    ends with a slash, so it names a directory (Path drops the slash)."""
    if out.is_dir():
        return f"{out}: is a directory; give -o a file name such as {out / 'report.html'}"
    if dir_named:
        return (f"{out}{os.sep}: names a directory, which does not exist; give -o a file "
                f"name such as {out / 'report.html'} (its directory must exist)")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        return f"{out}: {parent} is not a directory"
    if not parent.is_dir():
        return f"{out}: the directory {parent} does not exist"
    return None


def _fail(message: str) -> int:
    print(f"offload view: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def open_in_browser(path: Path) -> bool:
    """Opens ``path`` in the default browser; False where there is none."""
    try:
        browser = webbrowser.get()
    except webbrowser.Error:
        return False
    return bool(browser.open(path.absolute().as_uri()))
