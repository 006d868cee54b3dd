"""`offload bench plan`: a real run (its own process) of one small configuration, its
row's fields, and the figures checked against each other."""

import json

import pytest

FIELDS = {"config", "bytes_planned", "bytes_moved", "bytes_lru", "predicted_step_s",
          "measured_step_s", "moved_over_planned", "predicted_over_measured"}


def test_bench_plan_runs_a_configuration_and_reports_its_row(tmp_path, offload_cli):
    traces = tmp_path / "traces"
    rc, out, err = offload_cli(["bench", "plan", "--models", "mlp", "--placements", "both",
                                "--fractions", "25", "--dtypes", "fp32", "--warmup", "1",
                                "--steps", "2", "--probe-size", "8MiB", "--path",
                                str(tmp_path / "scratch"), "--traces", str(traces), "--json"])
    assert rc == 0, err
    r = json.loads(out)
    (row,) = r["results"]
    assert "error" not in row, row
    assert FIELDS <= set(row)
    assert row["config"] == "mlp both 25% fp32"
    # the optimizer's state (8 bytes per parameter in fp32) is read and written every
    # step: the plan, LRU and the run all move at least that
    state = 8 * 8 * 1024 * 1025
    assert row["bytes_planned"] >= 2 * state and row["bytes_moved"] >= 2 * state
    assert row["bytes_planned"] <= row["bytes_lru"]
    # the engine's accounting and the process's storage counter agree
    assert row["proc_bytes"] == pytest.approx(row["bytes_moved"], rel=0.02)
    assert row["moved_over_planned"] == pytest.approx(row["bytes_moved"] / row["bytes_planned"])
    assert 0 < row["predicted_step_s"] and len(row["steps_s"]) == 2
    assert row["predicted_over_measured"] == pytest.approx(
        row["predicted_step_s"] / row["measured_step_s"])
    assert {t["target"] for t in r["targets"]} == {
        "bytes moved / planned", "bytes moved / LRU's", "|predicted / measured - 1|"}
    names = sorted(p.name for p in traces.iterdir())
    assert names == ["mlp-both-25pc-fp32.predicted.trace.json", "mlp-both-25pc-fp32.trace.json"]
    predicted = json.loads((traces / names[0]).read_text())
    assert predicted["metadata"]["kind"] == "predicted"
    assert predicted["metadata"]["step_s"] == pytest.approx(row["predicted_step_s"])
    measured = json.loads((traces / names[1]).read_text())
    steps = [e for e in measured["traceEvents"] if e.get("name") == "step"]
    assert len(steps) == 2


def test_bench_plan_flags_are_checked(offload_cli):
    rc, _, err = offload_cli(["bench", "plan", "--fractions", "30"])
    assert rc == 2
    assert "--fractions" in err and len(err.strip().splitlines()) == 1


def test_a_wait_with_no_request_in_flight_stays_in_the_compute_seconds():
    """The step's profile takes out of a unit's compute seconds the waits that overlap a
    request to the disk (I/O the simulator predicts), not the store's hand-off waits
    with nothing in flight, which the simulator has no model of."""
    from offload.cli.bench_plan_run import step_profile
    from offload.trace.recorder import TraceEvent

    def x(name, t0, t1, track="compute"):
        return TraceEvent("X", t0, t1 - t0, 0, name, "compute", track, None)
    events = [x("forward:u", 0, 1000), x("wait:gather", 100, 300),
              x("wait:budget", 500, 700, "thread:MainThread"),
              TraceEvent("b", 400, 0, 7, "write", "io", "io:nvme", {"bytes": 4096}),
              TraceEvent("e", 650, 0, 7, "write", "io", "io:nvme", None),
              x("optimizer step", 1000, 1200)]
    (use,) = step_profile(events, 0, 1200, {"u": [0]})["uses"]
    assert use["waited_s"] == pytest.approx(150e-9)      # [500, 650] of the second wait
    assert use["compute_s"] == pytest.approx(850e-9)
    (kept,) = step_profile(events, 0, 1200, {"u": [0]}, streamed=False)["uses"]
    assert kept["compute_s"] == pytest.approx(1000e-9)   # parameters in memory: no disk
