"""[Note: a call that a Ctrl-C fails] in engine/interrupts.py: a Ctrl-C noted in the
engine's code late in `engine(...)`, `engine.backward()` or a direct call of the
model came after the call's work (a backward's gradient summed and counted), so
running the step's micro-batches again, as for any call that raised, counted one
twice. Raised inside the part that undoes the call, it drops the window, and the
rerun trains as an engine that never met the Ctrl-C."""

import pytest
import torch

from .test_interrupts import PLACEMENTS, _At, _engine, _model, _weights

# where the Ctrl-C lands: the engine's code after the model's last unit (its root's
# forward hook), after autograd's pass (the backward's nested-gradient reduction)
_LATE = {"forward": "_root_post", "direct": "_root_post", "backward": "_reduce_nested_grads"}


def _windows(engine, run, windows) -> None:
    for window in windows:  # a step's micro-batches, from the first
        for x in window:
            engine.backward(run(x).pow(2).mean())
        assert engine.step()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=["host", "nvme"])
@pytest.mark.parametrize("call", sorted(_LATE))
def test_a_ctrl_c_late_in_a_call_fails_it_whole(engine_cfg, tmp_path, placement, call):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, generator=g) for _ in range(4)]

    def accumulating(*placement, **engine):  # the second micro-batch's call is interrupted
        return engine_cfg(*placement, grad_accum_steps=2, **engine)
    engines = [_engine(accumulating, placement, _model(), tmp_path / name)
               for name in ("swap", "replay")]
    try:
        engine, replay = engines
        run = engine.module if call == "direct" else engine
        engine.backward(run(xs[0]).pow(2).mean())
        at = _At(where=lambda code: code.co_name == _LATE[call])
        with pytest.raises(KeyboardInterrupt):
            with at:
                out = run(xs[1])
                engine.backward(out.pow(2).mean())
        assert at.fired.startswith("hooks.py" if call != "backward" else "grads.py")
        _windows(engine, run, [xs[:2], xs[2:]])
        _windows(replay, replay, [xs[:2], xs[2:]])
        got, want = _weights(engine), _weights(replay)
    finally:
        for e in engines:
            e.close()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=0, rtol=0,
                                   msg=lambda m: f"{n} after {at.fired}: {m}")
