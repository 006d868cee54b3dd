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


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """user_module(name, text) -> the directory holding `name`.py with `text` (imported by
    name, as a user's module would be), made the test's current directory."""
    def write(name: str, text: str):
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.chdir(tmp_path)
        return tmp_path
    return write
