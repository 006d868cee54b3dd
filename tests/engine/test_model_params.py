"""The model stays a model after `initialize`: registered parameters, full weights on
request, evaluation between steps, state dicts; with frozen parameters, BatchNorm
buffers, tied weights, a module under two names called twice, a parameter unused in
some steps."""

import copy
import io
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import offload
from offload.store import Tier

from .models import assert_state_dict_as_torch

PLACEMENTS = [("device", "host", "host"), ("host", "host", "nvme"), ("nvme", "nvme", "nvme")]
IDS = ["none", "host", "nvme"]


class Zoo(nn.Module):
    def __init__(self, bn: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.again = self.block  # one module under two names, called twice
        self.bn = nn.BatchNorm1d(32) if bn else nn.Identity()  # fp32 running stats
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor, use: bool = False) -> torch.Tensor:
        h = self.again(self.block(self.emb(x)))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.frozen(h)
        if use:
            h = self.sometimes(h)
        return self.head(h)


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (4, 6), generator=g), torch.randint(0, 64, (4, 6), generator=g))
            for _ in range(n)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 64).float(), y.reshape(-1))


def _engine(engine_cfg, placement, dtype="fp32", seed=0):
    torch.manual_seed(seed)
    ref = Zoo(bn=dtype == "fp32")  # torch's BatchNorm refuses bf16 weights with fp32 stats
    cfg = engine_cfg(*placement, dtype=dtype, group_size=1200)
    cfg["optim"]["eps"] = 1e-6
    return offload.initialize(copy.deepcopy(ref), cfg), ref


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_registered_parameters_mirror_the_plain_model(engine_cfg, placement, dtype):
    engine, ref = _engine(engine_cfg, placement, dtype)
    model = engine.module
    try:
        got, want = list(model.named_parameters()), list(ref.named_parameters())
        assert [n for n, _ in got] == [n for n, _ in want]
        assert [n for n, _ in engine.named_parameters()] == [n for n, _ in want]
        for listing in ("named_buffers", "named_modules"):  # the model's names, as state_dict
            assert ([n for n, _ in getattr(engine, listing)()]
                    == [n for n, _ in getattr(ref, listing)()]), listing
        assert engine.get_submodule("block.0") is model.block[0]
        assert engine.get_parameter("block.0.weight") is model.block[0].weight
        for (n, p), (_, q) in zip(got, want):
            assert isinstance(p, nn.Parameter), n
            assert p.shape == q.shape and p.requires_grad == q.requires_grad, n
            assert p.dtype == engine.dtype and p.device == engine.device, n
        assert sum(p.numel() for p in model.parameters()) == sum(
            p.numel() for p in ref.parameters())
        assert model.head.weight is model.emb.weight  # tied, as in torch
        assert model.block[0].weight is dict(got)["block.0.weight"]
        assert not model.frozen.weight.requires_grad
        assert list(engine.state_dict()) == list(ref.state_dict())  # aliases, buffers
        assert len(ref.state_dict()) == 10 + 5 * (dtype == "fp32")
        p = model.block[0].weight
        assert "AbsentWeight" in repr(p)
        for read in (lambda: p.sum(), lambda: p.tolist(), lambda: p + 1,
                     lambda: p.detach().clone(), lambda: p.cpu().numpy(),
                     lambda: p.untyped_storage(), lambda: p.data_ptr(),
                     lambda: torch.save(model.state_dict(), io.BytesIO()),
                     lambda: copy.deepcopy(model)):
            with pytest.raises(RuntimeError, match=r"engine\.full_weights\(\)"):
                read()
        with pytest.raises(RuntimeError, match=r"parameter 'block.0.weight' is used"):
            model.again[0].weight.sum()  # named as torch first lists it
    finally:
        engine.close()


def _train(engine, ref, opt, batches):
    for i, (x, y) in enumerate(batches):
        use = i % 2 == 1  # `sometimes` is unused in every other step
        engine.backward(_loss(engine(x, use), y))
        engine.step()
        opt.zero_grad()
        _loss(ref(x, use), y).backward()
        opt.step()


def _assert_weights(engine, ref, atol):
    with engine.full_weights() as w:
        for n, q in ref.named_parameters():
            torch.testing.assert_close(w[n], q.detach(), atol=atol, rtol=0,
                                       msg=lambda m: f"{n}: {m}")
            assert getattr(engine.module.get_submodule(n.rpartition(".")[0]),
                           n.rpartition(".")[2]) is w[n]
    assert isinstance(engine.module.emb.weight, nn.Parameter)  # the stand-in is back
    with pytest.raises(RuntimeError, match="full_weights"):
        engine.module.emb.weight.sum()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_weights_buffers_and_evaluation_between_steps_match_torch(engine_cfg, placement):
    engine, ref = _engine(engine_cfg, placement)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1, eps=1e-6)
    batches = _batches(5)
    try:
        _train(engine, ref, opt, batches[:3])
        _assert_weights(engine, ref, atol=3e-6)
        sd, want = engine.state_dict(), ref.state_dict()
        for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            torch.testing.assert_close(sd[k], want[k], atol=1e-6, rtol=0)
        plan = list(engine.trace.plan)
        x = batches[3][0]
        engine.eval(), ref.eval()  # BatchNorm uses its running statistics
        with torch.no_grad():
            torch.testing.assert_close(engine(x, True), ref(x, True), atol=2e-5, rtol=0)
            torch.testing.assert_close(engine(x), ref(x), atol=2e-5, rtol=0)
        with torch.inference_mode():
            torch.testing.assert_close(engine(x), ref(x), atol=2e-5, rtol=0)
        engine.train(), ref.train()
        assert engine.trace.plan == plan and engine.trace.position == -1  # untouched
        _train(engine, ref, opt, batches[3:])
        _assert_weights(engine, ref, atol=5e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_writable_full_weights_reach_every_tier_and_the_master(engine_cfg, placement, dtype):
    engine, ref = _engine(engine_cfg, placement, dtype)
    model = engine.module
    x, y = _batches(1, seed=3)[0]
    try:
        before = engine.state_dict()
        with pytest.raises(ZeroDivisionError):  # a block that raises writes nothing
            with engine.full_weights(model.block, writable=True) as w:
                w["block.0.weight"].data.fill_(7.0)
                1 / 0
        with pytest.raises(ValueError, match="shape"):
            with engine.full_weights("block", writable=True):
                model.block[0].weight = nn.Parameter(torch.zeros(3, 3))
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        with engine.full_weights(["block", model.frozen], writable=True) as w:
            assert set(w) >= {"block.0.weight", "again.0.weight", "frozen.weight"}
            assert "emb.weight" not in w
            model.block[0].weight.data.fill_(5.0)  # in place
            model.frozen.bias = nn.Parameter(torch.full((32,), 0.25))  # a new parameter
        with torch.no_grad():
            ref.block[0].weight.fill_(5.0)
            ref.frozen.bias.fill_(0.25)
        if placement[0] == "nvme":  # the new partitions (staged, switched in) to NVMe:
            for g in engine.groups:  # the forward below reads them back from there
                engine.store.evict(("p", g.gid)).wait()
                assert engine.store.info(("p", g.gid)).valid == {Tier.NVME}, g.gid
        sd = engine.state_dict()
        assert torch.equal(sd["block.0.weight"], ref.block[0].weight)  # the master
        assert torch.equal(sd["again.0.weight"], ref.block[0].weight)
        assert torch.equal(sd["frozen.bias"], ref.frozen.bias)
        low = copy.deepcopy(ref).to(engine.dtype)  # the compute-dtype partitions
        with torch.no_grad():
            torch.testing.assert_close(engine(x), low(x), atol=1e-5, rtol=0)
        engine.backward(_loss(engine(x), y))
        engine.step()
        with engine.full_weights("block") as w:  # the step started from the new master
            assert (w["block.0.weight"] - 5.0).abs().max() < 0.1
    finally:
        engine.close()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_load_state_dict_takes_what_state_dict_gives(engine_cfg, placement):
    engine, ref = _engine(engine_cfg, placement)
    torch.manual_seed(7)
    other = Zoo()
    other.bn.running_mean.uniform_()
    x, y = _batches(1, seed=4)[0]
    try:
        bad = dict(other.state_dict())
        bad.pop("again.0.bias")
        before = engine.state_dict()
        with pytest.raises(RuntimeError, match=r"missing keys \['again.0.bias'\]"):
            engine.load_state_dict(bad)
        with pytest.raises(RuntimeError, match=r"unexpected keys \['extra'\]"):  # as torch
            engine.load_state_dict(dict(other.state_dict(), extra=torch.zeros(1)))
        bad["block.0.weight"] = torch.zeros(2, 2)
        with pytest.raises(RuntimeError, match="'block.0.weight' has shape"):
            engine.load_state_dict(bad, strict=False)
        # values without data, or no tensor at all, after keys that would load: refused
        # before the first of them changes (the head's weight is the tied emb.weight)
        for value, what in [(torch.empty(32, 32, device="meta"), "meta tensor"),
                            ("weights", "str, not a tensor"),
                            (torch.eye(32).to_sparse(), "sparse_coo tensor"),
                            # the model's own, outside full_weights: no values either
                            (engine.module.state_dict()["sometimes.weight"], "stand-in")]:
            last = dict(other.state_dict(), **{"sometimes.weight": value})
            with pytest.raises(RuntimeError, match=f"'sometimes.weight' is a {what}"):
                engine.load_state_dict(last)
        assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
        with pytest.raises(RuntimeError, match=r"Load with engine\.load_state_dict.*Nothing was "
                                               r"loaded"):
            engine.module.load_state_dict(other.state_dict())  # torch's own: refused, naming
        assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())  # ours
        res = engine.load_state_dict(other.state_dict())  # torch's, with every alias
        assert not res.missing_keys and not res.unexpected_keys
        assert_state_dict_as_torch(engine, other)
        # a dict saved before BatchNorm counted batches: torch keeps the module's count
        old = {k: v for k, v in before.items() if k != "bn.num_batches_tracked"}
        res = engine.load_state_dict(old)
        assert not res.missing_keys and not res.unexpected_keys
        sd = engine.state_dict()
        assert torch.equal(sd["bn.num_batches_tracked"], other.bn.num_batches_tracked)
        assert torch.equal(sd["bn.running_mean"], before["bn.running_mean"])
        engine.load_state_dict(other.state_dict())
        # each name its own value: a tied parameter takes its last name's, as in torch
        apart = {k: torch.full_like(v, float(i)) if v.is_floating_point() else v
                 for i, (k, v) in enumerate(other.state_dict().items())}
        plain = copy.deepcopy(other)
        plain.load_state_dict(apart)
        engine.load_state_dict(apart)
        assert_state_dict_as_torch(engine, plain)
        engine.load_state_dict(before)  # its own
        res = engine.load_state_dict({"sometimes.bias": other.sometimes.bias,
                                      "extra": torch.zeros(1)}, strict=False)
        assert res.unexpected_keys == ["extra"] and "emb.weight" in res.missing_keys
        sd = engine.state_dict()
        assert torch.equal(sd["sometimes.bias"], other.sometimes.bias)
        assert all(torch.equal(sd[k], before[k]) for k in before if k != "sometimes.bias")
        ref.sometimes.bias.data.copy_(other.sometimes.bias)
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.1, eps=1e-6)
        _train(engine, ref, opt, _batches(2, seed=5))  # training goes on from the loaded
        _assert_weights(engine, ref, atol=3e-6)
    finally:
        engine.close()


def test_full_weights_inside_a_forward_is_refused(engine_cfg):
    engine, _ = _engine(engine_cfg, PLACEMENTS[0])
    seen = []

    def peek(module, args):
        with pytest.raises(RuntimeError, match="inside a forward"):
            with engine.full_weights("emb"):
                pass
        seen.append(True)
    handle = engine.module.block.register_forward_pre_hook(peek)
    try:
        x, y = _batches(1)[0]
        engine.backward(_loss(engine(x), y))  # the forward goes on unharmed
        assert engine.step() and len(seen) == 2  # `block` runs twice
    finally:
        handle.remove()
        engine.close()


def test_calls_inside_a_read_only_full_weights_block(engine_cfg, tmp_path):
    """[Note: calls inside a full_weights block]: state_dict, named_weights and
    save_pretrained see the block's full weights as the model's parameters (tied and
    frozen ones included) and give what they give outside it; a second block inside
    is refused naming the fix, and leaves the outer block's weights in place."""
    engine, _ = _engine(engine_cfg, PLACEMENTS[2])
    try:
        x, y = _batches(1)[0]
        engine.backward(_loss(engine(x), y))
        engine.step()
        outside = engine.state_dict()
        streamed = dict(engine.named_weights())
        with engine.full_weights() as w:
            inside = engine.state_dict()
            assert list(inside) == list(outside)
            assert all(torch.equal(inside[k], outside[k]) for k in outside)
            assert {k: v for k, v in engine.named_weights()}.keys() == streamed.keys()
            assert all(torch.equal(t, streamed[k]) for k, t in engine.named_weights())
            engine.save_pretrained(tmp_path / "inside")  # each weight once, its file valid
            saved = load_file(tmp_path / "inside" / "model.safetensors")
            assert {"emb.weight", "block.0.weight", "bn.running_mean"} <= saved.keys()
            assert saved.keys() <= outside.keys()
            assert all(torch.equal(v, outside[k]) for k, v in saved.items())
            for nested in (lambda: engine.full_weights("emb").__enter__(),
                           lambda: next(iter(engine.full_weights_by_group()))):
                with pytest.raises(RuntimeError, match="inside a full_weights block.*outer "
                                                       "block"):
                    nested()
            assert engine.module.emb.weight is w["emb.weight"]  # the outer block's, still
            assert torch.equal(engine.module.frozen.weight, outside["frozen.weight"])
            with torch.no_grad():  # a read-only block's edits are not written back
                w["block.0.weight"].add_(1.0)
        after = engine.state_dict()
        assert list(after) == list(outside)
        assert all(torch.equal(after[k], outside[k]) for k in outside)
        # every parameter name, a tied one under each of its names, as state_dict
        buffers = {n for n, _ in engine.module.named_buffers()}
        assert streamed.keys() == outside.keys() - buffers
        assert {"emb.weight", "head.weight"} <= streamed.keys()
    finally:
        engine.close()


def test_save_pretrained_inside_a_writable_block_writes_the_edits(engine_cfg, tmp_path):
    """As state_dict there: the block's weights as they are at the call (it wrote the
    weights from before the block)."""
    engine, _ = _engine(engine_cfg, PLACEMENTS[2])
    try:
        with engine.full_weights("block", writable=True) as w:
            w["block.0.weight"].data.fill_(7.0)
            # a new Parameter is an edit too (written back at the block's end): state_dict
            # and save_pretrained refused it as "replaced after initialize", which ended
            # the block and dropped the edits
            engine.module.block[0].bias = nn.Parameter(torch.full((32,), 3.0))
            engine.save_pretrained(tmp_path / "edited")
            inside = engine.state_dict()
        saved = load_file(tmp_path / "edited" / "model.safetensors")
        assert (saved["block.0.weight"] == 7.0).all() and (saved["block.0.bias"] == 3.0).all()
        assert all(torch.equal(v, inside[k]) for k, v in saved.items())
        assert (engine.state_dict()["block.0.bias"] == 3.0).all()
        with pytest.raises(ValueError, match="shape of a parameter cannot change"):
            with engine.full_weights("block", writable=True):  # same numel, transposed
                engine.module.block[0].weight = nn.Parameter(torch.zeros(32, 32).t()[:, :32])
                engine.module.block[0].bias = nn.Parameter(torch.zeros(16, 2))
                engine.save_pretrained(tmp_path / "reshaped")
        assert not (tmp_path / "reshaped").exists()
    finally:
        engine.close()


def test_a_new_parameter_under_one_name_of_a_tied_weight_is_refused(engine_cfg):
    """A writable block that assigns a new Parameter to one name of a tied weight (the
    other still names the old one) cannot say which to write: refused naming both, and
    neither name changes."""
    engine, _ = _engine(engine_cfg, PLACEMENTS[1])
    try:
        before = engine.state_dict()
        with pytest.raises(ValueError, match=r"'emb\.weight' is tied under \[.*'head\.weight'"
                                             r"\].*nothing was written"):
            with engine.full_weights(writable=True):
                engine.module.head.weight = nn.Parameter(torch.ones(64, 32))
        after = engine.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
    finally:
        engine.close()


def test_bf16_training_gives_the_fp32_masters(engine_cfg):
    """state_dict and named_weights of bf16 training read each group's fp32 master,
    not its bf16 partition: after steps the weights are off bf16's grid."""
    engine, _ = _engine(engine_cfg, PLACEMENTS[0], "bf16")
    try:
        for x, y in _batches(2):
            engine.backward(_loss(engine(x), y))
            engine.step()
        streamed = dict(engine.named_weights())
        for w in (engine.state_dict()["block.0.weight"], streamed["emb.weight"]):
            assert w.dtype == torch.float32
            assert (w != w.bfloat16().float()).any()
    finally:
        engine.close()


def test_an_old_dict_loads_into_a_batchnorm_under_two_names(engine_cfg):
    """A BatchNorm registered under two names: both names' batch counts are filled in
    from the module, as torch's load_state_dict fills them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.again = model[1]
    old = {k: v for k, v in model.state_dict().items() if "num_batches" not in k}
    plain = copy.deepcopy(model)
    assert not plain.load_state_dict(old).missing_keys
    with offload.initialize(model, engine_cfg("host")) as engine:
        assert not engine.load_state_dict(old).missing_keys


def test_forward_without_autograd_fetches_the_next_units_ahead(engine_cfg):
    """[Note: forward-only prefetch]: with every parameter partition back on NVMe, when a
    unit of a no_grad pass starts, the groups of the units after it are on their way."""
    engine, ref = _engine(engine_cfg, PLACEMENTS[2])
    order = [u for u in engine.units if u.needs]
    seen = []

    def check(unit, nxt):
        def hook(module, args):
            held = engine.store.info(("p", nxt)).held
            seen.append((unit.name, Tier.DEVICE in held or Tier.HOST in held))
        return hook
    handles = [u.module.register_forward_pre_hook(check(u, v.needs[0]))
               for u, v in zip(order, order[1:]) if v.needs[0] not in u.needs]
    try:
        x, y = _batches(1)[0]
        engine.backward(_loss(engine(x), y))
        engine.step()
        engine.eval(), ref.eval()
        for g in engine.groups:
            engine.store.evict(("p", g.gid)).wait()
        seen.clear()
        with torch.no_grad():
            engine(x)
        assert len(seen) >= 3 and all(ahead for _, ahead in seen), seen
    finally:
        for h in handles:
            h.remove()
        engine.close()


@pytest.mark.parametrize("placement", PLACEMENTS[1:], ids=IDS[1:])
def test_full_weights_group_by_group_when_the_model_does_not_fit(engine_cfg, placement):
    torch.manual_seed(0)
    ref = Zoo()
    cfg = engine_cfg(*placement, group_size=1200)
    cfg["store"]["host_budget"] = "16KiB"  # below the model's 40 KiB of padded fp32 weights
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    try:
        with pytest.raises(ValueError, match="full_weights_by_group"):
            with engine.full_weights():
                pass
        before = engine.state_dict()
        names = []
        for w in engine.full_weights_by_group(writable=True):
            names += list(w)
            params = {id(p): p for p in w.values()}.values()  # tied: once
            for p in params:
                p.data.mul_(2)
            assert sum(p.numel() for p in params) * 4 <= 16 * 1024
        assert set(names) == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
        after = engine.state_dict()
        for k, v in before.items():
            want = v if k.startswith("bn.running") or k.endswith("tracked") else 2 * v
            assert torch.equal(after[k], want), k
        with pytest.raises(ZeroDivisionError):  # an error: that group's edits are dropped
            for i, w in enumerate(engine.full_weights_by_group("block", writable=True)):
                w["block.0.weight"].data.zero_()
                1 / 0
        assert torch.equal(engine.state_dict()["block.0.weight"], after["block.0.weight"])
    finally:
        engine.close()


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.gru(self.lstm(x)[0])[0][:, -1])


@pytest.mark.parametrize("placement", PLACEMENTS[:2], ids=IDS[:2])
def test_recurrent_modules_train_as_torch_and_keep_no_gathered_weights(engine_cfg, placement,
                                                                       caplog):
    """[Note: RNN weight lists] torch's LSTM and GRU keep a list of their weights: it
    held the original parameters after initialize and each unit's gathered weights
    after its forward (memory outside the budgets, and a "still referenced" warning
    every step). Now the list follows the attributes: same numbers as torch, no
    warning, the originals freed."""
    import gc
    import logging
    import weakref

    torch.manual_seed(0)
    ref = Recurrent()
    model = copy.deepcopy(ref)
    original = weakref.ref(model.lstm.weight_ih_l0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    xs = [torch.randn(4, 5, 8) for _ in range(3)]
    ys = [torch.randint(0, 3, (4,)) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(model, engine_cfg(*placement, group_size=1500)) as engine:
        gc.collect()
        assert original() is None
        for x, y in zip(xs, ys):
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
            loss = nn.functional.cross_entropy(ref(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for module in (model.lstm, model.gru):
            assert all(w is getattr(module, n) for w, n in
                       zip(module._flat_weights, module._flat_weights_names))
        with torch.no_grad():
            torch.testing.assert_close(engine(xs[0]), ref(xs[0]), atol=1e-5, rtol=0)
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert not [r for r in caplog.records if "still referenced" in r.getMessage()]


def test_torch_clipping_and_torch_optimizers_raise_instead_of_doing_nothing(engine_cfg):
    """[Note: absent gradients] `.grad` was None after a backward, so
    torch.nn.utils.clip_grad_norm_ returned 0 and clipped nothing, and a torch
    optimizer over the parameters updated nothing: both silently. Between a backward
    and its step each trainable `.grad` now names optim.max_grad_norm; after the
    step, a failed step or zero_grad it is None again; training matches an engine
    that never saw the calls. `model.zero_grad(set_to_none=False)` names
    `model.zero_grad()` and `engine.zero_grad()`, and changes nothing."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    a[1].requires_grad_(False)
    b = copy.deepcopy(a)
    x = torch.randn(4, 8)
    cfg = engine_cfg("host", group_size=100, grad_accum_steps=2)
    other = copy.deepcopy(cfg)
    other["io"]["paths"] = [cfg["io"]["paths"][0] + "-b"]
    with offload.initialize(a, cfg) as ea, offload.initialize(b, other) as eb:
        opt = torch.optim.SGD(a.parameters(), lr=1.0)
        for _ in range(2):
            for _ in range(2):
                ea.backward(ea(x).square().sum())
                eb.backward(eb(x).square().sum())
                assert [p.grad is not None for p in a.parameters()] == [True, True, False, False]
                for call in (lambda: nn.utils.clip_grad_norm_(a.parameters(), 1.0),
                             lambda: nn.utils.clip_grad_value_(a.parameters(), 1.0),
                             lambda: opt.step()):
                    with pytest.raises(RuntimeError, match=r"gradient of parameter '0\.weight' "
                                       r".*optim\.max_grad_norm.*clip_grad_value_\) has no "
                                       r"equivalent"):
                        call()
                with pytest.raises(RuntimeError, match=r"zeroing the \.grad of parameter "
                                   r"'0\.weight' .*call model\.zero_grad\(\) or "
                                   r"engine\.zero_grad\(\) instead"):
                    a.zero_grad(set_to_none=False)
            assert ea.step() and eb.step()
            assert all(p.grad is None for p in a.parameters())
        ea.backward(ea(x).sum())
        ea.zero_grad()
        assert all(p.grad is None for p in a.parameters())
        sa, sb = ea.state_dict(), eb.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sb)


class _Penalised(nn.Module):
    """An L2 term computed in the forward, over the registered parameters."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(8, 8), nn.Linear(8, 1), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        if self.how == "parameters":
            reg = sum(p.square().sum() for p in self.parameters())
        elif self.how == "vector":
            reg = nn.utils.parameters_to_vector(self.a.parameters()).square().sum()
        else:
            reg = self.a._parameters["weight"].square().sum()
        return out + 1e-2 * reg


@pytest.mark.parametrize("how", ["parameters", "vector", "_parameters"])
@pytest.mark.parametrize("placement", PLACEMENTS[::2], ids=IDS[::2])
def test_a_forward_reads_its_weights_through_its_registered_parameters(engine_cfg, how,
                                                                         placement):
    """[Note: weights read through the registered parameters] in absent.py: a forward
    that read its own weights through `self.parameters()` (or `_parameters`) met the
    stand-ins and raised "used outside the forward of unit '<root>'" where the whole
    model was one unit, pointing to engine.whole_modules, which changed nothing. It
    computes with the gathered weights now, as torch; where the weights read are
    another unit's, not gathered, it still raises."""
    torch.manual_seed(0)
    ref = _Penalised(how)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    xs = [torch.randn(4, 8) for _ in range(3)]
    with offload.initialize(model, engine_cfg(*placement, group_size=100_000)) as engine:
        for x in xs:
            loss = engine(x).square().mean()
            engine.backward(loss)
            assert engine.step()
            want = ref(x).square().mean()
            opt.zero_grad()
            want.backward()
            opt.step()
            assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        got = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)
        assert model.a._parameters["weight"].requires_grad
    split = _Penalised(how)
    with offload.initialize(split, engine_cfg(*placement, group_size=50)) as engine:
        with pytest.raises(RuntimeError, match=r"parameter 'a\.weight' is used outside the "
                                               r"forward of unit 'a'"):
            engine(xs[0])


@pytest.mark.parametrize("late", ["prune", "weight_norm"])
def test_prune_or_weight_norm_after_initialize_leaves_the_module_as_it_was(engine_cfg, late):
    """[Note: a parameter removed before a computation that fails] in absent.py:
    torch.nn.utils.prune and the old weight_norm, applied after initialize, took the
    parameter out of the module (prune renaming it weight_orig) and failed on the
    stand-in: the module was left without `weight`, state_dict's keys changed and
    every later forward failed, naming functional_call. It is put back, in its place,
    and the error says what happened."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    with offload.initialize(model, engine_cfg("host", group_size=50)) as engine:
        params = list(model.named_parameters())
        keys = list(engine.state_dict())
        with pytest.raises(RuntimeError, match=r"parameter '0\.weight' was taken out of its "
                                               r"module .* it is put back"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
            if late == "prune":
                prune.l1_unstructured(model[0], "weight", amount=0.3)
            else:
                nn.utils.weight_norm(model[0])
        assert [(n, id(p)) for n, p in model.named_parameters()] == \
            [(n, id(p)) for n, p in params]
        assert list(engine.state_dict()) == keys
        for _ in range(2):
            x = torch.randn(4, 8)
            engine.backward(engine(x).square().mean())
            assert engine.step()
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
        got = engine.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.square().sum()

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


def test_a_registered_parameter_given_to_a_custom_function_is_refused(engine_cfg):
    """[Note: weights read through the registered parameters] in absent.py: a stand-in
    given to a custom autograd Function (whose apply asks no __torch_function__)
    computed with the gathered weights in its forward, while autograd took the stand-in
    as the input: the weight's gradient went to it and was lost (0.02 off torch after
    one step, silently). Refused, naming the module attribute to give instead."""
    class Fn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).sum() + sum(_Square.apply(p) for p in self.parameters())
    model = Fn()
    with offload.initialize(model, engine_cfg("host", group_size=100_000)) as engine:
        with pytest.raises(RuntimeError, match=r"a custom autograd Function was given a "
                                               r"registered parameter .*\(self\.weight\)"):
            engine(torch.randn(2, 4))


def test_a_parameter_the_program_deleted_stays_deleted(engine_cfg):
    """[Note: a parameter removed before a computation that fails]: only torch's prune
    and weight_norm get a parameter put back; one the program deleted itself (`del
    module.bias`) came back at the next computation on a reference held from before."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with offload.initialize(model, engine_cfg("host", group_size=50)):
        held = model[1].bias
        del model[1].bias
        with pytest.raises(RuntimeError, match="used outside the forward"):
            held * 2
        assert "bias" not in model[1]._parameters


def test_a_compiled_forward_reads_its_registered_parameters(engine_cfg):
    """torch.compile over such a forward met an internal dynamo error in the engine's
    fall-back (a frame it traced after a graph break); the fall-back runs eagerly."""
    torch.manual_seed(0)
    ref = _Penalised("parameters")
    model = copy.deepcopy(ref)
    with offload.initialize(model, engine_cfg("host", group_size=100_000)) as engine:
        x = torch.randn(4, 8)
        got = torch.compile(engine, backend="eager")(x)
        torch.testing.assert_close(got, ref(x), rtol=1e-6, atol=1e-7)
        engine.backward(got.square().mean())
        assert engine.step()
