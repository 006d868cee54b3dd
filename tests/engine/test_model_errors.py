"""An error inside a unit's forward leaves a traceback whose frames hold the weights that
unit gathered; printing every frame's locals (as pytest and debuggers do) must not crash
the interpreter. Run in a child process: a crash there fails the test, not the suite."""

import copy
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload
from offload.engine.warm import kept_view

from .models import TiedTwice, lm_batches, lm_loss

CHILD = textwrap.dedent("""
    import sys, tempfile
    import torch
    from torch import nn
    import offload

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x, fail):
            return self.b(torch.relu(self.a(x)), fail)

    class Layer(nn.Linear):
        def forward(self, x, fail=False):
            w = self.weight  # a view of the gathered weights, in this frame
            y = x @ w.t() + self.bias
            if fail:
                raise ValueError("bad input")
            return y

    d = tempfile.mkdtemp()
    cfg = {"engine": {"params": sys.argv[1], "grads": "host", "optimizer": "host",
                      "group_size": 5000},
           "io": {"paths": [d + "/swap"]},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    model = Fails()
    model.b = Layer(64, 64)
    engine = offload.initialize(model, cfg)
    x = torch.randn(4, 64)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            try:
                engine(x, True)
            except ValueError as e:
                tb = e.__traceback__
                shown = 0
                while tb is not None:
                    for v in list(tb.tb_frame.f_locals.values()):
                        if isinstance(v, torch.Tensor):
                            shown += len(repr(v))
                    tb = tb.tb_next
                print("shown", shown)
    engine.backward(engine(x, False).sum())  # training goes on
    engine.step()
    with torch.no_grad():
        print("ok", engine(x, False).shape)
    engine.close()
""")


def _children(script: str, *params: str) -> dict[str, subprocess.CompletedProcess]:
    """{argument: its child's result} of `script` run once per argument, side by side."""
    procs = {p: subprocess.Popen([sys.executable, "-c", script, p], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for p in params}
    done = {}
    for p, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[p] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_printing_the_traceback_of_an_error_in_forward_does_not_crash(tmp_path):
    for params, res in _children(CHILD, "device", "nvme").items():
        assert res.returncode == 0, (params, res.returncode, res.stderr[-2000:])
        assert res.stdout.count("shown") == 2 and "ok" in res.stdout, res.stdout


KEPT = textwrap.dedent("""
    import copy, logging, sys, tempfile
    import torch
    from torch import nn
    import offload

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)

    class Keeps(nn.Linear):
        def forward(self, x):
            self.kept = self.weight  # a module attribute bound inside the unit, kept
            self.derived = self.weight.t()[:3]  # a tensor derived from it, kept
            return super().forward(x)

    class Derives(nn.Linear):
        def forward(self, x):
            self.derived = self.weight.t()  # only a derived tensor is kept
            return super().forward(x)

    torch.manual_seed(0)
    ref = nn.Sequential(Keeps(32, 32), nn.ReLU(), Derives(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    d = tempfile.mkdtemp()
    cfg = {"engine": {"params": sys.argv[1], "grads": "host", "optimizer": "host",
                      "group_size": 1},
           "io": {"paths": [d + "/swap"]},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
           "optim": {"lr": 1e-2, "weight_decay": 0.0}}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    with offload.initialize(model, cfg) as engine:
        for step in range(3):
            x = torch.randn(8, 32)
            before = ref[0].weight.detach().clone()  # what the forward saw
            engine.backward(engine(x).square().mean())
            engine.step()
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
            # read after the units ended (the engine freed their gathers) and the step
            print("kept", step, torch.allclose(model[0].kept.detach(), before, atol=1e-5),
                  torch.equal(model[0].derived.detach(), model[0].kept.detach().t()[:3]))
            print("derived", step, model[2].derived.abs().sum().item(),
                  model[0].derived.shape)
        got = engine.state_dict()["4.weight"]
        print("trained", (got - ref[4].weight.detach()).abs().max().item() < 1e-5)
    print("ok")
""")


def test_tensors_kept_from_a_units_weights_do_not_crash():
    """[Note: kept weights] / [Note: freed gathers read zeros]: a module attribute kept
    past its unit keeps the values it had there (torch's weights before the step, here
    compared after it: the step's update differs), a tensor only derived from one reads
    zeros; neither crashes, and training matches torch AdamW."""
    # a CPU device tier is host memory as "host" is
    for params, res in _children(KEPT, "host", "nvme").items():
        assert res.returncode == 0, (params, res.returncode, res.stderr[-2000:])
        out = res.stdout
        assert "ok" in out and "trained True" in out, out
        assert out.count("kept") == 3 and all(
            line.split()[2:] == ["True", "True"] for line in out.splitlines()
            if line.startswith("kept")), out
        assert out.count("still referenced after the unit") == 1, out  # '0.weight', once
        assert "parameter '0.weight'" in out, out
        for line in out.splitlines():
            if line.startswith("derived"):
                assert line.split()[2] == "0.0", out  # '2.weight' only derived: zeros


def test_weights_autograd_saves_are_not_taken_for_kept(engine_cfg, caplog):
    """`h * self.scale` makes autograd save the weight's view itself (C++ holds it,
    which torch shows as a reference to its Python object): not a weight the user
    kept ([Note: kept weights]), so no warning, and the gathered memory is given
    back after the unit as for any other."""
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(TiedTwice(), engine_cfg("host")) as engine:
        for x, y in lm_batches(2):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    assert not [r for r in caplog.records if "still referenced" in r.getMessage()]
    flat = torch.ones(8, requires_grad=True) * 1
    views = [flat[:4]]
    out = torch.randn(4, requires_grad=True) * views[0]  # saves views[0]
    assert kept_view(views) is None
    kept = views[0]
    assert kept_view(views) == 0
    del out, kept


def test_an_error_in_the_model_called_directly_leaves_the_engine_usable(engine_cfg):
    """The model object itself (as `model.generate` calls it) raising inside a unit: the
    unit's gathered weights are given back as after an error through the engine, so
    nothing stays "in use" and changing the weights between steps works."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        want = engine.state_dict()
        x = torch.randn(2, 16)
        with torch.no_grad():
            expected = engine(x)

        def boom(module, args):
            raise ValueError("bad input")
        handle = model[2].register_forward_pre_hook(boom)
        with pytest.raises(ValueError, match="bad input"), torch.no_grad():
            model(x)
        handle.remove()
        assert [st.active for st in engine._states] == [0] * len(engine._states)
        engine.load_state_dict(want)  # refused while a unit looked in use
        with torch.no_grad():
            assert torch.equal(engine(x), expected)


@pytest.mark.parametrize("call", ["engine", "model"])
def test_a_forward_that_raises_under_inference_mode_leaves_training_as_torch(engine_cfg, call):
    """An evaluation batch that raises inside a unit under `torch.inference_mode()` (an
    index past the embedding table) and training on: the unit's weights took their fresh
    storage inside the user's inference mode, as inference tensors, so their gathers
    made weights autograd could not see: the whole model's output had no grad_fn, and
    in a model of several units one unit silently stopped training."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 1))
    ref = copy.deepcopy(plain)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    cfg = engine_cfg("host", group_size=100)
    cfg["optim"].update(lr=1e-2, weight_decay=0.01)
    with offload.initialize(plain, cfg) as engine:
        x = torch.tensor([[1, 2, 3]])
        with pytest.raises(IndexError), torch.inference_mode():
            (engine if call == "engine" else plain)(torch.tensor([[99]]))
        for _ in range(2):
            engine.backward(engine(x).mean())
            assert engine.step()
            ref(x).mean().backward()
            opt.step()
            opt.zero_grad()
        got = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_a_cast_of_the_model_is_refused_before_anything_changes(engine_cfg):
    """[Note: casts refused]: `.half()` / `.to(dtype)` on the engine or on the wrapped
    model used to convert the buffers before failing at the first parameter; now it
    is refused first, and a call that changes nothing (`.float()`, `.to("cpu")` of an
    fp32 CPU engine) is a no-op."""
    class Scale(torch.nn.Module):  # a buffer-only module first, as a rotary cache
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("s", torch.full((8,), 1.0 / 3.0))

        def forward(self, x):
            return x * self.s
    model = torch.nn.Sequential(Scale(), torch.nn.Linear(8, 4))
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        x = torch.randn(2, 8)
        with torch.no_grad():
            want = engine(x)
        for cast in (lambda: engine.half(), lambda: model.half(),
                     lambda: engine.to(torch.float64), lambda: model.to(torch.bfloat16)):
            with pytest.raises(RuntimeError, match=r"converting the model .* is refused, "
                                                   r"nothing was changed; set engine\.dtype"):
                cast()
            assert model[0].s.dtype == torch.float32
        assert engine.float() is engine and engine.to("cpu") is engine
        model.to("cpu")
        with torch.no_grad():
            assert torch.equal(engine(x), want)



def test_to_empty_after_initialize_is_refused_before_the_buffers_change(engine_cfg):
    """[Note: casts refused] `model.to_empty(device=...)` after initialize (FSDP2's
    recipe after wrapping a meta model) keeps dtype and device, so it passed the cast
    guard, replaced the BatchNorm's statistics with uninitialised memory, and then
    failed at the first parameter with "used outside the forward of unit"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(8, affine=False), torch.nn.Linear(8, 4))
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        engine.backward(engine(torch.randn(16, 8) * 3 + 1).square().mean())
        assert engine.step()
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        for call in (lambda: model.to_empty(device="cpu"), lambda: model[0].to_empty(device="cpu"),
                     lambda: model._apply(torch.clone)):
            with pytest.raises(RuntimeError, match=r"a function that replaces its tensors "
                                                   r"\(to_empty.* nothing was changed"):
                call()
        for k, v in engine.state_dict().items():
            assert torch.equal(v, before[k]), k
        engine.backward(engine(torch.randn(16, 8)).square().mean())
        assert engine.step()

def test_a_parameter_replaced_after_initialize_is_named(engine_cfg):
    """Assigning a new nn.Parameter to a module is not seen by training; reading the
    full weights then named the slot as a bare KeyError, now the parameter and the fix."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        original = model[1].weight
        model[1].weight = torch.nn.Parameter(torch.zeros(2, 8))
        with pytest.raises(RuntimeError, match=r"parameter '1\.weight' was replaced after "
                                               r"initialize .*full_weights\(writable=True\)"):
            with engine.full_weights():
                pass
        with pytest.raises(RuntimeError, match=r"parameter '1\.weight' was replaced after "):
            engine.state_dict()  # not the new tensor, which training never sees
        model[1].weight = original
        with engine.full_weights() as w:
            assert set(w) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_setting_data_of_a_held_parameter_is_refused(engine_cfg):
    """`p.data = t` went past the stand-in's dispatch: nothing changed (or, for
    another shape, the stand-in's shape did) and nothing said so. It raises now,
    naming the parameter; inside a writable block it edits the weights."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with offload.initialize(model, engine_cfg("host", group_size=300)) as engine:
        with torch.no_grad():
            want = engine(x)
        # a tensor, one of another shape, a stand-in of the same shape (its own detach)
        for value in (torch.zeros(2, 8), torch.zeros(4, 8), model[1].weight.detach()):
            with pytest.raises(RuntimeError, match=r"\.data of parameter '1\.weight' .*"
                                                   r"full_weights\(writable=True\)"):
                model[1].weight.data = value
        assert model[1].weight.shape == (2, 8)
        engine.backward(engine(x).sum())
        with pytest.raises(RuntimeError, match=r"\.grad of parameter '0\.bias'.*"
                                               r"optim\.max_grad_norm"):
            model[0].bias.grad.data = torch.zeros(8)
        engine.zero_grad()
        with torch.no_grad():
            assert torch.equal(engine(x), want)
        with engine.full_weights(writable=True):
            model[1].weight.data = torch.zeros(2, 8)
        with torch.no_grad():
            assert torch.equal(engine(x), engine.state_dict()["1.bias"].expand(4, 2))
        model.to(torch.float32)  # a cast that changes nothing still works
    with pytest.raises(RuntimeError, match=r"\.data of parameter '1\.weight' .*is closed"):
        model[1].weight.data = torch.zeros(2, 8)


def test_a_second_thread_is_refused_while_the_model_runs(engine_cfg):
    """[Note: one thread at a time]: a forward (or the model called directly) on a
    second thread while the first thread's forward is inside the model would share
    and free its gathered weights (wrong outputs, before); it is refused before it
    touches anything, and the first forward's result is right."""
    import threading

    class Waits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.inside, self.go = threading.Event(), threading.Event()

        def forward(self, x):
            if not self.inside.is_set():
                self.inside.set()
                assert self.go.wait(30)
            return self.lin(x)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Waits(), torch.nn.Linear(8, 2))
    ref = [m for m in model.modules()]
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = torch.nn.Sequential(ref[1], ref[2].lin, ref[4])(x)
    with offload.initialize(model, engine_cfg("host", group_size=100)) as engine:
        got = {}

        def first():
            with torch.no_grad():
                got["y"] = engine(x)
        t = threading.Thread(target=first)
        t.start()
        assert model[1].inside.wait(30)
        for call in (lambda: engine(x), lambda: model(x)):
            with pytest.raises(RuntimeError, match="running on another thread: one thread at "
                                                   "a time runs it"), torch.no_grad():
                call()
        model[1].go.set()
        t.join(30)
        assert torch.equal(got["y"], want)
        with torch.no_grad():  # and the engine is free again
            assert torch.equal(engine(x), want)


def test_pickling_the_model_or_the_engine_names_the_way_to_save(engine_cfg):
    """`torch.save(model)` failed with pickle's "Can't pickle local object
    'OffloadEngine._make_post.<locals>.post'"; the model and the engine now refuse with
    the ways to save that work, and the engine trains on afterwards."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with offload.initialize(model, engine_cfg("host", group_size=100)) as engine:
        x = torch.randn(2, 8)
        for save in (lambda: torch.save(model, io.BytesIO()), lambda: pickle.dumps(model),
                     lambda: torch.save(engine, io.BytesIO()), lambda: copy.deepcopy(engine)):
            with pytest.raises(TypeError, match=r"cannot be pickled.*engine\.save_pretrained"
                                                r"\(dir\) or torch\.save\(engine\.state_dict"):
                save()
        with pytest.raises(RuntimeError, match=r"parameter '0\.weight'.*full_weights"):
            copy.deepcopy(model)  # the stand-ins' own error, as before
        engine.backward(engine(x).sum())
        assert engine.step()
        torch.save(engine.state_dict(), io.BytesIO())


class _ReadsChild(torch.nn.Module):
    """A block whose own forward reads its child's weight (a tied projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.mix(torch.tanh(self.proj(x))) + torch.nn.functional.linear(x, self.proj.weight)


def test_whole_modules_keeps_a_parent_that_reads_its_childs_weight_in_one_unit(engine_cfg):
    """At a group size that makes each Linear a unit of its own, the block's read of
    proj.weight raises, naming engine.whole_modules; listing the block there gathers
    it with its children as one unit, and it trains as torch. A name the model does
    not have is refused before anything is made, with names it has."""
    import copy

    torch.manual_seed(0)
    ref = torch.nn.Sequential(_ReadsChild(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 16)
    with offload.initialize(copy.deepcopy(ref), engine_cfg("host", group_size=300)) as engine:
        with pytest.raises(RuntimeError, match=r"parameter '0\.proj\.weight'.*whole_modules "
                                               r"\(likely '0', or its class '_ReadsChild'"):
            engine(x)
    for whole in (["0"], ["_ReadsChild"]):  # by name, or by class as FSDP's wrap policies
        cfg = engine_cfg("host", group_size=300, whole_modules=whole)
        with offload.initialize(copy.deepcopy(ref), cfg) as engine:
            assert [u.name for u in engine.units].count("0") == 1
    cfg = engine_cfg("host", group_size=300, whole_modules=["_ReadsChild"])
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    with offload.initialize(copy.deepcopy(ref), cfg) as engine:
        for _ in range(3):
            engine.backward(engine(x).square().mean())
            engine.step()
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=2e-6, rtol=0, msg=lambda m: f"{k}: {m}")
    bad = engine_cfg("host", group_size=300, whole_modules=["proj"])
    with pytest.raises(offload.ConfigError, match=r"engine\.whole_modules\[0\]: Sequential has "
                                                  r"no module 'proj', nor .*'0\.proj'"):
        offload.initialize(copy.deepcopy(ref), bad)
    swap = Path(bad["io"]["paths"][0])
    assert not swap.exists() or not list(swap.iterdir())  # refused before any swap file


def test_backward_names_torchs_arguments_it_does_not_take(engine_cfg):
    """engine.backward(loss, retain_graph=True) was Python's "unexpected keyword";
    refused naming the argument and the fix, before anything, and the loss's
    backward then runs as usual."""
    torch.manual_seed(0)
    ref = TiedTwice()
    (x, y), = lm_batches(1)
    with offload.initialize(copy.deepcopy(ref), engine_cfg("host", group_size=300)) as e:
        loss = lm_loss(e(x), y)
        with pytest.raises(TypeError, match=r"takes no inputs, retain_graph: .*"
                                            r"engine.backward\(loss_a \+ loss_b\)"):
            e.backward(loss, retain_graph=True, inputs=[x])
        e.backward(loss)
        assert e.step()
