"""A training loop written for torch, run through the engine: values written into the
optimizer's param groups between steps, accumulation with a discarded micro-batch and
clipping, refused calls, dropout's random stream across evaluation and forwards
without backward, rewinding to an earlier state, a trainable set changed part way.
Each against plain PyTorch (torch.optim.AdamW, fp32) with parameters, gradients and
optimizer state on host and on NVMe."""

import copy
import threading

import pytest
import torch
from torch import nn

import offload
from offload.engine.checkpoint_reader import CheckpointError

from .test_failed_step import assert_same, snapshot

PLACES = [("host", "host", "host"), ("nvme", "nvme", "nvme")]
IDS = ["host", "nvme"]


class Net(nn.Module):
    """Three Linear layers, each its own group (engine_cfg's group_size), and a dropout."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _pair(engine_cfg, place, p=0.0, **engine):
    """(reference model, its AdamW, the engine of a copy)."""
    torch.manual_seed(0)
    ref = Net(p)
    model = copy.deepcopy(ref)
    cfg = engine_cfg(*place, **engine)
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg["optim"]["lr"],
                            weight_decay=cfg["optim"]["weight_decay"])
    return ref, opt, offload.initialize(model, cfg)


def _compare(engine, ref, atol=1e-5):
    got = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def _torch_step(ref, opt, x, y):
    opt.zero_grad()
    _loss(ref, x, y).backward()
    opt.step()


def _engine_step(engine, x, y):
    engine.backward(_loss(engine, x, y))
    return engine.step()


def _bf16_steps(engine, batches):
    for x, y in batches:
        _engine_step(engine, x.bfloat16(), y.bfloat16())


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_every_value_written_into_param_groups_between_steps_trains_as_torch(engine_cfg,
                                                                            place):
    """betas, weight decay, eps and lr set through `engine.optimizer.param_groups`
    between steps (as a schedule of momentum or decay does) are what the next step uses."""
    ref, opt, engine = _pair(engine_cfg, place)
    changes = [{}, {"betas": (0.8, 0.99)}, {"weight_decay": 0.5}, {"eps": 1e-3},
               {"lr": 3e-2}, {}]
    with engine:
        for (x, y), change in zip(_data(len(changes)), changes):
            for group in opt.param_groups + engine.optimizer.param_groups:
                group.update(change)
            _torch_step(ref, opt, x, y)
            assert _engine_step(engine, x, y)
        _compare(engine, ref)


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_zero_grad_discards_a_micro_batch_of_accumulation_with_clipping(engine_cfg, place):
    """grad_accum_steps=2 with clipping: a micro-batch dropped by `zero_grad()` (torch:
    `opt.zero_grad()`) counts for nothing, neither in the gradient nor in the count of
    micro-batches; torch gets each loss halved by hand. A large eps makes the update
    follow the gradient's scale."""
    torch.manual_seed(0)
    ref = Net()
    cfg = engine_cfg(*place, grad_accum_steps=2)
    cfg["optim"].update(max_grad_norm=0.3, eps=0.05)
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=0.05)
    data = _data(9)
    with engine:
        for i in range(0, 9, 3):
            x, y = data[i]  # discarded
            engine.backward(_loss(engine, x, y))
            engine.zero_grad()
            (_loss(ref, x, y) / 2).backward()
            opt.zero_grad()
            for k, (x, y) in enumerate(data[i + 1:i + 3]):
                engine.backward(_loss(engine, x, y))
                assert engine.step() is (k == 1)
                (_loss(ref, x, y) / 2).backward()
            want = nn.utils.clip_grad_norm_(ref.parameters(), 0.3).item()
            opt.step()
            opt.zero_grad()
            assert engine.grad_norm == pytest.approx(want, rel=1e-5)
        _compare(engine, ref)


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_refused_calls_change_nothing_and_training_goes_on_as_torch(engine_cfg, place):
    """A step without backward, a loss that is not a scalar, a second backward without
    grad_accum_steps, `load_state_dict` between backward and step: each returns False
    or raises an error that names the fix, and leaves the training state as it was."""
    ref, opt, engine = _pair(engine_cfg, place)
    (x, y), (x2, y2) = _data(2)
    with engine:
        before = snapshot(engine)
        assert engine.step() is False
        with pytest.raises(RuntimeError, match="scalar"):  # torch's own message
            engine.backward((engine(x) - y) ** 2)
        assert engine.step() is False
        assert_same(before, snapshot(engine))
        engine.backward(_loss(engine, x, y))
        with pytest.raises(RuntimeError, match="grad_accum_steps"):
            engine.backward(_loss(engine, x, y))
        with pytest.raises(RuntimeError, match="step is in progress"):
            engine.load_state_dict(ref.state_dict())
        assert engine.step() is True
        assert engine.step() is False  # its gradients were used: nothing to step
        _torch_step(ref, opt, x, y)
        _torch_step(ref, opt, x2, y2)
        assert _engine_step(engine, x2, y2)
        _compare(engine, ref)


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_dropout_follows_torchs_random_stream_across_eval_and_forwards_without_backward(
        engine_cfg, place):
    """With the same seed the dropout masks are torch's: the engine draws nothing from
    the global generator, whether a forward is under no_grad in training mode (a
    target from the model itself), abandoned, in eval mode, or two forwards feed one
    loss with `zero_grad()` between forward and backward."""
    ref, opt, engine = _pair(engine_cfg, place, p=0.3)
    data = _data(6)

    def loop(model, zero_grad, backward, step):
        losses = []
        torch.manual_seed(3)
        for k in range(0, 6, 2):
            (x1, y1), (x2, _) = data[k], data[k + 1]
            with torch.no_grad():
                target = model(x2)
            model(x1)  # abandoned
            model.eval()
            with torch.no_grad():
                model(x1)
            model.train()
            out1, out2 = model(x1), model(x2)
            zero_grad()
            loss = nn.functional.mse_loss(out1, y1) + nn.functional.mse_loss(out2, target)
            backward(loss)
            step()
            losses.append(loss.item())
        return losses

    with engine:
        want = loop(ref, opt.zero_grad, lambda loss: loss.backward(), opt.step)
        got = loop(engine, engine.optimizer.zero_grad, engine.backward, engine.step)
        assert got == pytest.approx(want, abs=1e-6)
        _compare(engine, ref)


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_rewinding_weights_and_optimizer_state_mid_training_trains_as_torch(engine_cfg,
                                                                           place):
    """`state_dict()` / `optimizer.state_dict()` kept after step 2 and loaded back after
    step 4 (torch's in-memory rewind), then an edited weight dict loaded alone (the
    moments stay): the steps after each train as torch's."""
    ref, opt, engine = _pair(engine_cfg, place)
    data = _data(7)
    with engine:
        for x, y in data[:2]:
            _torch_step(ref, opt, x, y)
            _engine_step(engine, x, y)
        kept = copy.deepcopy((ref.state_dict(), opt.state_dict()))
        kept_engine = copy.deepcopy((engine.state_dict(), engine.optimizer.state_dict()))
        for x, y in data[2:4]:
            _torch_step(ref, opt, x, y)
            _engine_step(engine, x, y)
        ref.load_state_dict(kept[0])
        opt.load_state_dict(kept[1])
        engine.load_state_dict(kept_engine[0])
        engine.optimizer.load_state_dict(kept_engine[1])
        for x, y in data[4:6]:
            _torch_step(ref, opt, x, y)
            _engine_step(engine, x, y)
        halved = {k: v * 0.5 for k, v in ref.state_dict().items()}
        ref.load_state_dict(halved)
        engine.load_state_dict(halved)
        x, y = data[6]
        _torch_step(ref, opt, x, y)
        _engine_step(engine, x, y)
        _compare(engine, ref)


def test_loading_optimizer_state_inside_a_step_names_the_engines_fix(engine_cfg):
    """NVMe optimizer state updated during backward: `optimizer.load_state_dict` before
    `step()` is refused with nothing loaded, naming engine.step() / zero_grad() (it
    named commit() and rollback(), which an engine's user never calls)."""
    _, _, engine = _pair(engine_cfg, ("host", "host", "nvme"), dtype="bf16")
    data = _data(3)
    with engine:
        _bf16_steps(engine, data[:2])
        kept = copy.deepcopy(engine.optimizer.state_dict())
        x, y = data[2]
        engine.backward(_loss(engine, x.bfloat16(), y.bfloat16()))
        assert engine._early_updates_queued()  # handed to the update thread in backward
        before = snapshot(engine)
        with pytest.raises(ValueError, match=r"after engine\.step\(\) \(or drop the step "
                                             r"with engine\.zero_grad\(\)\)"):
            engine.optimizer.load_state_dict(kept)
        assert_same(snapshot(engine), before)
        assert engine.step()


def test_loading_only_optimizer_state_in_bf16_moves_the_weights_the_forward_uses(engine_cfg):
    """bf16 keeps fp32 masters apart from the weights: loading an older
    `optimizer.state_dict()` alone (its masters) rewrites the bf16 weights from them, so
    the next forward computes with what `state_dict()` shows, not the newer weights."""
    ref, _, engine = _pair(engine_cfg, ("host", "host", "host"), dtype="bf16")
    data = _data(5)
    with engine:
        _bf16_steps(engine, data[:2])
        kept = copy.deepcopy(engine.optimizer.state_dict())
        _bf16_steps(engine, data[2:4])
        engine.optimizer.load_state_dict(kept)
        plain = copy.deepcopy(ref).to(torch.bfloat16)
        plain.load_state_dict(engine.state_dict())
        x = data[4][0].bfloat16()
        with torch.no_grad():
            torch.testing.assert_close(engine(x), plain(x), atol=1e-3, rtol=0)


def test_loading_optimizer_state_while_the_steps_update_waits_its_turn_is_refused(engine_cfg):
    """The step's update queued behind other work on the update thread, not yet run:
    `optimizer.load_state_dict` is refused as where it ran. It used to be accepted then,
    the queued update running over the loaded state while the parameters were read
    back from the masters it was updating: which of the two happened was the thread's
    timing."""
    _, _, engine = _pair(engine_cfg, ("host", "host", "nvme"), dtype="bf16",
                         group_size=10**6)  # one group: one early update
    (x0, y0), (x1, y1) = _data(2)
    with engine:
        _bf16_steps(engine, [(x0, y0)])
        kept = copy.deepcopy(engine.optimizer.state_dict())
        gate = threading.Event()
        engine._updater.submit(gate.wait, 60)  # the update thread busy until the gate opens
        try:
            engine.backward(_loss(engine, x1.bfloat16(), y1.bfloat16()))
            assert not engine.optimizer.round  # queued, not run
            with pytest.raises(ValueError, match=r"after engine\.step\(\)"):
                engine.optimizer.load_state_dict(kept)
        finally:
            gate.set()
        assert engine.step()


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_freezing_between_micro_batches_trains_as_torch(engine_cfg, place):
    """Frozen between two micro-batches of one step, torch takes only the first one's
    gradient for it (the second forward's graph leaves it out); the engine reads
    `requires_grad` when a unit binds its weights, so it does the same."""
    ref, opt, engine = _pair(engine_cfg, place, grad_accum_steps=2)
    (x1, y1), (x2, y2) = _data(2)
    with engine:
        opt.zero_grad()
        (_loss(ref, x1, y1) / 2).backward()
        ref.b.weight.requires_grad_(False)
        (_loss(ref, x2, y2) / 2).backward()
        opt.step()
        engine.backward(_loss(engine, x1, y1))
        engine.module.b.weight.requires_grad_(False)
        engine.backward(_loss(engine, x2, y2))
        assert [p.grad is None for p in engine.module.parameters()] == \
            [p.grad is None for p in ref.parameters()] == [False] * 6  # the first's, kept
        assert engine.step()
        _compare(engine, ref)


@pytest.mark.parametrize("place", PLACES, ids=IDS)
@pytest.mark.parametrize("micro", [1, 2])
def test_freezing_after_the_forward_trains_as_torch(engine_cfg, place, micro):
    """torch reads `requires_grad` again when backward reaches a parameter: frozen after
    the forward, it gets nothing from that backward (no `.grad`, no update; with two
    micro-batches the first's gradient alone). The engine read it only at the forward,
    and updated the parameter with the whole gradient."""
    ref, opt, engine = _pair(engine_cfg, place, grad_accum_steps=micro)
    batches = _data(micro)
    with engine:
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            ref_loss, loss = _loss(ref, x, y) / micro, _loss(engine, x, y)
            if i == micro - 1:
                ref.b.weight.requires_grad_(False)
                engine.module.b.weight.requires_grad_(False)
            ref_loss.backward()
            engine.backward(loss)
        opt.step()
        assert [p.grad is None for p in engine.module.parameters()] == \
            [p.grad is None for p in ref.parameters()]
        assert engine.step()
        _compare(engine, ref)


@pytest.mark.parametrize("when", ["initialize", "after"])
def test_frozen_layers_are_given_back_once_their_backward_ran(engine_cfg, when):
    """[Note: weights without a gradient in backward] Frozen layers (at initialize, or
    since) get no gradient, whose arrival frees a trainable group's gathered weights:
    they stayed gathered until the backward ended, every frozen layer at once. Now
    none is left gathered when the backward reaches the model's input, and the steps
    are torch's."""
    torch.manual_seed(0)
    ref = Net()
    if when == "initialize":
        ref.a.requires_grad_(False)
        ref.b.requires_grad_(False)
    model = copy.deepcopy(ref)
    cfg = engine_cfg(*PLACES[0], group_size=300)  # a unit (and a group) per layer
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                            lr=cfg["optim"]["lr"], weight_decay=cfg["optim"]["weight_decay"])
    gathered = []
    with offload.initialize(model, cfg) as engine:
        for m in (ref, model):
            m.a.requires_grad_(False)
            m.b.requires_grad_(False)
        for x, y in _data(2):
            _torch_step(ref, opt, x, y)
            x = x.clone().requires_grad_()  # the backward reaches the input: look then
            x.register_hook(lambda g: gathered.append(
                [st.group.gid for st in engine._states if st.gathered]))
            assert _engine_step(engine, x, y)
            _compare(engine, ref)
    assert gathered == [[0], [0]]  # the first layer's, whose backward is running


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_progressive_unfreezing_trains_as_torch(engine_cfg, place):
    """[Note: freezing after initialize] Everything trains for two steps, then a whole
    layer and one parameter of another layer's group are frozen for two steps (torch's
    AdamW skips them: no decay, no moment or step-count change), then unfrozen: they
    train on from the moments and step counts they kept. Frozen parameters have no
    `.grad`, as in torch."""
    ref, opt, engine = _pair(engine_cfg, place)
    data = _data(6)
    with engine:
        for i, (x, y) in enumerate(data):
            if i in (2, 4):
                for m in (ref, engine.module):
                    m.b.requires_grad_(i == 4)
                    m.a.bias.requires_grad_(i == 4)
            opt.zero_grad()
            _loss(ref, x, y).backward()
            engine.backward(_loss(engine, x, y))
            assert [p.grad is None for p in engine.module.parameters()] == \
                [p.grad is None for p in ref.parameters()]
            opt.step()
            assert engine.step()
            _compare(engine, ref)
            if i == 1:
                before = engine.state_dict()
            if i == 3:  # the frozen ones did not move while frozen, the others did
                after = engine.state_dict()
                assert torch.equal(after["b.weight"], before["b.weight"])
                assert torch.equal(after["a.bias"], before["a.bias"])
                assert not torch.equal(after["a.weight"], before["a.weight"])


def test_backward_through_a_forward_made_before_the_step_is_refused(engine_cfg):
    """Two forwards, then backward and step of the first, then backward of the second:
    torch refuses ("modified by an inplace operation": the step changed weights the
    graph saved). The engine must not compute that gradient with the new weights."""
    ref, opt, engine = _pair(engine_cfg, PLACES[0])
    (x1, y1), (x2, y2) = _data(2)
    out1, out2 = ref(x1), ref(x2)
    nn.functional.mse_loss(out1, y1).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.functional.mse_loss(out2, y2).backward()
    with engine:
        out1, out2 = engine(x1), engine(x2)
        engine.backward(nn.functional.mse_loss(out1, y1))
        assert engine.step()
        before = snapshot(engine)
        with pytest.raises(RuntimeError, match="ran before the weights changed"):
            engine.backward(nn.functional.mse_loss(out2, y2))
        assert engine.step() is False
        assert_same(before, snapshot(engine))
        out2 = engine(x2)  # the forward again, on the new weights: trains
        with engine.full_weights(writable=True):  # a load changes the weights too
            pass
        with pytest.raises(RuntimeError, match="ran before the weights changed"):
            engine.backward(nn.functional.mse_loss(out2, y2))
        engine.backward(nn.functional.mse_loss(engine(x2), y2))
        assert engine.step()


def test_unfreezing_after_initialize_and_at_resume_say_what_to_do(engine_cfg, tmp_path):
    """Progressive unfreezing: flipping `requires_grad` after initialize raises at the
    next backward, and a checkpoint resumed with another trainable set is refused;
    both errors name a way on (load the weights into a fresh engine)."""
    torch.manual_seed(0)
    model = Net()
    model.b.requires_grad_(False)
    x, y = _data(1)[0]
    with offload.initialize(model, engine_cfg(*PLACES[0])) as engine:
        model.b.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"'b\.weight': requires_grad.*state_dict\(\)"):
            engine.backward(_loss(engine, x, y))
        model.b.requires_grad_(False)
        assert _engine_step(engine, x, y)
        engine.save_checkpoint(tmp_path / "ck")
        weights = engine.state_dict()
    again = Net()
    with pytest.raises(CheckpointError, match=r"saved frozen.*trainable.*state_dict\(\)"):
        offload.initialize(again, engine_cfg(*PLACES[0]), resume=tmp_path / "ck")
    again.load_state_dict(weights)  # the way on both errors name: b now trains
    with offload.initialize(again, engine_cfg(*PLACES[0])) as engine:
        assert _engine_step(engine, x, y)
        assert not torch.equal(engine.state_dict()["b.weight"], weights["b.weight"])


def test_grad_accum_steps_is_read_from_the_engine_and_not_set_on_it(engine_cfg):
    """`engine.grad_accum_steps = 2` (the configuration key's name, on the engine object)
    was accepted and ignored: training went on one backward per step."""
    _, _, engine = _pair(engine_cfg, PLACES[0], grad_accum_steps=2)
    with engine:
        assert engine.grad_accum_steps == 2
        with pytest.raises(AttributeError, match=r"'grad_accum_steps': N"):
            engine.grad_accum_steps = 4
        assert engine.grad_accum_steps == 2 == engine.cfg.engine.grad_accum_steps


def test_zero_grad_set_to_none_false_says_once_that_it_drops(engine_cfg, caplog):
    """Gradients are dropped whatever `set_to_none` says; with False torch keeps zeros
    and its AdamW decays a parameter without a gradient, which the engine does not:
    the call says so (once), and training is torch's with set_to_none=True."""
    ref, opt, engine = _pair(engine_cfg, PLACES[0])
    try:
        for x, y in _data(3):
            engine.zero_grad(set_to_none=False)
            assert _engine_step(engine, x, y)
            _torch_step(ref, opt, x, y)
        said = [r for r in caplog.records if "set_to_none=False" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING", caplog.text
        _compare(engine, ref)
    finally:
        engine.close()


def test_zero_grad_after_every_micro_batch_of_accumulation_warns(engine_cfg, caplog):
    """Accelerate's loop (step(); zero_grad() after each micro-batch) under
    grad_accum_steps=2 drops each window's first gradient and never updates: the first
    such zero_grad() says so, once; a micro-batch discarded without a step() before
    does not warn."""
    ref, opt, engine = _pair(engine_cfg, PLACES[0], grad_accum_steps=2)
    try:
        x, y = _data(1)[0]
        engine.backward(_loss(engine, x, y))
        engine.zero_grad()  # a discarded micro-batch: torch's meaning, no warning
        assert "never updates" not in caplog.text
        for x, y in _data(4):
            engine.backward(_loss(engine, x, y))
            assert engine.step() is False
            engine.zero_grad()
        said = [r for r in caplog.records if "never updates" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING", caplog.text
        assert engine.global_step == 0
    finally:
        engine.close()
