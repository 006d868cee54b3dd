"""Interruptions and exceptions as a user meets them, at each phase of the loop: a
KeyboardInterrupt or an error in the model's forward, its backward, the loss, the
user's code between backward and step, a SIGINT from another thread while the
engine waits, and the loop's calls out of order. After each, training goes on with
torch AdamW's numbers for the steps that ran, `close()` releases everything (threads,
swap files, hooks) and Python's SIGINT handler is back."""

import copy
import gc
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from offload.engine import training_checkpoint

PLACEMENTS = {"host": ("host", "host", "host"), "nvme": ("nvme", "nvme", "nvme")}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 32, generator=g) for _ in range(n)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _cfg(engine_cfg, placement: str, swap: Path) -> dict:
    cfg = engine_cfg(*PLACEMENTS[placement], group_size=1100)
    cfg["io"]["paths"] = [str(swap)]
    cfg["store"]["wait_timeout"] = 5.0  # a move left waiting fails in seconds
    return cfg


def _step(engine, x: torch.Tensor) -> bool:
    engine.backward(_loss(engine(x)))
    return engine.step()


def _as_torch(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch AdamW's weights after one step on each of `batches`."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x in batches:
        opt.zero_grad()
        _loss(model(x)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_weights(engine, want: dict[str, torch.Tensor]) -> None:
    with engine.full_weights() as w:
        for n in want:
            torch.testing.assert_close(w[n], want[n], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{n}: {m}")


_EARLIER: set[threading.Thread] = set()  # threads of engines other tests left to the collector


@pytest.fixture(autouse=True)
def _earlier_threads():
    gc.collect()
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate())
    yield


def _offload_threads() -> list[str]:
    """The names of offload's threads this test started and that are still alive."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith("offload-") and t not in _EARLIER]


def _assert_no_threads() -> None:
    deadline = time.monotonic() + 3.0  # a reaper notices its end within a second
    while _offload_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _offload_threads() == []


def _assert_released(engine, swap: Path) -> None:
    """Closed for good: no thread of offload's, no swap file, no hook, Python's handler."""
    _assert_no_threads()
    assert not swap.exists() or list(swap.iterdir()) == []
    assert engine._hooks == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.randn(2, 32))


class _RaisesInBackward(torch.autograd.Function):
    """Identity whose backward raises `error` (a user's custom autograd Function)."""

    @staticmethod
    def forward(ctx, t, error):
        ctx.error = error
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


def _fail_in(engine, where: str, x: torch.Tensor) -> None:
    """One step that fails at `where`, as a user's code would make it fail."""
    layer = engine.module[1]
    if where == "forward hook":
        h = layer.register_forward_hook(lambda m, a, out: (_ for _ in ()).throw(
            KeyboardInterrupt()))
        try:
            engine(x)
        finally:
            h.remove()
    elif where == "sigint in forward":
        h = layer.register_forward_pre_hook(lambda m, a: signal.raise_signal(signal.SIGINT))
        try:
            engine(x)
        finally:
            h.remove()
    elif where in ("autograd function", "ctrl-c in autograd function"):
        error = ValueError("user's backward") if where == "autograd function" \
            else KeyboardInterrupt()
        h = layer.register_forward_hook(lambda m, a, out: _RaisesInBackward.apply(out, error))
        try:
            loss = _loss(engine(x))
        finally:
            h.remove()
        engine.backward(loss)
    elif where == "tensor hook":
        def hook(m, a, out):
            out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("tensor hook")))
        h = layer.register_forward_hook(hook)
        try:
            loss = _loss(engine(x))
        finally:
            h.remove()
        engine.backward(loss)
    elif where == "loss":
        out = engine(x)
        raise ValueError(f"loss of {tuple(out.shape)}")
    else:
        raise AssertionError(where)


WHERE = ["forward hook", "sigint in forward", "autograd function",
         "ctrl-c in autograd function", "tensor hook", "loss"]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_step_that_fails_in_the_user_s_code_leaves_training_as_torch(engine_cfg, tmp_path,
                                                                       placement):
    """A KeyboardInterrupt or an error raised in a forward hook, a module's forward, a
    custom autograd Function's backward, a tensor hook or the loss: each raises to
    the user unchanged, and the training that goes on (without re-running the failed
    batch) gives torch AdamW's weights for the batches that stepped."""
    model, xs = _model(), _batches(2 + len(WHERE))
    swap = tmp_path / "swap"
    engine = offload.initialize(copy.deepcopy(model), _cfg(engine_cfg, placement, swap))
    stepped = []
    try:
        assert _step(engine, xs[0])
        stepped.append(xs[0])
        for i, where in enumerate(WHERE):
            with pytest.raises((KeyboardInterrupt, ValueError, RuntimeError)) as err:
                _fail_in(engine, where, xs[1 + i])
            assert "closed" not in str(err.value)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
            assert engine.step() is False, where  # nothing of the failed step to apply
            assert _step(engine, xs[-1 - i]), where
            stepped.append(xs[-1 - i])
        _assert_weights(engine, _as_torch(model, stepped))
    finally:
        engine.close()
    _assert_released(engine, swap)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_loop_s_calls_out_of_order_and_an_error_between_backward_and_step(
        engine_cfg, tmp_path, placement):
    """step() before any backward, step() twice, backward twice without a step (the
    second refused), and an exception in the user's code between backward and step:
    the backward that ran is the one the next step() applies, as torch would."""
    model, xs = _model(), _batches(4)
    swap = tmp_path / "swap"
    engine = offload.initialize(copy.deepcopy(model), _cfg(engine_cfg, placement, swap))
    try:
        assert engine.step() is False
        engine.backward(_loss(engine(xs[0])))
        with pytest.raises(RuntimeError, match="call engine.step"):
            engine.backward(_loss(engine(xs[1])))
        assert engine.step() is True
        assert engine.step() is False
        with pytest.raises(ZeroDivisionError):
            engine.backward(_loss(engine(xs[2])))
            1 / 0  # the user's logging, between backward and step
        assert engine.step() is True
        assert _step(engine, xs[3])
        _assert_weights(engine, _as_torch(model, [xs[0], xs[2], xs[3]]))
    finally:
        engine.close()
    _assert_released(engine, swap)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_with_block_closes_the_engine_on_an_exception(engine_cfg, tmp_path, placement):
    """`with offload.initialize(...) as engine:` left by a KeyboardInterrupt mid-backward
    closes the engine: threads, swap files and hooks are gone."""
    swap = tmp_path / "swap"
    with pytest.raises(KeyboardInterrupt):
        with offload.initialize(_model(), _cfg(engine_cfg, placement, swap)) as engine:
            _fail_in(engine, "ctrl-c in autograd function", _batches(1)[0])
    _assert_released(engine, swap)


def _sigint_after(seconds: float, times: int) -> threading.Thread:
    """`times` SIGINTs from another thread, each `seconds` after the last, to the main
    thread as Ctrl-C in the terminal reaches it: a wait there is interrupted (where
    `signal.raise_signal` on the sending thread would run the handler only once the
    main thread's wait ended)."""
    def send():
        for _ in range(times):
            time.sleep(seconds)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.mark.parametrize("times", [1, pytest.param(2, marks=pytest.mark.slow)],  # 3.6 s each
                         ids=["ctrl-c", "twice"])
def test_ctrl_c_while_close_waits_for_a_background_save(engine_cfg, tmp_path, monkeypatch,
                                                        times):
    """Ctrl-C while `close()` waits for a save in the background: the close still
    releases everything (threads, swap files, hooks), and the save is published. A
    second Ctrl-C stops the wait at once; closing again finishes the job."""
    slow = training_checkpoint._SaveJob.run

    def run(job):
        time.sleep(0.4)  # a large checkpoint: the close waits for it
        slow(job)
    monkeypatch.setattr(training_checkpoint._SaveJob, "run", run)
    swap = tmp_path / "swap"
    engine = offload.initialize(_model(), _cfg(engine_cfg, "nvme", swap))
    timer = None
    try:
        assert _step(engine, _batches(1)[0])
        saving = engine.save_checkpoint(tmp_path / "ckpt", blocking=False)
        timer = _sigint_after(0.1, times)
        with pytest.raises(KeyboardInterrupt):
            engine.close()
            time.sleep(1.0)  # the SIGINTs land after the close, if it was quick
        if times == 2:
            assert not saving.done()  # the second one ended the wait
    finally:
        while timer is not None and timer.is_alive():
            try:  # a SIGINT left over (where the close ended early) must not stop pytest
                timer.join()
            except KeyboardInterrupt:
                pass
        engine.close()  # a close cut short is finished by the next
    assert saving.done()
    _assert_released(engine, swap)
    assert (tmp_path / "ckpt").is_dir()


def test_a_ctrl_c_inside_the_stores_close_is_finished_by_the_next_close(engine_cfg, tmp_path,
                                                                       monkeypatch):
    """A release cut short inside the store's close (a Ctrl-C there, or moves that did
    not end in time) is not counted as done: the next close() releases the threads and
    swap files. The optimizer lets go of its state at the first, and a closed engine
    collected later warns of nothing."""
    import gc
    import warnings

    swap = tmp_path / "swap"
    engine = offload.initialize(_model(), _cfg(engine_cfg, "nvme", swap))
    assert _step(engine, _batches(1)[0])
    opt, store = engine.optimizer, engine._owned.store
    close, calls = store.close, []

    def cut_short():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        close()
    monkeypatch.setattr(store, "close", cut_short)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert opt._parts == {}  # the masters and moments are not kept by a closed engine
    engine.close()
    assert len(calls) == 2
    _assert_released(engine, swap)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del engine, opt, store
        monkeypatch.undo()
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], seen


def test_ctrl_c_during_initialize_is_not_lost(engine_cfg, tmp_path):
    """Ctrl-C while initialize writes the parameters to NVMe stops initialize with a
    KeyboardInterrupt, leaving no engine, thread or swap file behind. (It landed in a
    store move's own step, which failed that move only: logged, the partition kept
    in HOST, and initialize returned as if no Ctrl-C came.)"""
    from .test_interrupts import _At

    swap = tmp_path / "swap"
    at = _At(where=lambda code: code.co_filename.endswith("swap.py")
             and code.co_name == "_host_span")
    engine = None
    try:
        with pytest.raises(KeyboardInterrupt), at:
            engine = offload.initialize(_model(), _cfg(engine_cfg, "nvme", swap))
        assert at.fired
    finally:
        if engine is not None:
            engine.close()
    _assert_no_threads()
    assert list(swap.iterdir()) == []


@pytest.mark.parametrize("placement", ["host", "nvme"])
@pytest.mark.parametrize("where", ["_open_owned", "_make_post", "place_new_group",
                                   "drop_params", "guard_resize"])
def test_ctrl_c_during_initialize_leaves_the_model_as_it_was(engine_cfg, tmp_path, where,
                                                              placement):
    """[Note: a failed initialize leaves the model as it was] A Ctrl-C noted in
    initialize's last lines is raised at their end, after the model's parameters were
    handed over: before, the model was left with a closed engine's stand-ins, its
    weights gone (and initialize refused it again: already wrapped). One while a swap
    file is opened, or while the engine registers its hooks on the model, comes once
    the store and the engine are made: it left a swap file, or hooks of a closed
    store on the model ("the tiered store is closed" at its next forward)."""
    from .test_interrupts import _At

    model = _model()
    params = dict(model.named_parameters())
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = _cfg(engine_cfg, placement, tmp_path / "swap")
    at = _At(where=lambda code: code.co_name == where)
    interval = sys.getswitchinterval()
    with pytest.raises(KeyboardInterrupt), at:
        offload.initialize(model, cfg)
    assert at.fired and where in at.fired
    assert list((tmp_path / "swap").iterdir()) == []
    assert sys.getswitchinterval() == interval
    assert all(p is params[n] for n, p in model.named_parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k
    _assert_no_threads()
    want = _as_torch(model, _batches(1))
    with offload.initialize(model, cfg) as engine:  # given again, it trains as torch
        assert _step(engine, _batches(1)[0])
        for n, v in engine.state_dict().items():
            torch.testing.assert_close(v, want[n], rtol=0, atol=1e-6)
