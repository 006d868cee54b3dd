"""Several refused command lines run in one real process, as the console script runs
each (`main(argv)`), stderr captured per command line: a process each costs over a
second of start-up (torch's import) per case."""

import json
import subprocess
import sys

DRIVER = """
import contextlib, io, json, sys, traceback
from offload.cli.main import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = None
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def run_each(argvs: list[list[str]], cwd, env: dict, timeout: float = 300
             ) -> list[tuple[int | None, str]]:
    """(exit code, stderr) of `offload <argv>` for each of `argvs`, in one process."""
    got = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)],
                         capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    return [tuple(r) for r in json.loads(got.stdout.splitlines()[-1])]
