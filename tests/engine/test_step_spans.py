"""The engine marks each step in its own event trace: `offload view` of a loop that
records several steps shows one card per step without the loop marking them."""

import pytest
import torch

import offload
from offload.engine import StepFailedError
from offload.trace import TraceRecorder, to_chrome_trace
from offload.trace.analysis import parse_trace, steps_of


def _spans(rec: TraceRecorder, name: str) -> list[tuple[int, int, dict]]:
    return [(e.ts_ns, e.ts_ns + e.dur_ns, e.args or {}) for e in rec.events()
            if e.name == name and e.phase == "X"]


def test_each_step_is_one_span_holding_its_micro_batches(engine_cfg):
    """Two micro-batches a step, an evaluation forward between steps, a failed step
    and its retry: one `step` span per step() that ran, numbered, holding the step's
    forwards, backwards and optimizer phase, and not the evaluation; the report
    reads one step per span."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    rec = TraceRecorder(enabled=True)
    cfg = engine_cfg("host", group_size=300, grad_accum_steps=2)
    with offload.initialize(model, cfg, recorder=rec) as engine:
        x = torch.randn(4, 16)
        for _ in range(2):
            for _ in range(2):
                engine.backward(engine(x).square().mean())
            assert engine.step()
            with torch.no_grad():
                engine(x)  # evaluation: no step begins
        engine.backward(engine(x).square().mean())
        engine.zero_grad()  # the micro-batch is dropped: the step starts again
        for _ in range(2):
            engine.backward(model(x).square().mean())  # the model called directly
        engine.optimizer.param_groups[0]["lr"] = float("nan")
        with pytest.raises(StepFailedError):
            engine.step()
        engine.optimizer.param_groups[0]["lr"] = 1e-2
        for _ in range(2):
            engine.backward(engine(x).square().mean())
        assert engine.step()
    steps = _spans(rec, "step")
    assert [a for _, _, a in steps] == [{"step": 1}, {"step": 2},
                                        {"step": 3, "error": "ValueError"}, {"step": 3}]
    forwards = _spans(rec, "forward")
    assert len(forwards) == 2 * 2 + 2 + 1 + 2
    held = [sum(t0 <= f0 and f1 <= t1 for f0, f1, _ in forwards) for t0, t1, _ in steps]
    assert held == [2, 2, 0, 2]  # the evaluations and the dropped micro-batch lie outside
    for name, each in (("backward", [2, 2, 2, 2]), ("optimizer step", [1, 1, 1, 1])):
        spans = _spans(rec, name)
        assert [sum(t0 <= b0 and b1 <= t1 for b0, b1, _ in spans)
                for t0, t1, _ in steps] == each, name
    (rt,) = parse_trace(to_chrome_trace(rec))
    assert [s.label for s in steps_of(rt)] == ["step 1", "step 2", "step 3 (failed: ValueError)",
                                              "step 3"]


def test_a_loops_own_step_span_is_the_one_the_report_reads(engine_cfg):
    """A loop that marks its steps (as `offload demo` does) gets one step per mark, its
    own number, not the engine's span inside it as a second step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    rec = TraceRecorder(enabled=True)
    with offload.initialize(model, engine_cfg("host", group_size=100), recorder=rec) as engine:
        for step in (7, 8):
            with rec.span("step", cat="compute", track="compute", step=step):
                engine.backward(engine(torch.randn(2, 8)).sum())
                engine.step()
    assert len(_spans(rec, "step")) == 4
    (rt,) = parse_trace(to_chrome_trace(rec))
    assert [s.label for s in steps_of(rt)] == ["step 7", "step 8"]
