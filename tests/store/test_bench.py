"""`offload bench store` at a tiny size: both systems run, rows and ratios are reported."""

from __future__ import annotations

import argparse
import json

from offload.cli import bench_store


def test_bench_store_json(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_store.add_arguments(p)
    args = p.parse_args(["--path", str(tmp_path / "b"), "--partitions", "2", "--size", "64KiB",
                         "--rounds", "2", "--json"])
    assert bench_store.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in out["results"]] == ["store", "raw"]
    assert all(r["write_GBps"] > 0 and r["read_GBps"] > 0 for r in out["results"])
    assert set(out["ratios"]) == {"write", "read"} and out["ratios"]["read"] > 0
    assert not (tmp_path / "b").exists()  # swap files of both systems removed, and the
    # directory the command made for them
