"""The test helper that starts ranks (tests/engine/ranks.py): forked from a server that
imported torch once, each rank still starts with the environment of the test that
spawned it, not the server's."""

import os

import pytest

from .ranks import spawn

pytestmark = pytest.mark.distributed


def _report(rank: int, world: int, init_file: str, out: str) -> None:
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{os.environ.get('OFFLOAD_TEST_MARK')}|{'OFFLOAD_TEST_GONE' in os.environ}")


def test_each_rank_starts_with_the_spawning_tests_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_TEST_GONE", "1")
    spawn(_report, str(tmp_path / "init0"), str(tmp_path / "a"))  # the server starts here
    monkeypatch.setenv("OFFLOAD_TEST_MARK", "second")
    monkeypatch.delenv("OFFLOAD_TEST_GONE")
    spawn(_report, str(tmp_path / "init1"), str(tmp_path / "b"))
    for r in range(2):
        assert (tmp_path / f"a.{r}").read_text() == "None|True"
        assert (tmp_path / f"b.{r}").read_text() == "second|False"
