"""Ctrl-C anywhere in a training step ([Note: Ctrl-C at a safe point] in
engine/interrupts.py), and an error as a gradient hook starts.

A SIGINT runs the installed handler at whatever line the main thread runs.
`sys.settrace` runs it at one chosen line of offload's code instead, with that
line's frame, as Python would for a signal arriving there: each case is one exact
point. After it, the engine keeps working, and its weights equal those of an
engine that ran only the steps that committed."""

import copy
import random
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import offload
from offload.engine.interrupts import SafeInterrupts

OFFLOAD = str(Path(offload.__file__).parent)


class _At:
    """At the `nth` line event of offload's code in this thread (None: counts them), or
    at the start of the first function whose code `where(code)` accepts: `times`
    SIGINTs (the installed handler called with that line's frame), or raises `error`
    there instead. `counts(code)`: the code whose lines count, offload's or not
    (default: offload's under `within`)."""

    def __init__(self, nth: int | None = None, where=None, times: int = 1,
                 error: type[BaseException] | None = None, within: str = "",
                 sig: int = signal.SIGINT, counts=None) -> None:
        self.nth, self.where, self.times, self.error = nth, where, times, error
        self.sig = sig
        self.counts = counts or (lambda code: code.co_filename.startswith(OFFLOAD + within))
        self.lines, self.fired = 0, None

    def __enter__(self) -> "_At":
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        if self.fired is not None or not (frame.f_code.co_filename.startswith(OFFLOAD)
                                          or self.counts(frame.f_code)):
            return None
        if self.where is not None and self.where(frame.f_code):
            self._fire(frame)
        return self._line

    def _line(self, frame, event, arg):
        if event != "line" or self.fired is not None:
            return None
        if not self.counts(frame.f_code):
            return self._line
        self.lines += 1
        if self.nth is not None and self.lines >= self.nth:
            self._fire(frame)
        return self._line

    def _fire(self, frame) -> None:
        self.fired = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} " \
                     f"{frame.f_code.co_name}"
        if self.error is not None:
            raise self.error(self.fired)
        for _ in range(self.times):
            handler = signal.getsignal(self.sig)
            if callable(handler):
                handler(self.sig, frame)  # raises here, or notes it for later


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])


def _engine(engine_cfg, placement, model, swap: Path):
    cfg = engine_cfg(*placement, group_size=4200)
    # a move left waiting by an interrupt fails the test in seconds, not 300
    cfg["store"].update(host_budget="128KiB", device_budget="128KiB", wait_timeout=5.0)
    cfg["io"]["paths"] = [str(swap)]
    return offload.initialize(copy.deepcopy(model), cfg)


def _step(engine, x, direct: bool = False) -> None:
    engine.backward((engine.module(x) if direct else engine(x)).pow(2).mean())
    engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    with engine.full_weights() as w:
        return {n: t.clone() for n, t in w.items()}


def _interrupted_then_as_replayed(engine_cfg, tmp_path, placement, at: _At,
                                  direct: bool = False, raised=()) -> None:
    """Two clean steps, one step with `at` (the model called directly where `direct`),
    two clean steps; the weights equal an engine's that ran the committed steps only."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, generator=g) for _ in range(5)]
    engine = _engine(engine_cfg, placement, model, tmp_path / "swap")
    try:
        for x in xs[:2]:
            _step(engine, x)
        try:
            with at:
                _step(engine, xs[2], direct)
        except (KeyboardInterrupt, RuntimeError, *raised):
            engine.zero_grad()
        assert at.fired, "no line of offload's ran"
        committed = [0, 1] + [2] * (engine.global_step == 3) + [3, 4]
        for x in xs[3:]:
            _step(engine, x)
        got = _weights(engine)
    finally:
        engine.close()
    _as_replayed(engine_cfg, tmp_path, placement, [xs[i] for i in committed], got, at.fired)


def _as_replayed(engine_cfg, tmp_path, placement, batches, got, where="") -> None:
    """`got` equals the weights of an engine that ran a step on each of `batches`."""
    replay = _engine(engine_cfg, placement, _model(), tmp_path / "replay")
    try:
        for x in batches:
            _step(replay, x)
        want = _weights(replay)
    finally:
        replay.close()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=0, rtol=0,
                                   msg=lambda m: f"{n} after {where}: {m}")


PLACEMENTS = [("host", "host", "host"), ("nvme", "nvme", "nvme")]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=["host", "nvme"])
def test_an_error_as_a_gradient_hook_starts(engine_cfg, tmp_path, placement):
    """The hook that takes a group's accumulated `.grad` fails before it takes it (a
    reduction's error): the next backward must not add to that gradient."""
    at = _At(where=lambda code: code.co_name == "_on_grad", error=RuntimeError)
    _interrupted_then_as_replayed(engine_cfg, tmp_path, placement, at)
    assert at.fired.startswith("grads.py")


def _lines_of_a_step(engine_cfg, placement, swap: Path) -> int:
    engine = _engine(engine_cfg, placement, _model(), swap)
    try:
        x = torch.randn(8, 64)
        for _ in range(2):
            _step(engine, x)
        with _At() as count:
            _step(engine, x)
        return count.lines
    finally:
        engine.close()


@pytest.mark.parametrize("placement", [pytest.param(PLACEMENTS[0], marks=pytest.mark.slow),
                                       PLACEMENTS[1]], ids=["host", "nvme"])
def test_ctrl_c_at_lines_spread_over_a_step(engine_cfg, tmp_path, placement):
    """Lines drawn over the whole of a step's forward, backward and optimizer step, the
    store's bookkeeping included (a move registered and not yet queued, a pin taken
    and not yet recorded)."""
    total = _lines_of_a_step(engine_cfg, placement, tmp_path / "count")
    for i, nth in enumerate(sorted(random.Random(0).sample(range(1, total), 16))):
        _interrupted_then_as_replayed(engine_cfg, tmp_path / str(i), placement, _At(nth))


@pytest.mark.parametrize("sig, lines", [  # the same safe points either way: SIGINT at 16
    pytest.param(signal.SIGALRM, 40, marks=pytest.mark.slow),  # lines by default, SIGALRM
    (signal.SIGINT, 16)], ids=["SIGALRM", "SIGINT"])  # at 40 under slow
def test_a_programs_own_signal_handler_that_raises_at_lines_spread_over_a_step(
        engine_cfg, tmp_path, sig, lines):
    """A timeout or a Ctrl-C handler of the program's (it raises its own error) at
    lines drawn over a step: in offload's code it is run at the next safe point, so
    no pin or move is left half recorded (one was: every later step failed on a
    partition still pinned at its commit), and the weights equal a run of the
    committed steps."""
    def mine(signum, frame):
        raise TimeoutError("the program's own handler")
    before = signal.signal(sig, mine)
    try:
        total = _lines_of_a_step(engine_cfg, PLACEMENTS[1], tmp_path / "count")
        for i, nth in enumerate(sorted(random.Random(1).sample(range(1, total), lines))):
            _interrupted_then_as_replayed(engine_cfg, tmp_path / str(i), PLACEMENTS[1],
                                          _At(nth, sig=sig), raised=(TimeoutError,))
    finally:
        signal.signal(sig, before)


def test_ctrl_c_in_the_model_called_directly(engine_cfg, tmp_path):
    """Called directly (`engine.module(x)`, as `generate` calls it), the model's
    cleanup runs in a forward hook torch skips for a KeyboardInterrupt: the interrupt
    waits for the forward's end, and nothing stays "in use"."""
    model = _model()
    engine = _engine(engine_cfg, PLACEMENTS[0], model, tmp_path / "swap")
    hits = []

    def ctrl_c(module, args):
        if not hits:
            hits.append(module)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the model's own code
    engine.module[1].register_forward_pre_hook(ctrl_c)
    try:
        x = torch.randn(8, 64)
        with pytest.raises(KeyboardInterrupt):
            engine.module(x)
        assert hits
        _weights(engine)  # refused while a unit is in use
        with torch.no_grad():
            torch.testing.assert_close(engine.module(x), model(x), atol=1e-6, rtol=0)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        engine.close()


def _twice_in_fetch() -> "_At":
    """Two Ctrl-Cs in the engine's own code: the store's fetch, the next two times."""
    return _At(where=lambda code: code.co_filename.endswith("store.py")
               and code.co_name == "fetch", times=2)


def test_a_second_ctrl_c_is_obeyed_and_the_engine_says_it_cannot_be_trusted(engine_cfg,
                                                                            tmp_path):
    engine = _engine(engine_cfg, PLACEMENTS[0], _model(), tmp_path / "swap")
    x = torch.randn(8, 64)
    try:
        _step(engine, x)
        at = _twice_in_fetch()
        with pytest.raises(KeyboardInterrupt), at:
            _step(engine, x)
        for call in (lambda: engine(x), engine.step, engine.state_dict,
                     lambda: engine.save_checkpoint(tmp_path / "ckpt")):
            with pytest.raises(RuntimeError, match=r"a second Ctrl-C interrupted this engine "
                                                   r"inside its own code \(.*store\.py"):
                call()
        assert not (tmp_path / "ckpt").exists()
    finally:
        engine.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_reaches_the_programs_handler_after_the_first(engine_cfg, tmp_path):
    """Two Ctrl-Cs in the engine's code: the first is noted for a safe point, the second
    obeyed at once. The program's handler heard only the second, so one that stops
    after the step on the first Ctrl-C and at once on the second (the demo's) took it
    for the first: it returned, and the engine, broken, raised "a second Ctrl-C" at
    the next call, a traceback where the program meant to stop. It now hears both."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        if len(calls) == 2:
            raise KeyboardInterrupt("stop now")
    before = signal.signal(signal.SIGINT, handler)
    engine = _engine(engine_cfg, PLACEMENTS[0], _model(), tmp_path / "swap")
    x = torch.randn(8, 64)
    try:
        _step(engine, x)
        at = _twice_in_fetch()
        with pytest.raises(KeyboardInterrupt, match="stop now"), at:
            _step(engine, x)
        assert calls == [signal.SIGINT, signal.SIGINT]
    finally:
        engine.close()
        signal.signal(signal.SIGINT, before)


def test_a_second_ctrl_c_in_the_lr_lambda_leaves_the_engine_untrusted(engine_cfg, tmp_path):
    """The scheduler's step runs the program's lr lambda as engine state: a second
    Ctrl-C there cuts the schedule short half stepped, so, as in the engine's own code,
    every later call says the engine cannot be trusted (it used to go on, its schedule
    a step behind its optimizer)."""
    cfg = engine_cfg(*PLACEMENTS[0], group_size=4200)
    cfg["io"]["paths"] = [str(tmp_path / "swap")]

    def lam(k):
        if k == 2:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return 1.0
    engine = offload.initialize(_model(), cfg, lr_scheduler=lambda opt: LambdaLR(opt, lam))
    x = torch.randn(8, 64)
    try:
        _step(engine, x)
        with pytest.raises(KeyboardInterrupt):
            _step(engine, x)
        with pytest.raises(RuntimeError, match=r"a second Ctrl-C interrupted this engine "
                                               r"inside its own code \(the LR scheduler's step"):
            engine(x)
    finally:
        engine.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_program_with_its_own_sigint_handler_keeps_it(engine_cfg, tmp_path):
    """The program's own handler gets every SIGINT: at once in the model's code (a
    hook of the model's), and it is the handler again after the call."""
    engine = _engine(engine_cfg, PLACEMENTS[0], _model(), tmp_path / "swap")
    seen = []

    def mine(signum, frame):
        seen.append(signum)
    def interrupted(module, args):
        signal.raise_signal(signal.SIGINT)
        seen.append("after")
    engine.module[2].register_forward_pre_hook(interrupted)
    old = signal.signal(signal.SIGINT, mine)
    try:
        _step(engine, torch.randn(8, 64))
        assert seen == [signal.SIGINT, "after"]
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, old)
        engine.close()


@pytest.mark.parametrize("op", [  # state_dict's gathers: the full_weights cases below
    "save_checkpoint", "load_state_dict", pytest.param("state_dict", marks=pytest.mark.slow)])
def test_ctrl_c_in_a_call_between_steps_comes_at_its_end(engine_cfg, tmp_path, op):
    """A blocking save, a load, a state dict: a SIGINT at sampled lines of the store's
    code (its moves' bookkeeping) raises when the call ends; the weights are as before
    (the load's own values), and training, a save and its resume go on."""
    def call(engine, sub: Path):
        if op == "save_checkpoint":
            engine.save_checkpoint(sub / "ckpt")
        elif op == "load_state_dict":
            engine.load_state_dict(engine.state_dict())
        else:
            engine.state_dict()

    def unchanged(before, after, at):
        for n in before:
            assert torch.equal(after[n], before[n]), (n, at.fired)
    _interrupted_at_store_lines(engine_cfg, tmp_path, call, unchanged, seed=1)


def _interrupted_at_store_lines(engine_cfg, tmp_path, call, check, seed: int) -> None:
    """`call(engine, dir)` with a SIGINT at 8 sampled lines of the store's code, each on
    a fresh engine after one step: it raises KeyboardInterrupt, `check(before, after,
    at)` judges the weights, and training, a save and its resume go on."""
    x = torch.randn(8, 64)
    engine = _engine(engine_cfg, PLACEMENTS[1], _model(), tmp_path / "count")
    try:
        _step(engine, x)
        _weights(engine)  # as below
        with _At(within="/store/") as count:
            call(engine, tmp_path)
    finally:
        engine.close()
    lines = range(1, count.lines * 9 // 10)
    for i, nth in enumerate(sorted(random.Random(seed).sample(lines, 8))):
        sub = tmp_path / str(i)
        engine = _engine(engine_cfg, PLACEMENTS[1], _model(), sub / "swap")
        try:
            _step(engine, x)
            before = _weights(engine)
            at = _At(nth, within="/store/")
            with pytest.raises(KeyboardInterrupt), at:
                call(engine, sub)
            check(before, _weights(engine), at)
            _step(engine, x)
            engine.save_checkpoint(sub / "again")
            want = _weights(engine)
        finally:
            engine.close()
        cfg = engine_cfg(*PLACEMENTS[1], group_size=4200)
        cfg["io"]["paths"] = [str(sub / "resumed")]
        with offload.initialize(_model(), cfg, resume=sub / "again") as resumed:
            got = _weights(resumed)
        for n in want:
            assert torch.equal(got[n], want[n]), (n, at.fired)


@pytest.mark.parametrize("op", [  # "read": its gathers are "writable"'s first half
    pytest.param("read", marks=pytest.mark.slow), "writable", "by_group", "named_weights"])
def test_ctrl_c_in_a_full_weights_block_s_own_work_comes_at_its_end(engine_cfg, tmp_path, op):
    """`with engine.full_weights(...)` (also group by group, and `named_weights()`): a
    SIGINT at sampled lines of the store's code as it gathers or writes back weights
    raises when that part ends. The weights are then as before the block or, where the
    write-back was under way, as the block left them (never part of a group), and
    training, a save and its resume go on."""
    writable = op in ("writable", "by_group")

    def edit(w):
        for t in w.values():
            t.data.add_(1.0)

    def block(engine, _dir):
        if op == "named_weights":
            dict(engine.named_weights())
        elif op == "by_group":
            for w in engine.full_weights_by_group(writable=True):
                edit(w)
        else:
            with engine.full_weights(writable=writable) as w:
                if writable:
                    edit(w)

    def whole(before, after, at):
        edited = {n for n in before if torch.equal(after[n], before[n] + 1.0)}
        same = {n for n in before if torch.equal(after[n], before[n])}
        assert same | edited == set(before), at.fired  # each parameter whole
        assert not edited if not writable else (
            op == "by_group" or not same or not edited), at.fired
    _interrupted_at_store_lines(engine_cfg, tmp_path, block, whole, seed=2)


def test_a_periodic_timer_in_the_engines_code_leaves_it_working(engine_cfg, tmp_path):
    """A SIGALRM timer of the program's ticking every 0.2 ms through whole steps, its
    handler raising once, at the first tick from the 40th that lands in a step (a
    deadline; not in the test's own lines, which nothing guards): ticks noted again
    before a safe point made that error count as a second Ctrl-C, and the engine
    refused all work after it. It trains on, as an engine that ran the steps that committed."""
    ticks, stepping, raised = [], [False], []

    def tick(signum, frame):
        ticks.append(signum)
        if len(ticks) >= 40 and stepping[0] and not raised:
            raised.append(len(ticks))
            raise TimeoutError("the program's deadline")
    before = signal.signal(signal.SIGALRM, tick)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, generator=g) for _ in range(6)]
    engine = _engine(engine_cfg, PLACEMENTS[1], _model(), tmp_path / "swap")
    committed = []
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
        try:
            for i, x in enumerate(xs):
                try:
                    stepping[0] = True
                    _step(engine, x)
                    stepping[0] = False
                except TimeoutError:
                    stepping[0] = False
                    engine.zero_grad()
                if engine.global_step > len(committed):
                    committed.append(i)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        got = _weights(engine)
    finally:
        engine.close()
        signal.signal(signal.SIGALRM, before)
    assert raised
    _as_replayed(engine_cfg, tmp_path, PLACEMENTS[1], [xs[i] for i in committed], got)


def test_noted_signals_each_run_and_a_handler_replaced_meanwhile_stays(engine_cfg, tmp_path):
    """A handler that installs another while it runs during a call (first SIGUSR2: a
    softer one, then a harder one) leaves the program's choice in place after the call;
    two signals noted in the engine's code after its last safe point both run at the
    call's end, though the first raises (its error comes after the second ran)."""
    seen = []

    def first(signum, frame):
        seen.append("usr1")
        raise TimeoutError("the program's own")

    def harder(signum, frame):
        seen.append("harder")

    def soft(signum, frame):
        seen.append("usr2")
        signal.signal(signal.SIGUSR2, harder)
    old = {s: signal.signal(s, h) for s, h in ((signal.SIGUSR1, first),
                                                (signal.SIGUSR2, soft))}
    engine = _engine(engine_cfg, PLACEMENTS[0], _model(), tmp_path / "swap")

    def in_the_model(module, args):
        if not seen:
            signal.raise_signal(signal.SIGUSR2)  # at once: the model's code
    engine.module[1].register_forward_pre_hook(in_the_model)
    try:
        _step(engine, torch.randn(8, 64))
        assert seen == ["usr2"] and signal.getsignal(signal.SIGUSR2) is harder
        engine.backward(engine(torch.randn(8, 64)).pow(2).mean())
        last = [_At(where=lambda code: code.co_name == "_prefetch_state", sig=sig)
                for sig in (signal.SIGUSR1, signal.SIGUSR2)]

        def both(frame, event, arg):
            last[0]._call(frame, event, arg)
            return last[1]._call(frame, event, arg)
        sys.settrace(both)
        try:
            with pytest.raises(TimeoutError):
                engine.step()
        finally:
            sys.settrace(None)
        assert seen == ["usr2", "usr1", "harder"], seen
        assert signal.getsignal(signal.SIGUSR1) is first
        _step(engine, torch.randn(8, 64))  # the engine works on
    finally:
        engine.close()
        for s, h in old.items():
            signal.signal(s, h)


def test_a_step_applied_before_a_handlers_error_steps_the_scheduler(engine_cfg, tmp_path):
    """A SIGALRM handler's error that comes after the step's commit: the step is
    applied, and so is the LR scheduler's step (it fell one behind for good)."""
    def alarm(signum, frame):
        raise TimeoutError("the program's own timeout")
    before = signal.signal(signal.SIGALRM, alarm)
    cfg = engine_cfg("host", "host", "host", group_size=4200)
    cfg["io"]["paths"] = [str(tmp_path / "swap")]
    engine = offload.initialize(_model(), cfg, lr_scheduler=lambda opt:
                                torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    try:
        _step(engine, torch.randn(8, 64))
        switch = engine.staged.switch

        def late(*args, **kwargs):
            signal.raise_signal(signal.SIGALRM)
            return switch(*args, **kwargs)
        engine.staged.switch = late
        engine.backward(engine(torch.randn(8, 64)).pow(2).mean())
        with pytest.raises(TimeoutError):
            engine.step()
        assert engine.global_step == 2
        assert engine.lr_scheduler.last_epoch == 2
    finally:
        engine.close()
        signal.signal(signal.SIGALRM, before)


def test_ctrl_c_at_any_line_of_the_deferrals_own_start_and_end_leaves_it_working():
    """The deferral's own start and end run partly outside it: a Ctrl-C at a line of
    its end after SIGINT's handler was given back (the loop over the other signals')
    left it marked as installed, and the next engine call ran with no deferral at all.
    Each line in turn, with a program's own SIGALRM handler deferred too; then a call
    defers, and gives the handlers back at its end."""
    before = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    try:
        _each_line_of_the_deferral()
    finally:
        signal.signal(signal.SIGALRM, before)


def _each_line_of_the_deferral() -> None:
    k, fired = 0, True
    while fired:
        k, guard = k + 1, SafeInterrupts(on_forced=lambda where: None)
        with _At(k, within="/engine/interrupts.py") as at:
            try:
                with guard.held():
                    pass
            except KeyboardInterrupt:
                pass
        fired = at.fired is not None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, at.fired
        with guard.held():
            assert signal.getsignal(signal.SIGINT) == guard._handler, at.fired
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, at.fired
    assert k > 10


def _halving(epoch: int) -> float:  # the program's own lr lambda, over two lines
    factor = 0.5
    return factor ** epoch


@pytest.mark.parametrize("schedule", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _halving)], ids=["StepLR", "LambdaLR"])
def test_ctrl_c_in_the_lr_schedulers_step_leaves_it_whole(engine_cfg, tmp_path, schedule):
    """The scheduler's step that ends `engine.step()` is torch's code and the program's
    lr lambda, run for the engine: a Ctrl-C at a line of either (each in turn) left
    `last_epoch` advanced and the rate not set. It comes at the step's end, and the
    schedule is at the step count."""
    cfg = engine_cfg("host", "host", "host", group_size=4200)
    cfg["io"]["paths"] = [str(tmp_path / "swap")]
    engine = offload.initialize(_model(), cfg, lr_scheduler=schedule)
    lr = engine.optimizer.param_groups[0]["lr"]
    k, fired = 0, True
    try:
        while fired:
            k += 1
            engine.backward(engine(torch.randn(8, 64)).pow(2).mean())
            with _At(k, counts=lambda code: code.co_filename.endswith("optim/lr_scheduler.py")
                     or code is _halving.__code__) as at:
                try:
                    engine.step()
                except KeyboardInterrupt:
                    assert at.fired
            fired = at.fired is not None
            assert engine.lr_scheduler.last_epoch == engine.global_step == k
            assert engine.optimizer.param_groups[0]["lr"] == lr * 0.5 ** k
    finally:
        engine.close()
    assert k > 3


def test_ctrl_c_at_any_line_of_a_full_weights_blocks_own_work_leaves_it_whole(engine_cfg,
                                                                               tmp_path):
    """A writable `full_weights` block's own work runs partly outside the deferral (the
    one-thread bookkeeping, the steps between its gathering, the user's block and its
    write-back): a Ctrl-C at a line there left the block's stand-ins out and every
    later block refused. Each line of the engine's code in turn: the weights are then
    as before the block or as it left them, and the next block and a step go on."""
    engine = _engine(engine_cfg, PLACEMENTS[0], _model(), tmp_path / "swap")
    k, fired, kept = 0, True, None
    try:
        while fired:
            k, before = k + 1, _weights(engine)
            with _At(k, within="/engine/") as at:
                try:
                    with engine.full_weights(writable=True) as w:
                        for t in w.values():
                            t.data.add_(1.0)
                except KeyboardInterrupt as e:
                    kept = e  # its traceback kept, as a notebook keeps the last one's
            fired = at.fired is not None
            after = _weights(engine)
            edited = {n for n in before if torch.equal(after[n], before[n] + 1.0)}
            same = {n for n in before if torch.equal(after[n], before[n])}
            assert edited == set(before) or same == set(before), at.fired
        _step(engine, torch.randn(8, 64))
    finally:
        engine.close()
    assert k > 10 and kept is not None


@pytest.mark.parametrize("placement", PLACEMENTS, ids=["host", "nvme"])
def test_an_error_as_gathered_weights_borrow_the_record(engine_cfg, tmp_path, placement):
    """Gathered weights that would borrow the fetched record's memory fail as they
    take it: the pin the fetch took is given back, so later steps can move that
    record again, and the weights equal a run of the committed steps."""
    at = _At(where=lambda code: code.co_name == "borrow", error=RuntimeError)
    _interrupted_then_as_replayed(engine_cfg, tmp_path, placement, at)
    assert at.fired.startswith("warm.py"), at.fired



@pytest.mark.parametrize("fails", [False, True])
def test_a_signal_noted_in_a_commit_that_fails_still_reaches_the_programs_handler(fails):
    """A step's commit notes signals and delivers them at its end; where the commit
    raised, the noted SIGTERM was dropped and the program's handler never ran. It runs,
    as after a commit that succeeded; a Ctrl-C noted in a commit that failed is dropped
    (the error is on its way already)."""
    import os

    from offload.engine.step import uninterrupted

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with pytest.raises(RuntimeError if fails else KeyboardInterrupt):
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
                assert got == []
                if fails:
                    raise RuntimeError("commit failed")
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
