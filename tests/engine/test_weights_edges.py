"""The model's weights as torch keeps them: frozen parameters stay frozen in full_weights,
a checkpoint leaves non-persistent buffers as the model made them, an old BatchNorm dict
loads strictly, and a param group naming a tied weight's second name takes it."""

import copy
import io
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import offload

from .models import assert_state_dict_as_torch


def test_full_weights_keep_requires_grad_of_frozen_parameters(engine_cfg):
    """The full weights a block registers keep each parameter's `requires_grad`, as on
    the plain model (a frozen parameter stays frozen inside the block)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref[0].requires_grad_(False)  # a frozen base
    with offload.initialize(copy.deepcopy(ref), engine_cfg()) as engine:
        for writable in (False, True):
            with engine.full_weights(writable=writable) as w:
                for n, p in ref.named_parameters():
                    assert w[n].requires_grad == p.requires_grad, (writable, n)
                trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
                assert trainable == [n for n, p in ref.named_parameters() if p.requires_grad]
                if writable:  # an in-place edit of a frozen weight works as on the plain model
                    engine.module[0].weight.mul_(2.0)
                    with torch.no_grad():
                        ref[0].weight.mul_(2.0)
        assert_state_dict_as_torch(engine, ref)


def test_a_copy_made_in_full_weights_is_a_plain_model(engine_cfg):
    """`copy.deepcopy(model)` inside `engine.full_weights()` (an EMA or teacher copy) is
    a plain model holding the trained weights: it runs, trains with torch's AdamW and
    keeps running after the engine closes, and the engine trains on unharmed."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg(group_size=200))
    engine.backward(engine(x).sum())
    engine.step()
    with engine.full_weights():
        twin = copy.deepcopy(engine.module)
    want = engine(x).detach()
    assert torch.equal(twin(x).detach(), want)
    opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin(x).sum().backward()
    opt.step()
    assert not torch.allclose(twin(x), want)
    engine.backward(engine(x).sum())
    engine.step()
    engine.close()
    assert twin(x).shape == (3, 4)
    assert twin.to(torch.bfloat16)[0].weight.dtype == torch.bfloat16  # no cast guard of the
    assert twin.double()[0].weight.dtype == torch.float64             # engine's at work
    saved = io.BytesIO()
    torch.save(twin, saved)  # it pickles, and a copy of it is freed as soon as dropped
    saved.seek(0)
    gone = weakref.ref(torch.load(saved, weights_only=False))
    assert gone() is None
    cfg = engine_cfg(group_size=200)
    cfg["io"]["paths"] = [cfg["io"]["paths"][0] + "-twin"]
    with offload.initialize(twin.float(), cfg) as again:  # not taken for a wrapped model
        assert again(x).shape == (3, 4)
        with pytest.raises(RuntimeError, match="converting the model"):
            twin.half()  # guarded as any model the engine holds


class Shifted(nn.Module):
    """A buffer on the root, loaded before the child's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


@pytest.mark.parametrize("assign", [False, True])
def test_model_load_state_dict_outside_full_weights_loads_nothing(engine_cfg, assign):
    """`model.load_state_dict(sd)` outside a `full_weights` block loaded the root's buffer,
    then raised at the first weight; with `assign=True` it took every tensor and the
    engine refused each later call, with no way back; inside a read-only block it loaded
    what the block discarded. It is refused before anything is loaded, naming
    engine.load_state_dict; that, and the same call inside a writable block, load as
    torch."""
    torch.manual_seed(0)
    model, ref = Shifted(), Shifted()
    with torch.no_grad():
        ref.shift.fill_(2.0)
    sd = ref.state_dict()
    x = torch.randn(3, 4)
    with offload.initialize(model, engine_cfg(group_size=10)) as engine:
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        for target in (model, model.lin):
            with pytest.raises(RuntimeError, match=r"engine.load_state_dict.*Nothing was "
                                                   r"loaded"):
                target.load_state_dict(sd if target is model else ref.lin.state_dict(),
                                       assign=assign)
        with engine.full_weights():  # read-only: what it loaded would be discarded
            with pytest.raises(RuntimeError, match=r"writable=True.*Nothing was loaded"):
                model.load_state_dict(sd, assign=assign)
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        with engine.full_weights(writable=True):
            model.load_state_dict(sd, assign=assign)
        assert torch.equal(engine(x), ref(x))
        engine.load_state_dict({k: v * 0 for k, v in sd.items()})
        assert torch.equal(engine(x), torch.zeros(3, 4))


def test_a_load_of_the_weights_a_block_holds_works_and_others_are_refused(engine_cfg):
    """Inside a writable block of one module, `model.load_state_dict(sd, strict=False)`
    of that module's weights (peft's set_peft_model_state_dict does this) loads; one of
    a weight outside the block is refused, nothing loaded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with offload.initialize(model, engine_cfg(group_size=20)) as engine:
        before = engine.state_dict()
        with engine.full_weights(["1"], writable=True):
            with pytest.raises(RuntimeError, match="Nothing was loaded"):
                model.load_state_dict({"0.weight": torch.ones(4, 4)}, strict=False)
            model.load_state_dict({"1.weight": torch.ones(4, 4)}, strict=False)
        after = engine.state_dict()
    assert torch.equal(after["1.weight"], torch.ones(4, 4))
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != "1.weight")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.5))  # persistent
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


def test_checkpoint_leaves_non_persistent_buffers_as_the_model_made_them(engine_cfg, tmp_path):
    """`initialize(..., checkpoint=dir)` loads the persistent buffers the file holds and
    leaves a non-persistent one (a rotary inv_freq, a mask) as the model made it, even
    where the file holds a tensor under its name (torch's load_state_dict loads none)."""
    torch.manual_seed(0)
    ref = Scaled()
    saved = {k: v.clone() for k, v in ref.state_dict().items()}
    saved["shift"] = torch.full((4,), -1.0)
    saved["scale"] = torch.zeros(4)  # a name the model's state dict does not hold
    (tmp_path / "ck").mkdir()
    save_file(saved, str(tmp_path / "ck" / "model.safetensors"))
    plain = copy.deepcopy(ref)
    plain.load_state_dict({k: v for k, v in saved.items() if k != "scale"})
    with offload.initialize(copy.deepcopy(ref), engine_cfg(),
                            checkpoint=tmp_path / "ck") as engine:
        assert torch.equal(engine.module.shift, torch.full((4,), -1.0))  # loaded
        assert torch.equal(engine.module.scale, torch.full((4,), 2.0))  # the model's own
        x = torch.randn(3, 4)
        with torch.no_grad():
            torch.testing.assert_close(engine(x), plain(x), atol=1e-6, rtol=0)


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))


def test_an_old_batchnorm_dict_with_version_1_metadata_loads_as_in_torch(engine_cfg):
    """A dict saved by BatchNorm version 1 (its `_metadata` says so, and it has no
    num_batches_tracked) loads strictly, as torch's load_state_dict fills the key in
    with the module's own count."""
    ref = _bn_model()
    with offload.initialize(copy.deepcopy(ref), engine_cfg()) as engine:
        torch.manual_seed(3)
        other = _bn_model()
        other[1].running_mean.uniform_()
        old = other.state_dict()  # an OrderedDict with _metadata
        del old["1.num_batches_tracked"]
        old._metadata["1"]["version"] = 1
        plain = copy.deepcopy(ref)
        res_t = plain.load_state_dict(old)  # torch: strict, nothing missing
        res = engine.load_state_dict(old)
        assert res.missing_keys == res_t.missing_keys == []
        assert res.unexpected_keys == res_t.unexpected_keys == []
        assert_state_dict_as_torch(engine, plain)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied: first name emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def test_a_group_naming_the_second_name_of_a_tied_weight_takes_it(engine_cfg):
    """A param_groups pattern matches a parameter under any of its names (a tied
    weight's second name), and the group's hyper-parameters apply to it, as torch's
    optimizer given that parameter in that group."""
    torch.manual_seed(0)
    ref = Tied()
    tied = ref.emb.weight
    opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p is not tied]},
                             {"params": [tied], "lr": 0.0}], lr=1e-2, weight_decay=0.1,
                            eps=1e-8)
    g = torch.Generator().manual_seed(1)
    with offload.initialize(copy.deepcopy(ref), engine_cfg("host"),
                            param_groups=[{"params": ["head.*"], "lr": 0.0}]) as engine:
        for _ in range(2):
            x = torch.randint(0, 16, (4, 5), generator=g)
            y = torch.randint(0, 16, (4, 5), generator=g)
            engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, 16),
                                                        y.reshape(-1)))
            engine.step()
            opt.zero_grad()
            nn.functional.cross_entropy(ref(x).reshape(-1, 16), y.reshape(-1)).backward()
            opt.step()
        sd = engine.state_dict()
        assert torch.equal(sd["head.weight"], tied.detach())  # lr 0: unchanged, as torch
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
