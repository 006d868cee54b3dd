"""`offload bench comm`: two ranks, every mode (data and tensor parallel), figures read
from the event trace."""

import json

import pytest


pytestmark = pytest.mark.distributed


def test_bench_comm_reports_every_mode(tmp_path, offload_cli):
    rc, out, err = offload_cli(["bench", "comm", "--size", "tiny", "--steps", "1", "--repeats",
                                "1", "--batch", "2", "--path", str(tmp_path), "--json"])
    assert rc == 0, err
    r = json.loads(out)
    assert r["nproc"] == 2 and r["backend"] == "gloo"
    rows = {row["mode"]: row for row in r["rows"]}
    assert set(rows) == {"serial", "overlap", "tp", "domino"}
    for row in rows.values():
        assert row["samples"] == 1 and row["step_s"] > 0
        # a wait lies inside its collective's span: what is exposed is part of the comm
        assert 0 < row["exposed_comm_s"] <= row["comm_s"]
    assert r["overlap_vs_serial"] == pytest.approx(rows["overlap"]["step_s"]
                                                   / rows["serial"]["step_s"])
    assert r["domino_vs_tp"] == pytest.approx(rows["domino"]["step_s"] / rows["tp"]["step_s"])
    assert list(tmp_path.iterdir()) == []  # scratch files removed


def test_bench_comm_flags_are_checked(offload_cli):
    rc, _, err = offload_cli(["bench", "comm", "--nproc", "0"])
    assert rc == 2
    assert "--nproc" in err and len(err.strip().splitlines()) == 1
