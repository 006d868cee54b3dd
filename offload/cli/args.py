"""Command-line arguments checked before any work starts.

Every flag of every sub-command has an argparse `type=` from here, so a bad
value is refused while the command line is parsed: one line on stderr naming
the flag, the value and the fix, exit code 2, no traceback (`CommandParser`).
Checks that need several flags at once raise `UsageError` from the command's
own plan, which `run_command` reports the same way; so does a `ConfigError`
(the library's refusal of a configuration value or a swap path).

Paths are checked without creating anything: a directory must exist or be
creatable (its nearest existing ancestor a writable directory), an output file
must be writable where it is to be written.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any, Callable, Sequence

from ..config import ConfigError, format_bytes, parse_bytes
from ..limits import limit_hint

__all__ = ["CommandParser", "UsageError", "byte_size", "choice_list", "count", "directory",
           "existing_directory", "integer", "missing_directories", "number", "output_file",
           "parse_count", "remove_directories", "run_command", "value_list"]


class UsageError(Exception):
    """A flag's value the command cannot use (found before any work starts)."""


class DamageError(Exception):
    """Damaged input the flags point at (a checkpoint whose files fail their checks):
    one line, exit code 1, as a condition of the files rather than of the flags."""


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, '<prog>: <flag>: <what>; <fix>',
    with exit code 2 (argparse prints the usage first; that is what --help is for)."""

    def error(self, message: str) -> Any:  # argparse's hook; never returns
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
        if m:
            message = f"{m.group(1)}: {m.group(2)}"
            if m.group(2) == "expected one argument" and m.group(1).startswith("-"):
                # argparse takes a value starting with '-' ('-1MiB') for another flag
                message += (f"; give its value after it, or as {m.group(1)}=VALUE where the "
                            "value starts with '-'")
        elif message.startswith(("unrecognized", "the following arguments")):
            message += f"; see '{self.prog} --help'"
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: {message}\n")


def table_console() -> Any:
    """A rich Console for a command's tables on stdout: the terminal's width, else 160
    columns, so a table piped to a file or another program is not wrapped or cut to
    rich's default of 80."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def escape(text: object) -> str:
    """`text` (a path, a model name) as itself inside rich markup: brackets in it are
    not read as tags (`[/x]` raised, `[bold]` vanished)."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                prog: str) -> int:
    """Runs a sub-command; a `UsageError` or `ConfigError` is one line and exit code 2, a
    `DamageError` (or a `SwapPathError` for a limit of the process) one line and exit
    code 1. So is, with exit code 1, an error the machine caused (`OSError`: a full
    disk, a limit, a path; `MemoryError`; torch's allocator out of memory) or one of
    offload's own caused by one of those (a failed step, a swap file refused: their
    messages name the fix); anything else is a bug, and keeps its traceback (a step
    that failed for a bug too), as does a closed pipe (main.py ends it quietly)."""
    try:
        return func(args)
    except (UsageError, ConfigError, DamageError) as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1 if isinstance(e, DamageError) or _a_limit(e) else 2
    except MemoryError:
        print(f"{prog}: {_OUT_OF_MEMORY.format('MemoryError')}", file=sys.stderr)
        return 1
    except Exception as e:
        if _allocator_failed(e):  # raised by torch's own allocator, not as a MemoryError
            print(f"{prog}: {_OUT_OF_MEMORY.format(' '.join(str(e).split()))}",
                  file=sys.stderr)
            return 1
        if not _the_machines(e):
            raise
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


_OUT_OF_MEMORY = ("ran out of memory ({}): the process's memory limit (ulimit -v, a "
                  "container's) or the machine's memory is too small for this command")


def _allocator_failed(e: BaseException) -> bool:
    """Whether `e` is torch's report that its allocator got no memory: a RuntimeError
    from the CPU allocator, a `torch.OutOfMemoryError` from a device's."""
    torch = sys.modules.get("torch")  # not imported: not torch's
    return torch is not None and isinstance(e, torch.OutOfMemoryError) or (
        type(e) is RuntimeError and "DefaultCPUAllocator: can't allocate memory" in str(e))


def _a_limit(e: BaseException) -> bool:
    """Whether `e` is an `OSError` for a limit of the process or machine (open files,
    file size, memory): a swap directory refused for one is the machine's, not the
    configuration's."""
    return isinstance(e, OSError) and bool(limit_hint(e.errno))


def _the_machines(e: BaseException | None) -> bool:
    """Whether `e` and every error it was raised from is the machine's (`OSError`, not
    a closed pipe; `MemoryError`, an allocator's failure) or offload's own: a user's
    fix, not a bug's."""
    while e is not None:
        if isinstance(e, BrokenPipeError) or not (
                isinstance(e, (OSError, MemoryError)) or _allocator_failed(e)
                or type(e).__module__.startswith("offload.")):
            return False
        e = e.__cause__
    return True


def _typed(name: str, fn: Callable[[str], Any]) -> Callable[[str], Any]:
    fn.__name__ = name  # argparse names the type in its fallback messages
    return fn


def _bad(text: str, problem: str, fix: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{text!r} {problem}; {fix}")


def integer(min: int | None = None, max: int | None = None, *, multiple: int = 1,
            example: int | None = None) -> Callable[[str], int]:
    """An integer in [min, max] (and a multiple of `multiple`)."""
    eg = example if example is not None else (min if min is not None and min > 0 else 1)

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise _bad(text, "is not an integer", f"give e.g. {eg}") from None
        if min is not None and v < min or max is not None and v > max:
            if max is not None:
                raise _bad(text, f"is out of range {min}..{max}", f"give e.g. {eg}")
            raise _bad(text, "is not positive" if min == 1 else f"is below {min}",
                       f"give e.g. {eg}")
        if max is None and v >= 1 << 63:  # what a config key or the kernel takes at most
            raise _bad(text, "is out of range (beyond 2^63)", f"give e.g. {eg}")
        if v % multiple:
            raise _bad(text, f"is not a multiple of {multiple}", f"give e.g. {eg}")
        return v
    return _typed("integer", parse)


def ranks() -> Callable[[str], int]:
    """`--nproc`: 1 to four processes per CPU this process may use (at least 8); more
    would spend the run starting processes, and their partitions' padding would dwarf
    the model."""
    from ..io.process import usable_cpus
    return integer(1, max(8, 4 * usable_cpus()), example=2)


def number(min: float | None = None, *, above: bool = False, max: float | None = None,
           example: float = 1.0) -> Callable[[str], float]:
    """A finite float >= min (> min with `above`) and <= max."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise _bad(text, "is not a number", f"give e.g. {example}") from None
        if not math.isfinite(v):
            raise _bad(text, "is not a finite number", f"give e.g. {example}")
        if min is not None and (v <= min if above else v < min):
            need = f"{'above' if above else 'at least'} {min:g}"
            raise _bad(text, f"is out of range; it must be {need}", f"give e.g. {example}")
        if max is not None and v > max:
            raise _bad(text, f"is above {max:g}", f"give e.g. {example}")
        return v
    return _typed("number", parse)


def byte_size(min: int = 1, *, multiple: int = 1, example: str = "256MiB") -> Callable[[str], int]:
    """A byte size ('4096', '256MiB', '2GiB'), at least `min` bytes."""
    def parse(text: str) -> int:
        try:
            v = parse_bytes(text)
        except ConfigError:
            raise _bad(text, "is not a byte size", f"give e.g. {example}") from None
        if v < min:
            at_least = format_bytes(min) if min >= 1024 else f"{min} bytes"
            raise _bad(text, f"is below {at_least}", f"give e.g. {example}")
        if v % multiple:
            raise _bad(text, f"is not a multiple of {multiple} bytes", f"give e.g. {example}")
        return v
    return _typed("byte size", parse)


_COUNT_UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9}


def parse_count(text: str) -> int | None:
    """'100M', '1.2B', '2e7', '20000000' -> a count; None if it is not one."""
    t = text.strip().upper()
    unit = t[-1:] if t[-1:] in _COUNT_UNITS and t[-1:] else ""
    try:
        v = float(t[:len(t) - len(unit)]) * _COUNT_UNITS[unit]
    except ValueError:
        return None
    return int(v) if math.isfinite(v) else None


def count(min: int = 1, *, example: str = "100M", also: Sequence[str] = ()) -> Callable[[str], Any]:
    """A count such as '100M' or '1.2B' (returned as the text), or one of `also`."""
    def parse(text: str) -> str:
        if text in also:
            return text
        v = parse_count(text)
        if v is None or v < min:
            what = "is not a count" if v is None else \
                "is not a positive count" if min == 1 else f"is below {min}"
            options = "".join(f"'{a}', " for a in also)
            raise _bad(text, what, f"give {options}a count such as {example}")
        return text
    return _typed("count", parse)


def value_list(item: Callable[[str], Any]) -> Callable[[str], tuple]:
    """A comma list, each item checked by `item`; never empty."""
    def parse(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise _bad(text, "is an empty list", "give one or more values separated by commas")
        out = []
        for p in parts:
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as e:
                if len(parts) == 1:
                    raise
                raise argparse.ArgumentTypeError(f"in {text!r}: {e}") from None
        return tuple(out)
    return _typed("list", parse)


def choice_list(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma list of `allowed` names, returned in the order of `allowed`."""
    def one(text: str) -> str:
        if text not in allowed:
            raise _bad(text, f"is not one of {', '.join(allowed)}",
                       f"give a comma list of {', '.join(allowed)}")
        return text

    def parse(text: str) -> tuple[str, ...]:
        picked = value_list(one)(text)
        return tuple(a for a in allowed if a in picked)
    return _typed("choice list", parse)


def _writable(d: str) -> str | None:
    """Why files cannot be created in the existing directory `d` ('is ...'), or None."""
    if _kernel_fs(d):  # root may "write" there: access() says yes
        return "is on a file system without storage (such as /proc or /sys)"
    kw = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    if os.access(d, os.W_OK | os.X_OK, **kw):
        return None
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    except OSError:
        pass
    return "is not writable by this user"


# the kernel's file systems that hold no files of a user's (ramfs and tmpfs do)
_KERNEL_FS = frozenset({"proc", "sysfs", "debugfs", "tracefs", "securityfs", "cgroup",
                        "cgroup2", "pstore", "bpf", "configfs", "efivarfs", "fusectl",
                        "binfmt_misc"})


def _kernel_fs(d: str) -> bool:
    """Whether the existing directory `d` is on one of `_KERNEL_FS` (its mount in
    /proc/self/mounts, the longest mount point holding it)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return False
    real, best, kind = os.path.realpath(d), "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind in _KERNEL_FS


def _directory_problem(path: str) -> str | None:
    """Why `path` cannot be (made into) a writable directory, or None. Creates nothing."""
    p = os.path.abspath(path)
    if os.path.exists(p):
        if not os.path.isdir(p):
            return "exists and is not a directory"
        return _writable(p)
    ancestor = p
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.exists(ancestor):  # os.makedirs would stop at it
        link = f"{ancestor} is" if ancestor != p else "it is"
        return f"cannot be created: {link} a symbolic link that leads nowhere"
    if not os.path.isdir(ancestor):
        return f"cannot be created: {ancestor} is a file"
    why = _writable(ancestor)
    return f"cannot be created: {ancestor} {why}" if why else None


def missing_directories(path: str) -> list[str]:
    """The directories that `os.makedirs(path)` would create, deepest first: what a
    command that fails (or only needs them for a while) removes again."""
    out = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        out.append(p)
        p = os.path.dirname(p)
    return out


def remove_directories(dirs: Sequence[str]) -> None:
    """Removes `dirs` (deepest first, as `missing_directories` lists them) while they
    are empty: one that holds anything stops the walk up (it is not only ours)."""
    for d in dirs:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            continue
        except OSError:
            return


def directory(purpose: str = "directory") -> Callable[[str], str]:
    """A directory that exists or can be created, and is writable (returned as given)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise _bad(text, "names no directory", f"give a {purpose}")
        why = _directory_problem(text)
        if why:
            raise _bad(text, why, f"give a writable {purpose}")
        return text
    return _typed("directory", parse)


def existing_directory(holding: str, purpose: str) -> Callable[[str], str]:
    """A directory that exists and holds the file `holding` (returned as given)."""
    def parse(text: str) -> str:
        p = os.path.abspath(text)
        if not text.strip() or not os.path.exists(p):
            raise _bad(text, "does not exist", f"give a {purpose}")
        if not os.path.isdir(p):
            if os.path.basename(p) == holding:  # the file itself: its directory is meant
                raise _bad(text, f"is the {holding} file", f"give its directory, "
                           f"{os.path.dirname(text) or '.'}")
            raise _bad(text, "is not a directory", f"give a {purpose}")
        if not os.path.isfile(os.path.join(p, holding)):
            try:
                inside = sorted(d for d in os.listdir(p)
                                if os.path.isfile(os.path.join(p, d, holding)))
            except OSError:  # unreadable: said as for any directory without it
                inside = []
            if inside:  # a parent of several (keep_checkpoints' step-N directories)
                shown = ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else "")
                raise _bad(text, f"holds no {holding}, but {len(inside)} of its "
                           f"subdirectories do ({shown})", "give one of them")
            raise _bad(text, f"holds no {holding}", f"give a {purpose}")
        return text
    return _typed("directory", parse)


def output_file(none: Sequence[str] = (), *, example: str = "out.json") -> Callable[[str], str]:
    """A file that can be written (its directory exists or can be created and is
    writable; it is not a directory), or one of `none` (returned as given); `example`
    is the file name the fix offers."""
    def parse(text: str) -> str:
        if text in none:
            return text
        p = os.path.abspath(text)
        fix = f"give a file name such as '{example}'" + (f", or '{none[0]}'" if none else "")
        if not text.strip():
            raise _bad(text, "names no file", fix)
        if os.path.isdir(p):
            raise _bad(text, "is a directory, not a file", fix)
        if os.path.exists(p) and not os.access(p, os.W_OK):
            raise _bad(text, "exists and cannot be written", "give another file name")
        if os.path.lexists(p) and not os.path.exists(p):
            raise _bad(text, "is a symbolic link that leads nowhere", "give another file "
                       "name")
        parent = os.path.dirname(p)
        why = _directory_problem(parent)
        if why:
            raise _bad(text, f"cannot be written: {parent} {why}", "give a file in a "
                       "writable directory")
        return text
    return _typed("file", parse)
