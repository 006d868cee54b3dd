"""Learning-rate schedules against plain PyTorch: torch's and transformers' schedulers
take `engine.optimizer`, and values a loop writes into its param groups, wherever
in the loop, train as torch.optim.AdamW does."""

import copy
import pickle
import warnings

import pytest
import torch

import offload
from offload.engine.step import StepFailedError

from .models import TiedTwice, lm_batches, lm_loss
from .test_failed_step import assert_same, snapshot

PLACES = [("device", "host", "host"), ("nvme", "nvme", "nvme")]
STEPS = 6


def _schedulers(opt):
    """name -> a scheduler of `opt` made the same way for torch and the engine."""
    sched = torch.optim.lr_scheduler
    transformers = pytest.importorskip("transformers")
    return {
        "cosine-warmup": lambda: transformers.get_cosine_schedule_with_warmup(opt, 2, STEPS),
        "step": lambda: sched.StepLR(opt, step_size=2, gamma=0.3),
        "one-cycle": lambda: sched.OneCycleLR(opt, max_lr=3e-2, total_steps=STEPS),
        "plateau": lambda: sched.ReduceLROnPlateau(opt, factor=0.5, patience=0),
        "chained": lambda: sched.SequentialLR(
            opt, [sched.LinearLR(opt, 0.1, total_iters=2), sched.ExponentialLR(opt, 0.7)], [2]),
    }


def _step_scheduler(s, loss):
    if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
        s.step(-loss)  # "improves" never: the rate halves each step after the first
    else:
        s.step()


@pytest.mark.parametrize("name", ["cosine-warmup", "step", "one-cycle", "plateau", "chained"])
@pytest.mark.parametrize("place", PLACES, ids=["host-optim", "nvme"])
def test_schedulers_take_the_engine_optimizer_and_match_torch(engine_cfg, place, name):
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(STEPS)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    s = _schedulers(opt)[name]()
    want_lr = []
    for x, y in batches:
        opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        _step_scheduler(s, loss.item())
        want_lr += [g["lr"] for g in opt.param_groups]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler.step() before optimizer.step()"
        with offload.initialize(model, engine_cfg(*place)) as engine:
            assert isinstance(engine.optimizer, torch.optim.Optimizer)
            s2 = _schedulers(engine.optimizer)[name]()
            got_lr = []
            for x, y in batches:
                engine.optimizer.zero_grad()
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                _step_scheduler(s2, loss.item())
                got_lr += [g["lr"] for g in engine.optimizer.param_groups]
            got = engine.state_dict()
    assert got_lr == pytest.approx(want_lr)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def _noam(k):
    return 2e-2 * min((k + 1) ** -0.5, (k + 1) * 3 ** -1.5)


@pytest.mark.parametrize("first", ["changed", "same value"])
@pytest.mark.parametrize("place", PLACES, ids=["host-optim", "nvme"])
def test_lr_written_between_backward_and_step_matches_torch(engine_cfg, place, first,
                                                            caplog):
    """A loop that sets lr just before stepping (the Transformer's "Noam" wrapper) trains
    as torch: the step whose updates ran during backward before the write fails whole
    and, run again, uses the value written. The first write may leave it as it was.
    With host optimizer state no update runs early, and nothing warns of one."""
    lrs = [1e-2 if first == "same value" and k == 0 else _noam(k) for k in range(STEPS)]
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(STEPS)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for (x, y), lr in zip(batches, lrs):
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.param_groups[0]["lr"] = lr
        opt.step()
    failed = []
    with offload.initialize(model, engine_cfg(*place)) as engine:
        for k, ((x, y), lr) in enumerate(zip(batches, lrs)):
            while True:
                engine.backward(lm_loss(engine(x), y))
                for g in engine.optimizer.param_groups:
                    g["lr"] = lr
                try:
                    engine.step()
                    break
                except StepFailedError as e:  # the first write that changes a value
                    assert "changed between backward and step()" in str(e)
                    failed.append(k)
        got = engine.state_dict()
    # with the optimizer state on NVMe, updates ran during backward until the loop's
    # first change of a value there failed that step; then they wait for step()
    assert failed == ([] if place[2] == "host" else [0 if first == "changed" else 1])
    warned = [r for r in caplog.records if "updates wait for step()" in r.getMessage()]
    assert len(warned) == (0 if place[2] == "host" else 1), warned
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def test_lr_set_after_a_dropped_step_is_the_next_steps_own(engine_cfg, caplog):
    """engine.zero_grad() after a backward drops that step; an lr written before the next
    forward is that step's value from its start, not a change since the dropped one's
    backward: the step goes on, its updates still run during backward."""
    torch.manual_seed(0)
    batches = lm_batches(3)
    with offload.initialize(TiedTwice(), engine_cfg("nvme", "nvme", "nvme")) as engine:
        x, y = batches[0]
        engine.backward(lm_loss(engine(x), y))
        engine.zero_grad()
        for g in engine.optimizer.param_groups:
            g["lr"] = 5e-3
        for x, y in batches[1:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    assert not [r for r in caplog.records if "updates wait for step()" in r.getMessage()]


def test_lr_changed_late_after_early_updates_fails_the_step_whole(engine_cfg):
    """A loop that writes between backward and step only from step 4 on: step 4's
    updates already ran during backward with the old rate. That step fails whole
    (every partition as before it), and run again it trains as torch."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(STEPS)
    lr = [1e-2] * 3 + [3e-3] * 3
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for (x, y), r in zip(batches, lr):
        opt.param_groups[0]["lr"] = r
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    with offload.initialize(model, engine_cfg("nvme", "nvme", "nvme")) as engine:
        failed = 0
        for k, (x, y) in enumerate(batches):
            while True:
                before = snapshot(engine)
                if k < 3:
                    engine.optimizer.param_groups[0]["lr"] = lr[k]
                engine.backward(lm_loss(engine(x), y))
                if k >= 3:
                    engine.optimizer.param_groups[0]["lr"] = lr[k]
                try:
                    engine.step()
                    break
                except StepFailedError as e:
                    assert k == 3 and "changed between backward and step()" in str(e)
                    assert "lr 0.01 -> 0.003" in str(e)
                    assert_same(before, snapshot(engine))
                    failed += 1
        got = engine.state_dict()
    assert failed == 1
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def test_a_nan_tensor_lr_is_refused_as_a_nan_float_is(engine_cfg):
    """A NaN lr written as a tensor before backward: the step is refused for the value
    itself, as for a float NaN, and the updates still overlap backward once the lr is
    right. Before, each read of the tensor was a new NaN float, unequal to the last, so
    the step said the value "changed between backward and step() (lr nan -> nan)" and
    the updates waited for step() from then on."""
    torch.manual_seed(0)
    x, y = lm_batches(1)[0]
    with offload.initialize(TiedTwice(), engine_cfg("nvme", "nvme", "nvme")) as engine:
        for bad in (float("nan"), torch.tensor(float("nan"))):
            engine.optimizer.param_groups[0]["lr"] = bad
            engine.backward(lm_loss(engine(x), y))
            with pytest.raises(StepFailedError, match="lr nan must be a finite number"):
                engine.step()
        engine.optimizer.param_groups[0]["lr"] = 1e-2
        engine.backward(lm_loss(engine(x), y))
        assert engine._early_updates_queued()  # ran during backward
        assert engine.step()


def test_optimizer_zero_grad_drops_the_engines_gradients(engine_cfg):
    """`engine.optimizer.zero_grad()`, as a torch loop calls it, drops the gradients of
    the step in progress, as `engine.zero_grad()` does."""
    torch.manual_seed(0)
    model = TiedTwice()
    (x, y), = lm_batches(1)
    with offload.initialize(model, engine_cfg("nvme", "nvme", "nvme")) as engine:
        before = engine.state_dict()
        engine.backward(lm_loss(engine(x), y))
        engine.optimizer.zero_grad()
        assert engine.step() is False  # nothing to step: its gradients were dropped
        after = engine.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_what_torch_optimizer_methods_do_not_apply_says_so(engine_cfg):
    with offload.initialize(TiedTwice(), engine_cfg()) as engine:
        opt = engine.optimizer
        with pytest.raises(TypeError, match="param_groups"):
            opt.add_param_group({"params": []})
        with pytest.raises(TypeError, match="hooks"):
            opt.register_step_post_hook(lambda *a: None)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(opt)
        assert "lr: 0.01" in repr(opt)


def _torch_run(ref, batches, make):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    s = make(opt)
    for x, y in batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
        s.step()
    return s


def test_engine_scheduler_steps_and_resumes_from_a_checkpoint_as_torch(engine_cfg, tmp_path):
    """`initialize(lr_scheduler=...)`: step() steps it, the checkpoint keeps it, and
    three steps, a save, a resume and three more match six uninterrupted torch steps,
    the first rate after the resume included (a warm-up's first write would be 0)."""
    transformers = pytest.importorskip("transformers")

    def make(opt):
        return transformers.get_linear_schedule_with_warmup(opt, 4, STEPS + 2)
    torch.manual_seed(0)
    ref = TiedTwice()
    init = copy.deepcopy(ref.state_dict())
    batches = lm_batches(STEPS)
    s = _torch_run(ref, batches, make)
    cfg = engine_cfg("nvme", "nvme", "nvme")

    def model():
        m = TiedTwice()
        m.load_state_dict(init)
        return m

    with offload.initialize(model(), cfg, lr_scheduler=make) as engine:
        assert engine.resumed_extra == {}
        for x, y in batches[:3]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(tmp_path / "ck", extra={"batch": 3})
    with offload.initialize(model(), cfg, lr_scheduler=make, resume=tmp_path / "ck") as engine:
        assert engine.resumed_extra == {"batch": 3}
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)
        for x, y in batches[3:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        got = engine.state_dict()
        assert engine.lr_scheduler.get_last_lr() == pytest.approx(s.get_last_lr())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def test_a_resume_without_the_saved_schedule_warns(engine_cfg, tmp_path, caplog):
    """A checkpoint saved under lr_scheduler= or lr_lambda= and resumed without it
    trains at the resumed rate, unscheduled: said, not silent; resumed with it, no word."""
    cfg = engine_cfg()
    (x, y), = lm_batches(1)
    make = _warmup
    for kind, given in (("lr_scheduler", {"lr_scheduler": make}),
                        ("lr_lambda", {"lr_lambda": lambda k: 0.5 ** k})):
        ck = tmp_path / kind
        with offload.initialize(TiedTwice(), cfg, **given) as engine:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            engine.save_checkpoint(ck)
        for resume_with in ({}, given):
            caplog.clear()
            with caplog.at_level("WARNING", logger="offload"):
                offload.initialize(TiedTwice(), cfg, resume=ck, **resume_with).close()
            warned = [r.getMessage() for r in caplog.records
                      if f"saved with an {kind}" in r.getMessage()]
            assert len(warned) == (not resume_with), (kind, resume_with, warned)
            if warned:
                assert str(ck) in warned[0] and f"pass {kind}=" in warned[0]


def test_a_skipped_step_does_not_step_the_engine_scheduler(engine_cfg):
    cfg = engine_cfg()
    cfg["optim"]["max_grad_norm"] = 1.0  # a non-finite norm skips the step
    (x, y), = lm_batches(1)
    with offload.initialize(TiedTwice(), cfg, lr_scheduler=lambda o: torch.optim.lr_scheduler
                            .StepLR(o, 1, gamma=0.5)) as engine:
        engine.backward(lm_loss(engine(x), y) * float("inf"))
        assert engine.step() is False
        assert engine.lr_scheduler.last_epoch == 0
        assert engine.optimizer.param_groups[0]["lr"] == 1e-2
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is True
        assert engine.lr_scheduler.last_epoch == 1
        assert engine.optimizer.param_groups[0]["lr"] == 5e-3


def test_engine_scheduler_refusals(engine_cfg, tmp_path):
    sched = torch.optim.lr_scheduler
    with pytest.raises(offload.ConfigError, match="needs a metric"):
        offload.initialize(TiedTwice(), engine_cfg(),
                           lr_scheduler=lambda o: sched.ReduceLROnPlateau(o))
    other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)
    with pytest.raises(offload.ConfigError, match="function of the optimizer"):
        offload.initialize(TiedTwice(), engine_cfg(), lr_scheduler=sched.StepLR(other, 1))
    with pytest.raises(offload.ConfigError, match="another optimizer"):
        offload.initialize(TiedTwice(), engine_cfg(), lr_scheduler=lambda o: sched.StepLR(other, 1))

    class Holder:  # a LambdaLR's lambda object is saved as its __dict__
        def __init__(self):
            self.t = torch.ones(1)

        def __call__(self, k):
            return 1.0
    (x, y), = lm_batches(1)
    with offload.initialize(TiedTwice(), engine_cfg(),
                            lr_scheduler=lambda o: sched.LambdaLR(o, Holder())) as engine:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        with pytest.raises(offload.engine.CheckpointError, match="JSON-serialisable"):
            engine.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def _warmup(opt):
    """A module-level factory: spawned ranks import it by name."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))


def _resume_on_two_ranks(rank, world, init_file, cfg, resume, out):
    from .ranks import gloo_group
    from .test_checkpoint_reshard import Wide
    with gloo_group(rank, world, init_file):
        with offload.initialize(Wide, cfg, lr_scheduler=_warmup, resume=resume) as e:
            for x, y in lm_batches(STEPS)[3:]:
                e.backward(lm_loss(e(x), y))
                e.step()
            sd = e.state_dict()
            if rank == 0:
                torch.save({"sd": sd, "lr": e.lr_scheduler.get_last_lr()}, out)


@pytest.mark.distributed
def test_engine_scheduler_resumes_on_two_ranks_as_one_ran_on(engine_cfg, tmp_path):
    """One rank saves with the scheduler at step 3 of its warm-up; two resume and
    finish: bit for bit the uninterrupted one-rank run (every rank trains on the whole
    batch, so the ranks' mean gradient is each one's)."""
    from .ranks import spawn
    from .test_checkpoint_reshard import Wide
    batches = lm_batches(STEPS)
    cfg = engine_cfg("nvme", "nvme", "nvme", dtype="bf16")
    torch.manual_seed(0)
    with offload.initialize(Wide(), cfg, lr_scheduler=_warmup) as ref:
        for k, (x, y) in enumerate(batches):
            ref.backward(lm_loss(ref(x), y))
            ref.step()
            if k == 2:
                ref.save_checkpoint(tmp_path / "ck")
        want, want_lr = ref.state_dict(), ref.lr_scheduler.get_last_lr()
    cfg["io"]["paths"] = [str(tmp_path / "two")]
    spawn(_resume_on_two_ranks, str(tmp_path / "init"), cfg, str(tmp_path / "ck"),
          str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert got["lr"] == want_lr
    for k, v in want.items():
        assert torch.equal(got["sd"][k], v), k
