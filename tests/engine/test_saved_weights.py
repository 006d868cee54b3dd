"""[Note: weights saved for a backward] in engine/saved_weights.py: a backward that
reaches a unit by a path its outputs' hooks do not see (an auxiliary loss kept on the
module, an output in a slotted object or a deque) gathers the unit's weights first,
and gets torch's gradients; [Note: a graph of older weights] in engine.py counts
each group's changes, so a step that updated other groups leaves a graph usable; a
backward that crosses into another engine's model names the fixes."""

import collections
import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import offload

from offload.engine.units import output_tensors

from .models import assert_weights_as_torch


def _train_both(engine, ref, loss_of, steps=2):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        engine.backward(loss_of(engine, x))
        engine.step()
        loss_of(ref, x).backward()
        opt.step()
        opt.zero_grad()


class _MoE(nn.Module):
    """An auxiliary loss kept on the module, computed after the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        out = torch.tanh(self.lin(x))
        self.aux_loss = self.gate(x).pow(2).mean()
        return out


class _Stashing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b1, self.b2 = nn.Linear(6, 16), _MoE(), _MoE()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.b2(self.b1(self.inp(x)))
        return self.head(h).square().mean() + self.b1.aux_loss + self.b2.aux_loss


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_an_auxiliary_loss_kept_on_the_module_trains_as_torch(engine_cfg, placement):
    """Autograd reached each block's gate through `self.aux_loss` before the block's
    output hook gathered it: the gate's backward ran on the freed (zero) weights and
    the input layer's gradient came out with the wrong sign, silently."""
    torch.manual_seed(0)
    ref = _Stashing()
    cfg = engine_cfg(placement, placement, placement, group_size=400)  # a block a unit
    with offload.initialize(copy.deepcopy(ref), cfg) as engine:
        _train_both(engine, ref, lambda m, x: m(x))
        assert_weights_as_torch(engine, ref, atol=1e-6)


class _Tokenizer(nn.Module):
    """A unit whose output (codes) needs no gradient: the backward reaches it only by the
    auxiliary loss it keeps on itself."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.proj, self.checkpointed = nn.Linear(16, 16), checkpointed

    def forward(self, h):
        z = (torch.utils.checkpoint.checkpoint(self.proj, h, use_reentrant=False)
             if self.checkpointed else self.proj(h))
        self.commit = z.pow(2).mean()
        return z.argmax(-1)


class _Codes(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.enc, self.tok = nn.Linear(6, 16), _Tokenizer(checkpointed)
        self.emb = nn.Embedding(16, 4)

    def forward(self, x):
        return self.emb(self.tok(torch.tanh(self.enc(x)))).pow(2).mean() + self.tok.commit


@pytest.mark.parametrize("hooks", ["save_on_cpu", "pass-through"])
def test_an_auxiliary_loss_under_the_users_saved_tensor_hooks_trains_as_torch(engine_cfg,
                                                                            hooks):
    """Under other saved-tensor hooks the unit's stood aside, holding that those keep
    the tensors: save_on_cpu on a CPU device (its `tensor.cpu()` is the tensor) and a
    user's pass-through hooks kept the weight's view, and the auxiliary loss's backward
    read the freed weights as zeros (enc.weight 3e-2 off torch, silently). They are
    wrapped now: unpacked after the unit's weights are gathered."""
    def under():
        return (torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))

    def loss_of(model, x):
        with under():
            return model(x)
    torch.manual_seed(0)
    ref = _Codes()
    with offload.initialize(copy.deepcopy(ref), engine_cfg(group_size=300)) as engine:
        _train_both(engine, ref, loss_of, steps=3)
        assert_weights_as_torch(engine, ref, atol=1e-6)


class _Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.lin(x).square()


class _WithChildren(nn.Module):
    """A unit with a parameter of its own and two child units, every saved tensor 16 x 16."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.c1, self.c2 = _Square(), _Square()

    def forward(self, x):
        return self.c2(self.c1((x @ self.w).square())) * x


class _CheckpointedParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.o, self.head = nn.Linear(6, 16, bias=False), _WithChildren(), \
            nn.Linear(16, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.o, torch.tanh(self.inp(x)),
                                              use_reentrant=False)
        return self.head(h).square().mean()


def test_units_inside_a_checkpointed_unit_save_through_the_checkpoint(engine_cfg):
    """A unit nested in a checkpointed unit found the parent unit's hooks on top, and
    saved its tensors past the checkpoint's: the recomputation, which saves every
    tensor, paired them by position with the wrong ones (0.058 off torch after three
    steps with every tensor 16 x 16, silently). It saves through the checkpoint too."""
    torch.manual_seed(0)
    ref = _CheckpointedParent()
    with offload.initialize(copy.deepcopy(ref), engine_cfg(group_size=300)) as engine:
        assert {u.name for u in engine.units} >= {"o", "o.c1", "o.c2"}
        _train_both(engine, ref, lambda m, x: m(x), steps=3)
        assert_weights_as_torch(engine, ref, atol=1e-6)


def test_a_checkpoint_inside_a_unit_reached_by_an_auxiliary_loss_says_so(engine_cfg):
    """The checkpoint's recomputation, in a backward that reached the unit only by its
    auxiliary loss, read the unit's absent weights: the message blamed a read outside
    the unit's forward and named engine.whole_modules, which changes nothing. It says
    what happened and the two fixes now."""
    torch.manual_seed(0)
    with offload.initialize(_Codes(checkpointed=True), engine_cfg(group_size=300)) as engine:
        with pytest.raises(RuntimeError, match="a backward read a weight of a unit whose "
                           "weights were not gathered for it.*auxiliary loss"):
            engine.backward(engine(torch.randn(8, 6)))


class _Slotted:
    __slots__ = ("logits",)

    def __init__(self, logits) -> None:
        self.logits = logits


@dataclass(slots=True)
class _SlottedData:
    logits: torch.Tensor


_OUTPUTS = {"slots": (_Slotted, lambda o: o.logits),
            "dataclass-slots": (_SlottedData, lambda o: o.logits),
            "deque": (lambda t: collections.deque([t]), lambda o: o[0])}


@pytest.mark.parametrize("form", sorted(_OUTPUTS))
def test_outputs_in_slotted_objects_and_deques_train_as_torch(engine_cfg, form):
    """The output hooks' walk read `__dict__` only: a slotted output (attrs' classes)
    or a deque got no hook, and its unit's backward ran on zero weights: every layer
    but the last kept its weights. Its weight views are copied too."""
    wrap, unwrap = _OUTPUTS[form]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 1)
            self.pos = nn.Parameter(torch.randn(8, 1))

        def forward(self, x):
            return wrap(self.b(torch.tanh(self.a(x)))), wrap(self.pos[:8])

    torch.manual_seed(0)
    ref = Net()
    with offload.initialize(copy.deepcopy(ref), engine_cfg("host")) as engine:
        def loss_of(m, x):
            out, pos = m(x)
            return (unwrap(out) + unwrap(pos)).square().mean()
        _train_both(engine, ref, loss_of)
        assert_weights_as_torch(engine, ref, atol=1e-6)
    t = torch.ones(2)
    assert [id(u) for u in output_tensors(wrap(t))] == [id(t)]  # the hooks' walk


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
        self.D = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z=None, x=None):
        return self.G(z) if z is not None else self.D(x)


def test_a_step_of_other_groups_leaves_the_graph_usable(engine_cfg):
    """One engine holding a GAN: the discriminator's step changed only its groups, yet
    the generator's backward through a forward made before it was refused, claiming
    torch refuses it too; torch trains it. A step that changed the generator's groups
    is still refused."""
    bce = nn.functional.binary_cross_entropy_with_logits
    torch.manual_seed(0)
    ref = _GAN()
    z, real = torch.randn(16, 4), torch.randn(16, 8) + 2
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg("host", group_size=300))
    model = engine.module
    try:
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for m, backward, step in ((ref, lambda l: l.backward(), opt.step),
                                  (engine, engine.backward, engine.step)):
            fake = m(z=z)
            backward(bce(m(x=real), ones) + bce(m(x=fake.detach()), zeros))
            step()
            opt.zero_grad()
            for p in (ref if m is ref else model).D.parameters():
                p.requires_grad_(False)
            backward(bce(m(x=fake), ones))  # G's forward ran before the D step
            step()
        assert_weights_as_torch(engine, ref, atol=1e-6)
        fake = engine(z=z)
        engine.backward(fake.square().mean())
        engine.step()  # G's groups changed
        with pytest.raises(RuntimeError, match="ran before the weights changed"):
            engine.backward(bce(engine(x=fake), ones))
    finally:
        engine.close()


def test_a_backward_crossing_into_another_engine_names_the_fixes(engine_cfg, tmp_path):
    """G and D in engines of their own, G's backward through trainable D: refused
    with "ran outside engine.backward()", when the program had called it; the message
    names the fixes, and the first one (D frozen) trains G as torch."""
    torch.manual_seed(0)
    g_ref = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    d_ref = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    cfg_d = engine_cfg("host")
    cfg_d["io"]["paths"] = [str(tmp_path / "d")]
    z = torch.randn(16, 4)
    with offload.initialize(copy.deepcopy(g_ref), engine_cfg("host")) as eg, \
            offload.initialize(copy.deepcopy(d_ref), cfg_d) as ed:
        with pytest.raises(RuntimeError, match="another engine's backward.*Freeze"):
            eg.backward(ed(eg(z)).square().mean())
        for p in list(ed.module.parameters()) + list(d_ref.parameters()):
            p.requires_grad_(False)
        eg.backward(ed(eg(z)).square().mean())
        assert eg.step()
        opt = torch.optim.AdamW(g_ref.parameters(), lr=1e-2, weight_decay=0.1)
        d_ref(g_ref(z)).square().mean().backward()
        opt.step()
        assert_weights_as_torch(eg, g_ref, atol=1e-6)


def _tanh_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])


def test_a_graph_never_run_backward_is_collected(engine_cfg):
    """A forward with autograd on and no backward (an evaluation without no_grad, a
    skipped batch): an op that saves its output (tanh) made, through the packed
    tensor's Python object, a cycle the collector could not break, and every such
    graph stayed alive with its activations."""
    import gc
    import weakref
    with offload.initialize(_tanh_stack(), engine_cfg("host", group_size=300)) as engine:
        outs = [weakref.ref(engine(torch.randn(4, 16))) for _ in range(3)]
        gc.collect()
        assert [o() for o in outs] == [None] * 3


def test_an_in_place_change_of_a_saved_tensor_is_refused_as_torch(engine_cfg):
    """Saved-tensor hooks turn off torch's check of a saved tensor's version: a unit's
    activation changed in place after it was saved trained on a wrong gradient."""
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            h = torch.sigmoid(self.lin(x))
            h.mul_(2)  # sigmoid's backward needs its output as it was
            return h

    with offload.initialize(InPlace(), engine_cfg("host")) as engine:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.backward(engine(torch.randn(4, 16)).sum())


def test_an_interrupted_forward_leaves_no_hooks_on(engine_cfg):
    """torch skips a unit's forward hooks for a KeyboardInterrupt: the engine's
    saved-tensor hooks stayed on for the program's own autograd code, for good."""
    model = _tanh_stack()

    def ctrl_c(module, args):
        raise KeyboardInterrupt
    handle = model[1].register_forward_pre_hook(ctrl_c)
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        with pytest.raises(KeyboardInterrupt):
            engine(torch.randn(4, 16))
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        handle.remove()
        engine.backward(engine(torch.randn(4, 16)).sum())
        assert engine.step()


def test_a_step_of_early_updates_refuses_an_older_graph(engine_cfg):
    """Updates that ran in the backward (optimizer on NVMe, fp32, no clipping) were not
    counted as changes: a backward through a forward made before the step ran."""
    with offload.initialize(_tanh_stack(), engine_cfg(
            "host", "host", "nvme", group_size=300)) as engine:
        old = engine(torch.randn(4, 16)).sum()
        engine.backward(engine(torch.randn(4, 16)).sum())
        assert engine._early_updates_queued()
        assert engine.step()
        with pytest.raises(RuntimeError, match="ran before the weights changed"):
            engine.backward(old)


def _forces(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A force as the gradient of an energy, per sample: torch.func outside a forward."""
    return torch.vmap(torch.func.grad(lambda r: torch.tanh(lin(r)).sum()))(x)


class _Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.vmap(torch.func.grad(lambda r: torch.tanh(self.lin(r)).sum()))(x)


class _EnergyByHelper(_Energy):
    def forward(self, x):
        return _forces(self.lin, x)


@pytest.mark.parametrize("energy", [_Energy, _EnergyByHelper], ids=["forward", "helper"])
def test_torch_func_in_a_units_forward_turns_its_hooks_off(engine_cfg, energy):
    """torch.func's transforms refuse to run under saved-tensor hooks: a unit whose
    forward names one gets none, and trains as torch from the first step; one called
    from a helper fails the first forward, saying so, and trains from then on."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), energy(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with offload.initialize(copy.deepcopy(ref), engine_cfg("host", group_size=80)) as engine:
        if energy is _EnergyByHelper:
            with pytest.raises(RuntimeError, match="torch.func's grad.*run it again"):
                engine(x)
        engine.backward(engine(x).square().mean())
        assert engine.step()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        ref(x).square().mean().backward()
        opt.step()
        assert_weights_as_torch(engine, ref, atol=1e-6)
