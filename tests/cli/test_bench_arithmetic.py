"""The figures the benchmarks print, from made-up samples through the functions that
compute them: medians over rounds, bytes per step, the lower bound (the largest of
its terms, each row's own disk probe, the fastest no-offload step), the forced bytes
of each moment form, the peak RSS and the targets' verdicts on both sides of their
limits. A wrong figure here is one a reader would trust; the runs themselves are
in test_bench_step.py and test_bench_plan.py."""

import argparse

import pytest

from offload.cli import bench_oversized, bench_step
from offload.cli.bench_adam import _nvme_bounds
from offload.cli.bench_plan import targets as plan_targets
from offload.cli.bench_step_targets import practicality, targets
from offload.cli.demo import StepMeter

GiB = 1 << 30


def _sample(step, read, written, peak, disk=None, steps=2):
    s = {"step_s": [step] * steps, "losses": [2.0, 1.0], "cpu_s": step * steps, "cores": 2,
         "init_s": 1.0, "peak_rss_bytes": peak, "steps_peak_rss_bytes": peak,
         "read_bytes": read * steps, "write_bytes": written * steps}
    if disk:
        s["disk"] = disk
    return s


def _rows():
    own = {"write_GBps": 0.01, "read_GBps": 0.01, "mixed_GBps": 0.015}  # each row's probe
    runs = [
        bench_step._Runs("offload", "none", [_sample(s, 0, 0, GiB) for s in (0.10, 0.30, 0.12)]),
        bench_step._Runs("deepspeed", "none", [_sample(0.3, 0, 0, GiB)] * 3),
        bench_step._Runs("offload", "nvme", [_sample(s, 400e6, 300e6, int(1.2 * GiB), own)
                                             for s in (0.9, 0.5, 0.6)]),
        bench_step._Runs("deepspeed", "nvme", [_sample(s, 900e6, 900e6, 2 * GiB, own)
                                               for s in (2.0, 2.2, 2.4)]),
        bench_step._Runs("offload-int8", "nvme", [_sample(0.4, 200e6, 150e6, GiB, own)] * 3)]
    rows = [bench_step._row(r) for r in runs]
    forced = {(dt, "nvme"): bench_step.forced_bytes("nvme", 256, 6, 4 * 264192, dt)
              for dt in ("fp32", "int8")}
    top = {"write_GBps": 0.02, "read_GBps": 0.02, "mixed_GBps": 0.03}  # the run's median
    bench_step._add_bounds(rows, top, forced)
    practicality(rows)
    return {(r["system"], r["placement"]): r for r in rows}


def test_step_rows_medians_bytes_per_step_and_bounds():
    rows = _rows()
    off = rows[("offload", "nvme")]
    assert off["median_step_s"] == pytest.approx(0.6)  # the median round, not the first
    assert (off["read_bytes_per_step"], off["write_bytes_per_step"]) == (400e6, 300e6)
    assert off["peak_rss_GiB"] == pytest.approx(1.2)
    assert (off["forced_read_bytes"], off["forced_write_bytes"]) == (4239360, 3698688)
    # the largest term, at the row's own probe (10 MB/s), with the fastest none step
    assert off["bound_terms_s"] == pytest.approx(
        {"compute": 0.12, "read": 0.423936, "write": 0.3698688})
    assert off["bound_s"] == pytest.approx(0.423936)
    assert off["step_over_bound"] == pytest.approx(0.6 / 0.423936)
    assert off["practicality"] == pytest.approx(0.12 / 0.6)
    int8 = rows[("offload-int8", "nvme")]  # int8 moments: fewer forced bytes, its own bound
    assert (int8["forced_read_bytes"], int8["forced_write_bytes"]) == (1883184, 1342512)
    assert int8["bound_s"] == pytest.approx(0.1883184)
    assert int8["step_over_bound"] == pytest.approx(0.4 / 0.1883184)


def test_step_targets_fall_on_the_right_side_of_each_limit():
    got = {t["target"]: t for t in targets(list(_rows().values()), GiB // 2)}
    want = {"step <= 0.35x DeepSpeed's": (0.6 / 2.2, True),
            "step <= 1.1x the lower bound": (0.6 / 0.423936, False),
            "peak RSS <= the memory budgets in use": (1.2, False),
            "bytes per step <= 0.6x offload fp32's": (0.5, True),
            "step <= 0.7x offload fp32's": (0.4 / 0.6, True),
            "practicality": (0.3, False)}
    for part, (value, met) in want.items():
        (t,) = [t for name, t in got.items() if part in name]
        assert t["value"] == pytest.approx(value, rel=1e-3) and t["met"] is met, t
    (rss,) = [t for name, t in got.items() if "peak RSS" in name]
    assert rss["limit"] == pytest.approx(1.0)  # 0.5 GiB of budgets + 0.5 GiB, in GiB


def test_step_runs_interleave_systems_in_each_round(tmp_path, monkeypatch):
    """Round by round, every system once (A B A B), so the disk's drift falls on both."""
    order = []

    def run(spec, timeout):
        order.append(spec.system)
        return _sample(0.1, 0, 0, GiB)
    monkeypatch.setattr(bench_step, "_spawn", run)
    p = argparse.ArgumentParser()
    bench_step.add_arguments(p)
    args = p.parse_args(["--dim", "64", "--layers", "2", "--rounds", "2", "--placement", "host",
                         "--system", "offload,offload-int8"])
    bench_step.run_step_bench(args, str(tmp_path))
    assert order == ["offload", "offload-int8", "offload", "offload-int8"]


def test_plan_targets_miss_under_predictions_and_more_bytes_than_lru():
    rows = [{"moved_over_planned": 1.0, "bytes_planned": 100, "bytes_moved": 100,
             "bytes_lru": 80, "predicted_over_measured": 0.5}]
    got = {t["target"]: t["met"] for t in plan_targets(rows)}
    assert got == {"bytes moved / planned": True, "bytes moved / LRU's": False,
                   "|predicted / measured - 1|": False}
    # bytes moved where none were planned (nor by LRU) miss: they counted as a ratio of 1
    rows = [{"moved_over_planned": None, "bytes_planned": 0, "bytes_moved": 4096,
             "bytes_lru": 0, "predicted_over_measured": 1.0},
            {"moved_over_planned": None, "bytes_planned": 0, "bytes_moved": 0,
             "bytes_lru": 0, "predicted_over_measured": 1.0}]
    got = {t["target"]: (t["met"], t["value"], t["rows_met"]) for t in plan_targets(rows)}
    assert got["bytes moved / planned"] == (False, None, 1)
    assert got["bytes moved / LRU's"] == (False, None, 1)


def test_step_bound_counts_a_gpus_memory_and_failed_offload_rows_fail_the_command():
    """The memory that may keep parameters across steps is the host's and the device's
    budgets, a GPU's too (left out, the forced bytes were more than a run moved, so
    the "lower bound" was none); a row of offload-bf16 or offload-int8 that measured
    nothing fails the command, as offload's does."""
    base = {"host_budget": 160 << 20, "device_budget": 144 << 20}
    assert bench_step._memory_budget({**base, "device": "cuda"}) == 304 << 20
    assert bench_step._memory_budget({**base, "device": "cpu"}) == 304 << 20
    rows = [{"system": s, "placement": "nvme", "median_step_s": t}
            for s, t in (("offload", 1.0), ("offload-int8", None), ("deepspeed", None))]
    assert [r["system"] for r in bench_step.failed_rows(rows)] == ["offload-int8"]


def test_adam_nvme_bound_is_the_slower_direction_or_memory():
    """A lower bound: the slower direction alone (reads 4 s, writes 2 s), not the two
    added (6 s, a reference a disk serving both at once beats); memory where larger."""
    r = _nvme_bounds(8 * 10**9, 0.5, 10.0, 4e9, 2e9, 3e9)
    assert (r["io_bound_s"], r["bound_s"], r["io_serial_s"]) == (4.0, 4.0, 6.0)
    assert r["step_over_bound"] == pytest.approx(10 / 4)
    assert _nvme_bounds(8 * 10**9, 5.0, 10.0, 4e9, 2e9, 3e9)["bound_s"] == 5.0


def test_step_meter_reports_each_steps_own_bytes():
    class Totals:
        now = (0, 0)

        def nvme_bytes(self):
            return self.now
    engine = Totals()
    meter = StepMeter(engine)
    for k in range(1, 4):
        engine.now = (100 * k, 50 * k)
        got = meter.step()
        assert (got.read, got.written) == (100, 50)


def test_oversized_verdict_counts_the_peak_while_placing():
    """A peak while the model was placed counts against the limit as one while stepping."""
    class Spec:
        budgets, state_bytes, dtype = 2 * GiB, 40 * GiB, "bf16"

        class model:
            params, n_layer, d_model = 10**9, 4, 2048
    result = {"init_peak_rss": 9 * GiB, "step_peak_rss": 2 * GiB,
              "steps": [{"seconds": 10.0, "bound_s": 5.0, "mixed_s": 4.0}]}
    v = bench_oversized._verdict(Spec, result, 16 * GiB)
    assert v["peak_rss_bytes"] == 9 * GiB and v["rss_limit_bytes"] == int(2.5 * GiB)
    assert v["rss_ok"] is False


def test_store_ratios_are_the_stores_rate_over_the_raw_engines():
    from offload.cli.bench_store import _rows as store_rows
    got = store_rows({"store": ([2.0, 1.0, 3.0], [1.0]), "raw": ([1.0], [0.5])}, 10**9)
    assert got["ratios"] == pytest.approx({"write": 0.5, "read": 0.5})


def test_demo_asks_for_twice_the_state_it_keeps_on_the_disk(tmp_path):
    """A step keeps the previous version of what it updates until it commits: the demo's
    disk check asks room for both, or a disk with room for one fills in the middle."""
    from offload.cli import demo
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    plan = demo.build_plan(p.parse_args(["--size", "small", "--trace", "none",
                                         "--swap-dir", str(tmp_path)]))
    assert plan.disk_needed() == 477752985


def test_oversized_forced_bytes_write_the_parameters_the_budgets_cannot_keep(tmp_path):
    """The optimizer's state both ways, plus, written, every updated parameter beyond
    what the memory budgets can hold (here four of six layers' worth)."""
    import types

    import torch

    import offload
    from offload.planner.sizes import state_bytes
    from offload.store import footprint
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "host",
                      "dtype": "bf16", "group_size": 64 * 65},
           "io": {"paths": [str(tmp_path / "swap")]}, "store": {"device": "cpu"}}
    with offload.initialize(model, cfg) as engine:
        sizes = [footprint(g.shard * 2) for g in engine.groups]
        spec = types.SimpleNamespace(dtype="bf16", memory=2 * sizes[0])
        read, written = bench_oversized.forced_bytes(engine, spec)
        state = sum(state_bytes(g.shard, 3, "fp32") for g in engine.groups)
    assert written == state + sum(sizes) - 2 * sizes[0]
    assert read >= state + sum(sizes) - 2 * sizes[0]


def test_io_ratios_are_against_the_fastest_reference_each_way():
    from offload.cli.bench_io import best_reference
    refs = [{"tool": "dd bs=1M", "write_GBps": 1.0, "read_GBps": 3.0},
            {"tool": "fio", "write_GBps": 2.0, "read_GBps": 1.5}]
    assert best_reference(refs) == {"tool": "best of dd bs=1M, fio", "write_GBps": 2.0,
                                    "read_GBps": 3.0}


def test_checkpoint_bench_passes_only_with_both_rates_and_the_stall_within_targets():
    from offload.cli.bench_checkpoint import TARGET_RATE, TARGET_STALL, passes
    good = {"ratio": TARGET_RATE}
    slow = {"ratio": TARGET_RATE * 0.9}
    assert passes(good, good, TARGET_STALL)
    assert not passes(good, slow, 0.0) and not passes(slow, good, 0.0)
    assert not passes(good, good, TARGET_STALL * 1.1)


def test_tune_bench_setting_without_an_ab_comparison_is_a_dash_and_a_failure(capsys):
    """The written configuration failed in the sweep, so no A/B median: its row printed
    by formatting None (a TypeError), and the command exited 0."""
    from offload.cli import bench_tune

    row = {"model": "mlp", "budget": "tight", "tune_s": 40.0, "tuned": None,
           "tuned_step_s": None, "sweep_best": "#3", "placements": {"#3": "host/host/host"},
           "sweep_best_step_s": None, "ratio": None, "errors": {"tuned": "ConfigError: x"}}
    result = {"sweep": 20, "rounds": 2, "ab_rounds": 10, "steps": 4, "results": [row],
              "targets": []}
    bench_tune.render(result)
    assert "mlp" in capsys.readouterr().out
    (line,) = bench_tune._unmeasured(result)
    assert line.startswith("offload bench tune: mlp tight: the written configuration was not "
                           "compared") and "tuned: ConfigError: x" in line
