"""The optimizer-facing API as torch users know it: torch's and transformers' LR
schedulers (stepped by hand or by the engine, resumed from a checkpoint), values
written into `param_groups` between steps, bad values refused before anything
changes, `state_dict` / `load_state_dict`, `zero_grad` and clipping, each against
plain torch.optim.AdamW (fp32)."""

import copy
import math

import pytest
import torch
from torch.optim import lr_scheduler as sched

import offload
from offload.engine.step import StepFailedError

from .models import TiedTwice, lm_batches, lm_loss
from .test_failed_step import assert_same, snapshot

STEPS = 6


def _assert_as_torch(got: dict, ref: torch.nn.Module, atol: float = 2e-6) -> None:
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def _vals(opt) -> list[float]:
    """Each group's lr, beta1 and beta2, flat."""
    return [float(v) for g in opt.param_groups for v in (g["lr"], *g["betas"])]


def _torch_run(ref, batches, make=None, before_step=None, max_norm=0.0):
    """Trains `ref` with torch.optim.AdamW; `make(opt)` a scheduler stepped after each
    step, `before_step(k, opt)` writes values. Returns each step's group values."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    s = make(opt) if make is not None else None
    seen = []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        if before_step is not None:
            before_step(k, opt)
        seen += _vals(opt)
        opt.step()
        if s is not None:
            s.step()
    return seen


def _init_model():
    torch.manual_seed(0)
    ref = TiedTwice()
    init = copy.deepcopy(ref.state_dict())

    def fresh():
        m = TiedTwice()
        m.load_state_dict(init)
        return m
    return ref, fresh


RESUMED = {
    "multistep": lambda o: sched.MultiStepLR(o, milestones=[4, 5], gamma=0.3),
    "sequential-multistep": lambda o: sched.SequentialLR(
        o, [sched.LinearLR(o, 0.5, total_iters=2), sched.MultiStepLR(o, [2, 3], 0.3)], [2]),
    "one-cycle-momentum": lambda o: sched.OneCycleLR(o, max_lr=3e-2, total_steps=STEPS,
                                                     base_momentum=0.5, max_momentum=0.95),
    "warm-restarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "tensor-lr-cosine": lambda o: _tensor_lr_cosine(o),
}


def _tensor_lr_cosine(o):
    """A cosine LambdaLR over groups whose lr is a 0-d tensor (as torch.optim.AdamW(...,
    lr=torch.tensor(1e-2)) makes them): torch copies the tensors into the scheduler's
    `base_lrs` and `_last_lr`, which its checkpoint refused to save."""
    for g in o.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]))
    return sched.LambdaLR(o, lambda k: 0.5 * (1 + math.cos(math.pi * k / STEPS)))


@pytest.mark.parametrize("name", list(RESUMED))
def test_engine_scheduler_resumed_from_a_checkpoint_trains_as_torch(engine_cfg, tmp_path, name):
    """`initialize(lr_scheduler=factory)`: three steps, a save, a resume and three more
    train as six uninterrupted torch steps, for schedulers whose state holds more than
    numbers (MultiStepLR's milestones) and that write betas (OneCycleLR's momentum)."""
    ref, got, sd = _saved_and_resumed(engine_cfg(), tmp_path, RESUMED[name], RESUMED[name])
    assert got == pytest.approx(_torch_run(ref, lm_batches(STEPS), RESUMED[name]))
    _assert_as_torch(sd, ref)


def test_a_scheduler_that_raises_after_a_step_is_put_back_and_the_step_kept(engine_cfg):
    """A LambdaLR whose lambda raised after step 2 committed: the error came out of
    step() raw, as if the step had failed (whose fix, its micro-batches again, would
    apply them twice), and the scheduler was left counted a step ahead with the old
    rate. The error says the step was applied; the scheduler and its values are as
    before its step; stepped again by hand, the run is torch's."""
    fail = [False]

    def lam(k):
        if fail[0]:
            raise ZeroDivisionError("no rate")
        return 1.0 / (1 + k)

    ref, fresh = _init_model()
    batches = lm_batches(4)
    want = _torch_run(ref, batches, lambda o: sched.LambdaLR(o, lam))
    got = []
    with offload.initialize(fresh(), engine_cfg(),
                            lr_scheduler=lambda o: sched.LambdaLR(o, lam)) as engine:
        for k, (x, y) in enumerate(batches):
            got += _vals(engine.optimizer)
            engine.backward(lm_loss(engine(x), y))
            fail[0] = k == 1
            if k == 1:
                with pytest.raises(RuntimeError, match=r"step 2 was applied .*ZeroDivision"
                                                       r"Error: no rate.*lr_scheduler.step"):
                    engine.step()
                assert engine.global_step == 2 and engine.lr_scheduler.last_epoch == 1
                assert _vals(engine.optimizer) == got[-3:]
                fail[0] = False
                engine.lr_scheduler.step()
            else:
                assert engine.step()
        assert got == pytest.approx(want)
        _assert_as_torch(engine.state_dict(), ref)


def _saved_and_resumed(cfg, tmp_path, make, make_again):
    """(the torch model to compare with, the values each step trained with, the final
    state dict) of three engine steps scheduled by `make`, a save, and a resume
    scheduled by `make_again` for the rest."""
    ref, fresh = _init_model()
    batches = lm_batches(STEPS)
    got = []
    with offload.initialize(fresh(), cfg, lr_scheduler=make) as engine:
        for x, y in batches[:3]:
            got += _vals(engine.optimizer)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(tmp_path / "ck")
    with offload.initialize(fresh(), cfg, lr_scheduler=make_again,
                            resume=tmp_path / "ck") as engine:
        # the state's types are those of the saved scheduler, not JSON's (a dict of str
        # for MultiStepLR's Counter of milestones, lists for tuples)
        assert _types(engine.lr_scheduler.state_dict()) == _types(
            make(torch.optim.SGD([torch.zeros(1)], lr=1.0)).state_dict())
        for x, y in batches[3:]:
            got += _vals(engine.optimizer)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        return ref, got, engine.state_dict()


def _types(value):
    """The type of `value`, and of everything in it, keys included, as a nested tuple."""
    if isinstance(value, dict):
        return type(value), tuple(sorted((repr(type(k)), repr(k), _types(v))
                                         for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_types(v) for v in value)
    return type(value)


HAND = {
    "multistep": lambda o: sched.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "cosine": lambda o: sched.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "warm-restarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "linear": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=3),
    "chained": lambda o: sched.ChainedScheduler([sched.StepLR(o, 2, 0.5),
                                                 sched.ExponentialLR(o, 0.9)]),
    "cyclic-momentum": lambda o: sched.CyclicLR(o, 1e-3, 3e-2, step_size_up=2),
}


@pytest.mark.parametrize("name", list(HAND))
def test_schedulers_made_by_hand_train_as_torch(engine_cfg, name):
    """torch schedulers made from `engine.optimizer` and stepped after `engine.step()`
    set the rates (and CyclicLR's betas) torch's AdamW trains with."""
    make = HAND[name]
    ref, fresh = _init_model()
    batches = lm_batches(STEPS)
    want = _torch_run(ref, batches, make)
    got = []
    with offload.initialize(fresh(), engine_cfg("host", "host", "host")) as engine:
        s = make(engine.optimizer)
        for x, y in batches:
            got += _vals(engine.optimizer)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            s.step()
        sd = engine.state_dict()
    assert got == pytest.approx(want)
    _assert_as_torch(sd, ref)


def _values(k, opt):
    """Every hyper-parameter changes from step to step, as a loop may write them."""
    g = opt.param_groups[0]
    g["lr"] = 1e-2 * (k + 1) / 3
    g["betas"] = (0.9 - 0.1 * k, 0.999 - 0.01 * k)
    g["eps"] = 10.0 ** -(3 + k)
    g["weight_decay"] = 0.05 * k


@pytest.mark.parametrize("place", [("device", "host", "host"), ("nvme", "nvme", "nvme")],
                         ids=["host-optim", "nvme"])
def test_values_written_between_steps_train_as_torch(engine_cfg, place):
    """lr, betas, eps and weight_decay written into `param_groups` before each step's
    forward are the ones that step trains with, as torch's AdamW reads them."""
    ref, fresh = _init_model()
    batches = lm_batches(4)
    _torch_run(ref, batches, before_step=_values)
    with offload.initialize(fresh(), engine_cfg(*place)) as engine:
        for k, (x, y) in enumerate(batches):
            _values(k, engine.optimizer)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        sd = engine.state_dict()
    _assert_as_torch(sd, ref)


BAD = {
    "negative lr": ("lr", -1e-3, "lr -0.001"),
    "NaN lr": ("lr", float("nan"), "lr nan"),
    "inf lr": ("lr", float("inf"), "lr inf"),
    "beta1 of 1": ("betas", (1.0, 0.999), "beta1 1.0"),
    "negative beta2": ("betas", (0.9, -0.1), "beta2 -0.1"),
    "one beta": ("betas", (0.9,), "two numbers"),
    "negative eps": ("eps", -1e-8, "eps"),
    "NaN weight decay": ("weight_decay", float("nan"), "weight_decay nan"),
    "lr not a number": ("lr", "fast", "must be numbers"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_values_in_param_groups_fail_the_step_before_anything_changes(engine_cfg, bad):
    """A bad value written into a group (the second of two) fails the step with a
    ValueError naming the group and the value; every weight, moment and step count is
    as before it, and with the value fixed the loop trains on."""
    key, value, says = BAD[bad]
    (x, y), = lm_batches(1)
    with offload.initialize(TiedTwice(), engine_cfg("host", "host", "host"),
                            param_groups=[{"params": ["l2.*"], "lr": 3e-3}]) as engine:
        before = snapshot(engine)
        good = engine.optimizer.param_groups[1][key]
        engine.optimizer.param_groups[1][key] = value
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError) as e:
            engine.step()
        assert "param_groups[1]" in str(e.value) and says in str(e.value)
        assert_same(before, snapshot(engine))
        engine.optimizer.param_groups[1][key] = good
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is True
        assert engine.global_step == 1


def test_a_schedule_reaching_nan_fails_the_step_and_changes_nothing(engine_cfg):
    """A LambdaLR whose multiplier turns NaN fails that step, as a NaN lr would
    otherwise spoil every weight."""
    batches = lm_batches(2)
    with offload.initialize(TiedTwice(), engine_cfg()) as engine:
        s = sched.LambdaLR(engine.optimizer, lambda k: 1.0 if k == 0 else math.nan)
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        s.step()
        before = snapshot(engine)
        x, y = batches[1]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError, match="lr nan") as e:
            engine.step()
        assert e.value.groups == [] and "no update had begun: every group is at its " \
            "state before the step" in str(e.value)  # not "groups [] are ..."
        assert_same(before, snapshot(engine))


def test_per_group_lambdas_train_as_torch(engine_cfg):
    """A LambdaLR with one lambda per group (as per-group warm-ups are written) sets
    each group's rate as torch's does."""
    ref, fresh = _init_model()
    batches = lm_batches(4)
    lambdas = [lambda k: 0.5 ** k, lambda k: (k + 1) / 4]
    opt = torch.optim.AdamW([{"params": [p for n, p in ref.named_parameters()
                                         if not n.startswith("l2.")]},
                             {"params": list(ref.l2.parameters()), "lr": 3e-3,
                              "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
    s = sched.LambdaLR(opt, lambdas)
    for x, y in batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
        s.step()
    with offload.initialize(fresh(), engine_cfg("host", "host", "host"), param_groups=[
            {"params": ["l2.*"], "lr": 3e-3, "weight_decay": 0.0}]) as engine:
        s2 = sched.LambdaLR(engine.optimizer, lambdas)
        for x, y in batches:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            s2.step()
        assert s2.get_last_lr() == pytest.approx(s.get_last_lr())
        sd = engine.state_dict()
    _assert_as_torch(sd, ref)


def test_optimizer_state_dict_round_trip_resumes_as_torch(engine_cfg):
    """`engine.optimizer.state_dict()` saved after two steps (with a scheduler's
    state_dict), loaded into a second engine with the same weights, and a scheduler
    made there with `load_state_dict`: the remaining steps train as torch."""
    ref, fresh = _init_model()
    batches = lm_batches(4)

    def make(o):
        return sched.StepLR(o, step_size=1, gamma=0.5)
    _torch_run(ref, batches, make)
    cfg = engine_cfg("host", "host", "host")
    with offload.initialize(fresh(), cfg) as engine:
        s = make(engine.optimizer)
        for x, y in batches[:2]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            s.step()
        opt_sd = engine.optimizer.state_dict()
        s_sd = s.state_dict()
        weights = engine.state_dict()
    model = fresh()
    model.load_state_dict(weights)
    with offload.initialize(model, cfg) as engine:
        engine.optimizer.load_state_dict(opt_sd)
        s = make(engine.optimizer)
        s.load_state_dict(s_sd)
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-3)
        for x, y in batches[2:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            s.step()
        sd = engine.state_dict()
    _assert_as_torch(sd, ref)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad_takes_set_to_none(engine_cfg, set_to_none):
    """`engine.optimizer.zero_grad(set_to_none=...)` before each backward, as torch
    loops write it, trains as torch."""
    ref, fresh = _init_model()
    batches = lm_batches(3)
    _torch_run(ref, batches)
    with offload.initialize(fresh(), engine_cfg()) as engine:
        for x, y in batches:
            engine.optimizer.zero_grad(set_to_none=set_to_none)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        sd = engine.state_dict()
    _assert_as_torch(sd, ref)


def test_clipping_trains_as_clip_grad_norm(engine_cfg):
    """`optim.max_grad_norm` trains as `clip_grad_norm_` before AdamW's step, and
    `engine.grad_norm` is the norm it returns."""
    ref, fresh = _init_model()
    batches = lm_batches(3)
    norms = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt.step()
    cfg = engine_cfg("host", "host", "host")
    cfg["optim"]["max_grad_norm"] = 0.5
    got = []
    with offload.initialize(fresh(), cfg) as engine:
        for x, y in batches:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            got.append(engine.grad_norm)
        sd = engine.state_dict()
    assert got == pytest.approx(norms, rel=1e-5)
    _assert_as_torch(sd, ref)


def test_bad_value_with_updates_during_backward_fails_the_step_whole(engine_cfg):
    """With the optimizer state on NVMe (updates run during backward), a NaN lr
    written before the forward fails the step naming it, every partition as before."""
    (x, y), = lm_batches(1)
    with offload.initialize(TiedTwice(), engine_cfg("nvme", "nvme", "nvme")) as engine:
        before = snapshot(engine)
        engine.optimizer.param_groups[0]["lr"] = float("nan")
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(StepFailedError, match="lr nan"):
            engine.step()
        assert_same(before, snapshot(engine))
        engine.optimizer.param_groups[0]["lr"] = 1e-2
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is True


def test_tensor_lr_is_saved_and_resumed_as_its_value(engine_cfg, tmp_path):
    """An lr given as a 0-d tensor (torch.optim takes `lr: float | Tensor`, and its
    schedulers fill it in place) is saved in a checkpoint as the value it had when
    the save was called, and resumed as that number."""
    (x, y), = lm_batches(1)
    cfg = engine_cfg()
    with offload.initialize(TiedTwice(), cfg) as engine:
        lr = torch.tensor(3e-3)
        engine.optimizer.param_groups[0]["lr"] = lr
        engine.optimizer.param_groups[0]["betas"] = (torch.tensor(0.8), 0.99)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(tmp_path / "ck", blocking=False)
        lr.fill_(1e-4)  # a scheduler's write after the save was called
        engine.wait_for_checkpoint()
    with offload.initialize(TiedTwice(), cfg, resume=tmp_path / "ck") as engine:
        g = engine.optimizer.param_groups[0]
        assert float(g["lr"]) == pytest.approx(3e-3)
        assert tuple(map(float, g["betas"])) == pytest.approx((0.8, 0.99))


def test_a_resume_whose_factory_changed_the_milestones_keeps_the_saved_ones(engine_cfg, tmp_path):
    """As torch's `load_state_dict`, the saved MultiStepLR state wins over the one the
    resume's factory makes: its milestones (JSON turned them into strings) decay the
    rate at the saved steps, not never."""
    make = RESUMED["multistep"]
    other = lambda o: sched.MultiStepLR(o, milestones=[10], gamma=0.3)  # noqa: E731
    ref, got, _ = _saved_and_resumed(engine_cfg(), tmp_path, make, other)
    assert got == pytest.approx(_torch_run(ref, lm_batches(STEPS), make))


def test_a_schedule_per_given_group_is_told_of_the_default_group(engine_cfg):
    """A LambdaLR list written for the two groups given (as for torch, where they are
    the optimizer's only groups) fails with torch's "Expected 3 lr_lambdas, but got
    2"; the error now says that param_groups[0] is the default group and where the
    given ones are."""
    two = [{"params": ["l1.*"], "lr": 3e-3}, {"params": ["l2.*"], "weight_decay": 0.0}]
    make = lambda o: sched.LambdaLR(o, [lambda k: 1.0, lambda k: 0.5])  # noqa: E731
    with pytest.raises(ValueError, match="Expected 3 lr_lambdas") as e:
        offload.initialize(TiedTwice(), engine_cfg(), param_groups=two, lr_scheduler=make)
    assert "param_groups[0] is the default group" in "".join(e.value.__notes__)
    assert "param_groups[k + 1]" in "".join(e.value.__notes__)
