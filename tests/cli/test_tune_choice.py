"""How `offload tune` and `offload bench tune` compare real steps: interleaved rounds,
the choice on median and spread, and the benchmark's A/B re-measurement of the
sweep's best against the written configuration."""

import json
import statistics

import pytest

from offload.cli import bench_tune, tune_verify
from offload.cli.model_arg import ModelSpec
from offload.cli.tune_verify import measure_rounds, spread, steadiest_fastest

MiB = 1 << 20


def test_spread_is_the_interquartile_range_over_the_median():
    s = spread([1.0, 1.0, 1.0, 1.0, 1.0])
    assert s["median_s"] == 1.0 and s["spread"] == 0.0 and s["n"] == 5
    s = spread([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s["median_s"] == 0.3 and s["p25_s"] < 0.3 < s["p75_s"]
    assert s["spread"] == pytest.approx((s["p75_s"] - s["p25_s"]) / 0.3)
    assert spread([0.7])["spread"] == 0.0


def test_the_steady_one_wins_over_one_that_swings_and_the_fastest_wins_a_near_tie():
    steady = spread([0.100, 0.101, 0.102, 0.101, 0.100])
    swings = spread([0.05, 0.30, 0.090, 0.08, 0.5])   # median 0.09: 10% faster, 10x swings
    assert steadiest_fastest({"steady": steady, "swings": swings}) == "steady"
    fast = spread([0.05, 0.06, 0.07, 0.08, 0.09])     # faster and as steady
    assert steadiest_fastest({"steady": steady, "fast": fast}) == "fast"
    near = spread([0.097, 0.098, 0.099, 0.104, 0.104])  # upper quartile 3% above, lower median
    assert steadiest_fastest({"steady": steady, "near": near}) == "near"
    assert steadiest_fastest({"steady": steady, "near": near}, tie=0.0) == "steady"


def test_rounds_interleave_and_alternate_a_pair(monkeypatch):
    order = []

    def fake(spec, config, steps):
        order.append(config["k"])
        if config["k"] == "bad":
            return {"error": "RuntimeError: no"}
        return {"steps_s": [0.1] * steps}

    monkeypatch.setattr(tune_verify, "_measure_or_error", fake)
    monkeypatch.setattr(tune_verify, "_warm_up", lambda spec, cfg: order.append("warm"))
    got = measure_rounds(None, {"a": {"k": "a"}, "b": {"k": "b"}}, rounds=4, steps=3)
    assert order == ["warm", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert got["samples"] == {"a": [0.1] * 12, "b": [0.1] * 12} and got["rounds"] == 4
    order.clear()
    cfgs = {k: {"k": k} for k in ("a", "b", "c", "bad")}
    got = measure_rounds(None, cfgs, rounds=2, steps=1, warm=False)
    assert order == ["a", "b", "c", "bad", "c", "a", "b"]  # a failed one is not retried
    assert got["errors"] == {"bad": "RuntimeError: no"} and got["samples"]["bad"] == []
    order.clear()  # past the deadline: the first `min_rounds` only
    got = measure_rounds(None, cfgs, rounds=3, steps=1, warm=False, deadline=0.0)
    assert got["rounds"] == 1 and order == ["a", "b", "c", "bad"]
    # a round starts only if, at the last round's pace, it ends by the deadline (on a
    # clock each measurement moves 0.1 s on: a busy machine's sleeps overrun)
    clock = [100.0]

    def measure(spec, config, steps):
        clock[0] += 0.1
        return {"steps_s": [0.1]}
    monkeypatch.setattr(tune_verify, "_measure_or_error", measure)
    monkeypatch.setattr(tune_verify.time, "perf_counter", lambda: clock[0])
    got = measure_rounds(None, {"a": {}, "b": {}}, rounds=9, steps=1, warm=False,
                         deadline=100.5)
    assert got["rounds"] == 2 and clock[0] == pytest.approx(100.4)


def test_the_benchmark_worker_re_measures_the_sweeps_best_against_the_written_one(
        tmp_path, monkeypatch):
    """A sweep whose best is best by a lucky measurement: the A/B rounds measure it again
    beside the written configuration, and the figure is their A/B medians."""
    (tmp_path / "tinybench.py").write_text(
        "from torch import nn\n\ndef mlp():\n    return nn.Sequential(nn.Linear(64, 64), "
        "nn.ReLU(), nn.Linear(64, 64))\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def cfg(params, optimizer):
        return {"engine": {"params": params, "grads": "host", "optimizer": optimizer,
                           "dtype": "fp32"},
                "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": 4 * MiB},
                "store": {"host_budget": 64 * MiB, "device_budget": 64 * MiB,
                          "device": "cpu"}}
    spec = ModelSpec("function", "tinybench:mlp", 4, None, "fp32")
    configs = {"tuned": cfg("host", "host"), "#2": cfg("device", "host"),
               "#7": cfg("host", "nvme")}
    job = tmp_path / "job.json"
    out = tmp_path / "out.json"
    job.write_text(json.dumps({"spec": spec.__dict__, "configs": configs, "rounds": 2,
                               "ab_rounds": 3, "steps": 2, "out": str(out)}))
    assert bench_tune.main(["--worker", str(job)]) == 0
    got = json.loads(out.read_text())
    sweep = got["sweep"]["samples"]
    assert set(sweep) == set(configs) and all(len(v) == 4 for v in sweep.values())
    best = min((k for k in sweep if k != "tuned"), key=lambda k: statistics.median(sweep[k]))
    assert got["best"] == best
    assert set(got["ab"]["samples"]) == {"tuned", best} and got["ab"]["rounds"] == 3
    assert all(len(v) == 6 for v in got["ab"]["samples"].values())


def test_calibration_measures_one_class_per_placement_and_each_optimizer_tier():
    from offload.cli.tune import calibration_picks
    from offload.planner import Rates
    from offload.planner.estimate import PLACEMENTS, Placement
    from offload.planner.search import Budgets, Candidate, Machine, Space, StepShape, search

    n = 1 << 20

    def shape(gs):
        return StepShape(gs, "fp32", tuple((n, True) for _ in range(8)),
                         tuple(((g,), 0.01) for g in range(8)),
                         {p.name: (8 * MiB, 12 * MiB) for p in PLACEMENTS})
    machine = Machine({(4 * MiB, 32): Rates(2e9, 2e9, 2e9)}, adam_eps=1e9)
    defaults = Candidate(Placement("device", "host", "host"), n, 2, 6, 64 * MiB, 4 * MiB, 32,
                         0, 0)
    space = Space(prefetch_depths=(2,), buffers=(2,), buffer_budgets=(64 * MiB,))
    ranked = search([shape(n), shape(2 * n), shape(4 * n)], space,
                    Budgets(4096 * MiB, 4096 * MiB), machine, defaults)
    picks = calibration_picks(ranked, 6)
    names = [s.candidate.placement.name for s in picks]
    assert len(picks) == 4 and len(set(names)) == 4  # room left for 2 other group sizes
    assert {s.candidate.placement.optimizer for s in picks} == {"host", "nvme"}
    # the in-memory placements rank first here: the NVMe optimizer's best is still measured
    assert sum(s.candidate.placement.optimizer == "nvme" for s in picks) == 1
    assert [ranked.index(s) for s in picks] == sorted(ranked.index(s) for s in picks)
    more = calibration_picks(ranked, 2, placement=names[0], skip=picks)
    assert len(more) == 2 and {s.candidate.placement.name for s in more} == {names[0]}
    assert {s.candidate.group_size for s in more} | {picks[0].candidate.group_size} == \
        {n, 2 * n, 4 * n}
    assert calibration_picks(ranked, 0) == []


def test_without_final_rounds_the_fastest_measured_run_is_written():
    """`--finalists 0`, or final rounds that did not run: the configuration written is
    the fastest of the real runs, not merely one of them."""
    from offload.cli.tune import choose
    res = {"results": [{"config": {"id": "A"}, "placement": "p", "group_size": 1},
                       {"config": {"id": "B"}, "placement": "q", "group_size": 1}],
           "calibration_runs": [
               {"measured_step_s": 2.0, "config": {"id": "B"}, "class": "q@1"},
               {"measured_step_s": 0.5, "config": {"id": "A"}, "class": "p@1"}],
           "final": None}
    assert choose(res) == (1, {"id": "A"})


def test_measured_bytes_per_step_leave_the_warm_up_out(tmp_path, monkeypatch):
    """`--verify` and `bench tune` report a configuration's NVMe bytes per step: those
    of the timed steps (the first step's reads of what initialize placed are not one
    of them), so one or two warm-up steps give the same figure."""
    (tmp_path / "tinym.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(256, 256),"
        " torch.nn.ReLU(), torch.nn.Linear(256, 256))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec("function", "tinym:build", 4, None, "fp32")
    got = []
    for warmup in (1, 2):
        cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme",
                          "group_size": 8192},
               "io": {"paths": [str(tmp_path / f"swap{warmup}")]},
               "store": {"host_budget": 1 << 22, "device_budget": 1 << 21}}
        m = tune_verify.measure_config(spec, cfg, steps=2, warmup=warmup)
        got.append((m["read_bytes_per_step"], m["write_bytes_per_step"]))
    assert got[0] == got[1] and got[0][0] > 0, got
