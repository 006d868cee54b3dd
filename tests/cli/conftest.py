import pytest

from offload.cli.main import main


@pytest.fixture
def offload_cli(capsys):
    """run(argv) -> (exit code, stdout, stderr) of `offload <argv>` in this process; a
    usage error (argparse's SystemExit) is its exit code."""
    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run
