"""One engine used from several threads, and from inside its own calls, as notebooks,
training scripts with metric threads and servers of a model in training use it
([Note: one thread at a time] in offload/engine/one_thread.py): a call on a second
thread while a forward or a step runs on the first is refused at once, naming that
thread, and changes nothing; calls that change the training state are refused from
inside another call on the same thread (a forward hook, an lr schedule, an autograd
hook); a direct call of the model cut short by a KeyboardInterrupt does not keep the
engine held. Each scenario runs its second party on a real thread with a join
timeout, and the weights are checked against plain torch AdamW."""

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import offload
from offload.engine.one_thread import EngineBusyError, OneThread

from ..conftest import run_together

JOIN = 30  # seconds: a hang fails the test instead of the suite


class Gate(nn.Module):
    """A Linear whose forward waits for `go` once `block` is set (and says it is inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.block = False

    def forward(self, h):
        if self.block:
            self.block = False
            GATE.inside.set()
            assert GATE.go.wait(JOIN)
        return self.lin(h)


class _Events:
    inside = go = threading.Event()


GATE = _Events()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.gate = Gate()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.gate(torch.tanh(self.a(x))))


def _data(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _setup(engine_cfg, lr_lambda=None, **engine):
    """(reference model, its AdamW, the engine of a copy): one group per Linear."""
    GATE.inside, GATE.go = threading.Event(), threading.Event()
    torch.manual_seed(0)
    ref = Net()
    cfg = engine_cfg("host", "host", "host", **{"group_size": 200, **engine})
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg["optim"]["lr"],
                            weight_decay=cfg["optim"]["weight_decay"])
    return ref, opt, offload.initialize(copy.deepcopy(ref), cfg, lr_lambda=lr_lambda)


def _torch_step(ref, opt, x, y):
    opt.zero_grad()
    _loss(ref, x, y).backward()
    opt.step()


def _compare(engine, ref):
    got = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def _run(target):
    """`target` on a new thread; (thread, its outcome dict)."""
    out = {}

    def body():
        try:
            out["value"] = target()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e
    t = threading.Thread(target=body, name="trainer")
    t.start()
    return t, out


def _on_thread_ok(target):
    """Runs `target` on a new thread, which must end without an error."""
    t, got = _run(target)
    t.join(JOIN)
    assert not t.is_alive() and "error" not in got, got


def _step_as_torch(engine, ref, opt, x, y):
    engine.backward(_loss(engine, x, y))
    assert engine.step() is True
    _torch_step(ref, opt, x, y)
    _compare(engine, ref)


def _others(engine, tmp_path, x, y):
    """Every kind of engine call, for a second party to try."""
    def full():
        with engine.full_weights():
            pass

    def named():
        return list(engine.named_weights())

    def forward():
        with torch.no_grad():
            return engine(x)
    calls = {"step": engine.step, "zero_grad": engine.zero_grad,
             "state_dict": engine.state_dict, "full_weights": full, "named_weights": named,
             "forward": forward, "model": lambda: engine.module(x),
             "backward": lambda: engine.backward(_loss(engine.module, x, y)),
             "save_checkpoint": lambda: engine.save_checkpoint(tmp_path / "ck"),
             "load_state_dict": lambda: engine.load_state_dict(engine.module.state_dict()),
             "close": engine.close}
    if any(u.module in (engine.module.gate, engine.module.gate.lin) for u in engine.units):
        calls["submodule"] = lambda: engine.module.gate(torch.ones(4, 16))  # a unit in it
    return calls


def _others_refused(engine, tmp_path, x, y, t, go, match):
    """Every kind of call from this thread is refused (EngineBusyError matching `match`)
    while thread `t` is inside its call; then `go` lets that call end."""
    try:
        for call in _others(engine, tmp_path, x, y).values():
            with pytest.raises(EngineBusyError, match=match):
                call()
    finally:
        go.set()
        t.join(JOIN)


@pytest.mark.parametrize("group_size", [200, 100_000], ids=["units", "one-unit"])
def test_calls_on_another_thread_during_a_forward_are_refused_and_change_nothing(
        engine_cfg, tmp_path, group_size):
    """An evaluation forward between backward and step on one thread, and a metrics
    thread's step (or zero_grad, save, state_dict, close, ...): the step used to commit
    in the middle of the forward (its first unit ran with the old weights, the rest with
    the new ones) and a close pulled the store from under it. Now each is refused
    naming the thread and its call; the forward and the step that follows are torch's.
    `one-unit`: the model is one unit, whose hooks are the root's too."""
    ref, opt, engine = _setup(engine_cfg, group_size=group_size)
    (x, y), = _data(1)
    with engine:
        engine.backward(_loss(engine, x, y))
        with torch.no_grad():
            want = ref(x)  # the forward's weights: before the step
        engine.module.gate.block = True
        t, got = _run(_others(engine, tmp_path, x, y)["forward"])
        assert GATE.inside.wait(JOIN)
        _others_refused(engine, tmp_path, x, y, t, GATE.go, r"on thread 'MainThread': this "
                        r"engine is running on another thread.*thread 'trainer' is in "
                        r"engine\(\.\.\.\).*Nothing was changed")
        assert not t.is_alive() and "error" not in got
        torch.testing.assert_close(got["value"], want, atol=1e-6, rtol=0)
        assert engine.step() is True  # the step's gradients were kept
        _torch_step(ref, opt, x, y)
        _compare(engine, ref)


def test_a_submodule_called_by_itself_on_another_thread_holds_the_engine(engine_cfg,
                                                                       tmp_path):
    """A unit's module called directly (`model.gate(h)`, an evaluation of one block) on a
    second thread passed the one-thread check, which only the root module's hook made:
    a training loop beside it freed and gathered the unit's weights under it (steps
    failed on pinned partitions, or trained off torch's numbers). It is a call of its
    own now: the others are refused while it runs, and its output is torch's."""
    ref, opt, engine = _setup(engine_cfg, whole_modules=["gate"])  # a unit
    (x, y), = _data(1)
    h = torch.randn(4, 16)
    with engine:
        assert any(u.module is engine.module.gate for u in engine.units)
        engine.module.gate.block = True
        t, got = _run(lambda: engine.module.gate(h))
        assert GATE.inside.wait(JOIN)
        _others_refused(engine, tmp_path, x, y, t, GATE.go, r"thread 'trainer' is in the "
                        r"forward of unit gate.*Nothing was changed")
        assert not t.is_alive() and "error" not in got
        torch.testing.assert_close(got["value"], ref.gate(h), atol=1e-6, rtol=0)
        _step_as_torch(engine, ref, opt, x, y)
        _on_thread_ok(lambda: engine.module.gate(h))  # free again: it runs
        _step_as_torch(engine, ref, opt, x, y)


def test_calls_on_another_thread_during_a_step_are_refused_and_the_step_commits(
        engine_cfg, tmp_path):
    """A step on the trainer thread (held in its lr schedule, user code inside the step)
    and a server thread's forward, a second step, zero_grad, a save or close: the
    second step ran beside the first (both committed, or the first failed with "partition
    ... is pinned" and lost its gradients), a zero_grad or save made the step fail. Now
    each is refused; the step commits once, as torch's."""
    inside, go, state = threading.Event(), threading.Event(), {"block": False}

    def lr_lambda(k):
        if state["block"]:
            state["block"] = False
            inside.set()
            assert go.wait(JOIN)
        return 1.0
    ref, opt, engine = _setup(engine_cfg, lr_lambda)
    (x, y), = _data(1)
    with engine:
        engine.backward(_loss(engine, x, y))
        state["block"] = True
        t, got = _run(engine.step)
        assert inside.wait(JOIN)
        _others_refused(engine, tmp_path, x, y, t, go,
                        r"thread 'trainer' is in engine\.step\(\).*Nothing was changed")
        assert not t.is_alive() and got == {"value": True}, got
        assert engine.global_step == 1
        _torch_step(ref, opt, x, y)
        _compare(engine, ref)


def test_state_changes_from_inside_a_call_on_the_same_thread_are_refused(engine_cfg):
    """A step or zero_grad from the model's forward hook, a step from the lr schedule
    inside a step, a backward or a step inside a
    writable full_weights block (whose end writes the block's weights back):
    each is refused saying to call it after the outer call returned, and training goes
    on as torch's."""
    seen: list[str] = []

    def attempt(call):
        try:
            call()
        except RuntimeError as e:
            seen.append(str(e))
    engine_box = {}

    def lr_lambda(k):
        if "engine" in engine_box:  # once: it is called for each group
            attempt(engine_box.pop("engine").step)
        return 1.0
    ref, opt, engine = _setup(engine_cfg, lr_lambda)
    engine_box["engine"] = engine
    data = _data(2)
    with engine:
        x, y = data[0]
        engine.backward(_loss(engine, x, y))
        h = engine.module.head.register_forward_hook(
            lambda m, a, o: (attempt(engine.step), attempt(engine.zero_grad)))
        with torch.no_grad():
            engine(x)
        h.remove()
        assert engine.step() is True  # the lr schedule's step inside was refused
        _torch_step(ref, opt, x, y)
        assert len(seen) == 3 and all("on the same thread" in s and "Nothing was changed"
                                      in s for s in seen), seen
        assert "engine.step() was called inside engine.step()" in seen[2]

        x, y = data[1]
        out = engine(x)
        # a forward inside backward runs as a checkpoint's recomputation does: part
        # of engine.backward(), not refused, and the step is torch's
        out.register_hook(lambda g: attempt(lambda: engine(x)))
        engine.backward(nn.functional.mse_loss(out, y))
        assert len(seen) == 3, seen
        assert engine.step() is True
        _torch_step(ref, opt, x, y)
        with engine.full_weights(writable=True):
            attempt(lambda: engine.backward(_loss(engine, x, y)))
            attempt(engine.step)
        assert "engine.backward() was called inside engine.full_weights()" in seen[3]
        assert "engine.step() was called inside engine.full_weights()" in seen[4]
        _compare(engine, ref)


def test_a_keyboard_interrupt_inside_the_model_called_directly_leaves_the_engine_free(
        engine_cfg):
    """torch skips the always-called forward hooks for a KeyboardInterrupt, so the end
    of a direct call of the model that one interrupted never came: every other thread
    was refused from then on as if the forward still ran. Now the next call finds the
    call's frame gone and goes on, on this thread and on another."""
    ref, opt, engine = _setup(engine_cfg)
    (x, y), = _data(1)

    class Stop(nn.Module):
        def forward(self, h):
            raise KeyboardInterrupt
    with engine:
        hook = engine.module.gate.register_forward_pre_hook(lambda m, a: Stop()(a[0]))
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            engine.module(x)
        hook.remove()
        _on_thread_ok(lambda: engine.state_dict())
        _step_as_torch(engine, ref, opt, x, y)


def test_an_engine_dropped_after_a_keyboard_interrupt_in_the_model_is_collected(
        engine_cfg):
    """The direct call a KeyboardInterrupt cut short keeps its frame, which holds the
    model and its engine: the engine's exit bookkeeping held that record for ever, so a
    dropped engine's threads, memory and swap files stayed until the interpreter
    exited."""
    _, _, engine = _setup(engine_cfg)
    (x, _), = _data(1)
    model = engine.module

    class Stop(nn.Module):
        def forward(self, h):
            raise KeyboardInterrupt
    hook = model.gate.register_forward_pre_hook(lambda m, a: Stop()(a[0]))
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(x)
    hook.remove()
    with torch.no_grad():
        model(x)
    alive = weakref.ref(engine)
    del engine, model
    gc.collect()
    assert alive() is None


def test_a_call_cut_short_is_dropped_alone():
    """A direct call whose end torch skipped is dropped at the next conflict, and only
    it: the live call recorded after it was dropped too, and another thread's step ran
    beside it."""
    guard = OneThread()

    def _call_impl():  # as torch's, whose forward hook a KeyboardInterrupt skipped
        guard.enter("the model's forward", direct=True)
    _call_impl()
    with guard.held("engine(...)"):
        t, got = _run(lambda: guard.enter("engine.step()", outer=True, sealed=True))
        t.join(JOIN)
        assert isinstance(got.get("error"), EngineBusyError), got
        assert [c.what for c in guard._calls] == ["engine(...)"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_around_the_engine_call_recomputes_inside_backward(engine_cfg,
                                                                        reentrant):
    """`torch.utils.checkpoint(engine, x)` recomputes `engine(...)` inside
    `engine.backward()`: a part of that call, not a second call nested in it."""
    ref, opt, engine = _setup(engine_cfg)
    (x, y), = _data(1)
    with engine:
        out = torch.utils.checkpoint.checkpoint(engine, x.requires_grad_(reentrant),
                                                use_reentrant=reentrant)
        engine.backward(nn.functional.mse_loss(out, y))
        assert engine.step() is True
        _torch_step(ref, opt, x, y)
        _compare(engine, ref)


def test_a_call_ended_on_another_thread_frees_the_engine(engine_cfg):
    """A generator's `finally` runs on the thread that closes (or collects) it: a
    `full_weights_by_group` loop left on one thread and closed on another kept the
    engine held for ever, `close()` included."""
    ref, opt, engine = _setup(engine_cfg)
    (x, y), = _data(1)
    with engine:
        it = engine.full_weights_by_group()
        next(it)
        _on_thread_ok(it.close)
        _step_as_torch(engine, ref, opt, x, y)


def test_the_calls_of_a_thread_that_ended_inside_them_hold_nothing():
    """A thread that ended inside a call (a generator it never closed, never
    collected) no longer holds the engine: the next call from another thread goes on."""
    guard = OneThread()
    _on_thread_ok(lambda: guard.enter("engine.full_weights_by_group()"))
    with guard.held("engine.state_dict()"):
        pass
    guard.enter("engine(...)")
    t, got = _run(lambda: guard.enter("engine.step()", outer=True))
    t.join(JOIN)
    assert isinstance(got.get("error"), EngineBusyError), got


def _held_by_a_function(guard):
    with guard.held("engine.step()", outer=True, sealed=True):  # as `one_call` holds one
        pass


def _held_by_a_generator(guard):
    def weights():  # as `named_weights` holds one
        with guard.held("engine.named_weights()"):
            yield 1
    list(weights())


@pytest.mark.parametrize("call", [_held_by_a_function, _held_by_a_generator])
def test_a_keyboard_interrupt_at_any_line_of_the_calls_bookkeeping_leaves_the_engine_free(
        call):
    """A Ctrl-C landing in the bookkeeping of an engine call (it runs outside the
    engine's deferral: [Note: a lock and Ctrl-C] in one_thread.py) left the call
    recorded (every later `zero_grad()` and `close()` refused as called inside it) or
    the lock held (the next call waited for ever). Each line in turn."""
    from .test_interrupts import _At
    fired, k = True, 0
    while fired:
        k, guard = k + 1, OneThread()
        with _At(k, within="/engine/one_thread.py", error=KeyboardInterrupt) as at:
            try:
                call(guard)
            except KeyboardInterrupt:
                assert at.fired
        fired = at.fired is not None
        assert not guard._lock.locked(), f"the lock is held after line {k}"
        with guard.held("engine.close()", outer=True, sealed=True):
            pass
    assert k > 10


def test_a_with_block_that_raises_while_another_thread_runs_keeps_its_own_error(
        engine_cfg, caplog):
    """`with engine:` whose block raises while a server thread's forward runs: the
    exit's close() is refused, and that refusal used to replace the block's error.
    The block's error comes out; a warning says the engine is still open."""
    _, _, engine = _setup(engine_cfg)
    (x, _), = _data(1)
    engine.module.gate.block = True
    t, got = _run(lambda: engine(x).detach())
    assert GATE.inside.wait(JOIN)
    try:
        with pytest.raises(ValueError, match="the block's own"):
            with engine:
                raise ValueError("the block's own")
        assert "the engine was not closed" in caplog.text
    finally:
        GATE.go.set()
        t.join(JOIN)
    assert not t.is_alive() and "error" not in got, got
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine(x)


_DAEMON = """
import sys, threading, time
import torch
import offload
cfg = {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme", "group_size": 300},
       "io": {"paths": [sys.argv[1]]},
       "store": {"host_budget": "1MiB", "device_budget": "1MiB", "device": "cpu"}}
engine = offload.initialize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)),
                            cfg)
def train():
    while True:
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
def infer():
    for _ in range(100):
        with torch.no_grad():
            engine(torch.randn(4, 8))
        time.sleep(0.005)
    print("all forwards done", flush=True)
daemon = sys.argv[2] == "daemon"
threading.Thread(target=train if daemon else infer, daemon=daemon).start()
time.sleep(1.0 if daemon else 0.1)  # the script ends while its thread works
"""


def test_a_daemon_thread_training_at_exit_ends_quietly(tmp_path):
    """A script that ends while a daemon thread it never joined is inside a step: the
    exit released the engine under the call, which raised "cannot schedule new futures
    after shutdown" or "the tiered store is closed" into a traceback. The call ends
    first, the thread's next call ends the thread, and the swap files are removed."""
    import sys
    kinds = ("daemon", "daemon", "joined")
    runs = run_together([[sys.executable, "-c", _DAEMON, str(tmp_path / f"swap{i}"), kind]
                         for i, kind in enumerate(kinds)])  # each its own swap directory
    for i, (kind, out) in enumerate(zip(kinds, runs)):
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert not list((tmp_path / f"swap{i}").glob("*.swap"))
        # a thread the exit joins is not cut short
        assert ("all forwards done" in out.stdout) == (kind == "joined"), out.stdout


def test_the_update_thread_starts_at_initialize(engine_cfg):
    """The update thread used to start at the first early update's `submit`, which
    queues the work first: under a thread limit, backward raised and the queued update
    ran in the next step's thread, on that step's state (a KeyError on a retried
    step). Started at initialize, a limit fails initialize, before any state."""
    ref, opt, engine = _setup(engine_cfg)
    with engine:
        threads = list(engine._updater._threads)
        assert threads and all(t.is_alive() for t in threads)
        assert any(t.name.startswith("offload-update") for t in threading.enumerate())
    assert not any(t.is_alive() for t in threads)  # close joins it


def test_close_lets_go_of_the_warm_gather_memory(engine_cfg):
    """Freed gather storage kept for reuse ([Note: warm gather memory]) goes at close:
    held past it, every closed engine kept up to its limit of host memory. (A frozen
    group's gathers take warm memory; a trainable one borrows its record's.)"""
    torch.manual_seed(0)
    model = Net()
    model.a.requires_grad_(False)
    engine = offload.initialize(model, engine_cfg("host", "host", "host", group_size=200))
    warm = engine._warm
    with engine:
        for x, y in _data(2):
            engine.backward(_loss(engine, x, y))
            engine.step()
        assert warm._free and warm._held > 0
    assert not warm._free and warm._held == 0


def test_a_plain_backward_of_a_graph_made_before_close_says_the_engine_is_closed(engine_cfg):
    """loss.backward() of a forward run before close() said to call engine.backward(loss)
    instead, which then said the engine was closed: it says so at once."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    engine = offload.initialize(model, engine_cfg(group_size=20))
    loss = engine(torch.randn(2, 4)).sum()
    engine.close()
    with pytest.raises(RuntimeError, match=r"this OffloadEngine is closed"):
        loss.backward()


def test_a_call_from_the_engines_own_thread_is_named_so(engine_cfg, tmp_path):
    """With the optimizer on NVMe, `lr_lambda` runs on the engine's update thread during
    backward; an engine call from it was refused as one from "another thread", telling
    the user to take a lock or give each thread an engine. It names the engine's own
    thread and the call it is inside, and training goes on."""
    errors = []
    box = {}

    def lam(step):
        if step == 1 and not errors:
            try:
                box["engine"].save_checkpoint(tmp_path / "ck")
            except EngineBusyError as e:
                errors.append(str(e))
        return 1.0

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with offload.initialize(model, engine_cfg("host", "host", "nvme", group_size=20),
                            lr_lambda=lam) as engine:
        box["engine"] = engine
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4)).sum())
            assert engine.step()
    assert errors and "from the engine's own thread 'offload-update" in errors[0], errors
    assert "another thread" not in errors[0] and not (tmp_path / "ck").exists()


class _Interrupted(nn.Module):
    """A Linear whose next forward raises KeyboardInterrupt once `interrupt` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.interrupt = False

    def forward(self, h):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return self.lin(h)


def test_a_ctrl_c_in_a_submodule_called_directly_leaves_the_guard_whole(engine_cfg):
    """A Ctrl-C inside a unit's module called by itself skips its forward hook (torch runs
    `always_call` hooks for exceptions only), which left its direct call recorded; the
    next forward of the whole model then ended the model's call at that unit's hook,
    and another thread's zero_grad ran in the middle of it. The stale call is dropped
    alone now: the model's call holds the engine to its end."""
    GATE.inside, GATE.go = threading.Event(), threading.Event()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Interrupted(), Gate())
    got = {}

    def other():
        try:
            assert GATE.inside.wait(JOIN)
            engine.zero_grad()
            got["other"] = "accepted"
        except EngineBusyError:
            got["other"] = "refused"
        finally:
            GATE.go.set()
    with offload.initialize(model, engine_cfg("host", "host", "host", group_size=200,
                                              whole_modules=["1"])) as engine:
        model[1].interrupt = True
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model[1](torch.randn(4, 16))
        model[2].block = True
        t = threading.Thread(target=other, name="metrics")
        t.start()
        with torch.no_grad():
            model(torch.randn(4, 8))
        t.join(JOIN)
        assert got == {"other": "refused"}
        engine.backward(model(torch.randn(4, 8)).pow(2).mean())
        assert engine.step() is True
