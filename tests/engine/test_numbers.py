"""The same numbers as plain PyTorch (torch.optim.AdamW(fused=True), fp32, 1e-6) in the
cases users meet: parameters without a gradient, a schedule over steps some layers
skip, parameter groups, a forward between backward and step."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError

PLACEMENTS = [("device", "host", "host"), ("host", "host", "host"), ("nvme", "nvme", "nvme")]
IDS = ["none", "host", "nvme"]
ONE_GROUP = 100_000  # engine.group_size: the whole model is one group
PER_LAYER = 1200     # each Linear its own group


class Sometimes(nn.Module):
    """`b` runs only when asked; `never` never runs; a LayerNorm for parameter groups."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.a(h))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.out(self.norm(h))


USE_B = [False, True, False, True, True]


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def _loss(model, x, y, use_b):
    return nn.functional.mse_loss(model(x, use_b), y)


def _compare(engine, ref, atol=1e-6):
    sd = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def _run_both(engine, ref, opt, sched=None, steps=5):
    for (x, y), use_b in zip(_data(steps), USE_B[:steps]):
        engine.backward(_loss(engine, x, y, use_b))
        engine.step()
        opt.zero_grad()  # set_to_none: a parameter that took no part has no gradient
        _loss(ref, x, y, use_b).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("group_size", [ONE_GROUP, PER_LAYER], ids=["one-group", "per-layer"])
@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_parameters_without_gradient_are_untouched(engine_cfg, params, grads, optimizer,
                                                   group_size):
    """`never` has no gradient in any step and `b` in some: torch leaves them as they
    are then (no weight decay, no moment decay, no Adam step), per parameter, even
    where they share a group with parameters that had one."""
    torch.manual_seed(0)
    ref = Sometimes()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer,
                                                  group_size=group_size))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        before = ref.never.weight.detach().clone()
        _run_both(engine, ref, opt)
        assert torch.equal(ref.never.weight, before)
        _compare(engine, ref)
        sd = engine.state_dict()
        assert torch.equal(sd["never.weight"], before)
    finally:
        engine.close()


def test_a_dropped_micro_batchs_gradients_do_not_reach_the_next_step(engine_cfg):
    """engine.zero_grad() drops a backward that used `b`; the next step's batch does not
    use it: torch leaves `b` as it is, and so must the engine (no weight decay, no
    moment decay from the dropped gradient's record)."""
    torch.manual_seed(0)
    ref = Sometimes()
    with offload.initialize(copy.deepcopy(ref), engine_cfg(group_size=ONE_GROUP)) as engine:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x, True), y))
        engine.zero_grad()
        engine.backward(nn.functional.mse_loss(engine(x, False), y))
        engine.step()
        sd = engine.state_dict()
    assert torch.equal(sd["b.weight"], ref.b.weight.detach())
    assert not torch.equal(sd["a.weight"], ref.a.weight.detach())


@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_lr_schedule_runs_at_the_global_step(engine_cfg, params, grads, optimizer):
    """LambdaLR advances once per optimizer step; `b`, skipped in the first step, uses
    the step's multiplier, not one for its own count of updates."""
    torch.manual_seed(1)
    ref = Sometimes()
    model = copy.deepcopy(ref)
    sched_fn = lambda k: 1.0 / (1 + k)  # noqa: E731
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer,
                                                  group_size=PER_LAYER), lr_lambda=sched_fn)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
    try:
        _run_both(engine, ref, opt, sched)
        _compare(engine, ref)
    finally:
        engine.close()


def _torch_groups(ref, lr=1e-2, wd=0.1):
    """An LLM recipe: no weight decay on biases and norms; `a` at a tenth of the lr."""
    no_decay = [p for n, p in ref.named_parameters() if n.endswith("bias") or "norm" in n]
    slow = [ref.a.weight]
    rest = [p for n, p in ref.named_parameters()
            if not any(p is q for q in no_decay + slow)]
    return [{"params": rest}, {"params": no_decay, "weight_decay": 0.0},
            {"params": slow, "lr": lr / 10, "betas": (0.8, 0.99)}]


@pytest.mark.parametrize("how", ["config", "api-params", "api-names"])
@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_param_groups_match_torch(engine_cfg, params, grads, optimizer, how):
    """Parameter groups from the config (patterns) or the Python API (parameters or
    names), in one partition holding elements of every group."""
    torch.manual_seed(2)
    ref = Sometimes()
    model = copy.deepcopy(ref)
    cfg = engine_cfg(params, grads, optimizer, group_size=ONE_GROUP)
    kwargs = {}
    if how == "config":
        cfg["optim"]["param_groups"] = [
            {"params": ["*.bias", "*norm*"], "weight_decay": 0.0},
            {"params": ["a.weight"], "lr": 1e-3, "betas": [0.8, 0.99]}]
    elif how == "api-params":
        kwargs["param_groups"] = _torch_groups(model)  # the model's own parameters
    else:
        kwargs["param_groups"] = [{"params": ["*.bias", "norm.*"], "weight_decay": 0.0},
                                  {"params": "a.weight", "lr": 1e-3, "betas": (0.8, 0.99)}]
    engine = offload.initialize(model, cfg, **kwargs)
    opt = torch.optim.AdamW(_torch_groups(ref), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        assert len(engine.groups) == 1  # one partition, several parameter groups
        _run_both(engine, ref, opt)
        _compare(engine, ref)
    finally:
        engine.close()


def test_param_groups_refuse_what_torch_refuses(engine_cfg):
    cfg = engine_cfg("host")
    with pytest.raises(ConfigError, match="matches no parameter"):
        offload.initialize(Sometimes(), cfg, param_groups=[{"params": ["nope.*"]}])
    with pytest.raises(ConfigError, match="'a.bias' is already in"):
        offload.initialize(Sometimes(), cfg, param_groups=[{"params": ["*.bias"]},
                                                           {"params": ["a.*"]}])
    with pytest.raises(ConfigError, match="not one of the model's"):
        offload.initialize(Sometimes(), cfg, param_groups=[{"params": [nn.Parameter(
            torch.zeros(3))]}])
    bad = engine_cfg("host")
    bad["optim"]["param_groups"] = [{"params": ["*.bias"], "wd": 0.0}]
    with pytest.raises(ConfigError, match="unknown key"):
        offload.initialize(Sometimes(), bad)


@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_forward_between_backward_and_step_sees_old_weights(engine_cfg, params, grads,
                                                            optimizer):
    """A validation forward after backward, before step, sees the weights torch shows
    there (the old ones), whatever updates already ran in the background."""
    torch.manual_seed(3)
    ref = Sometimes()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer,
                                                  group_size=PER_LAYER))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        for x, y in _data(3, seed=4):
            engine.backward(_loss(engine, x, y, True))
            opt.zero_grad()
            _loss(ref, x, y, True).backward()
            with torch.no_grad():
                got, want = engine(x), ref(x)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            got = _loss(engine, x, y, True)  # with autograd on, as a logging pass may run
            torch.testing.assert_close(got, _loss(ref, x, y, True), atol=1e-6, rtol=0)
            engine.step()
            opt.step()
        _compare(engine, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_plain_loss_backward_is_refused_then_training_matches(engine_cfg, params, grads,
                                                              optimizer):
    """`loss.backward()` instead of `engine.backward(loss)` under gradient accumulation
    raises at once, naming the fix, and changes nothing: training on with
    engine.backward matches torch."""
    torch.manual_seed(5)
    ref = Sometimes()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer,
                                                  group_size=PER_LAYER, grad_accum_steps=2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        x, y = _data(1, seed=6)[0]
        with pytest.raises(RuntimeError, match=r"engine.backward\(loss\)"):
            _loss(engine, x, y, True).backward()
        assert engine.micro_step == 0 and engine.step() is False
        _compare(engine, ref, atol=0)
        data = _data(4, seed=7)
        for i in range(0, 4, 2):
            for xb, yb in data[i:i + 2]:
                engine.backward(_loss(engine, xb, yb, True))
                engine.step()
                (_loss(ref, xb, yb, True) / 2).backward()
            opt.step()
            opt.zero_grad()
        _compare(engine, ref)
    finally:
        engine.close()


def test_meta_buffers_without_the_models_own_init_are_refused(engine_cfg):
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("k", torch.ones(4))

    with pytest.raises(ValueError, match=r"\['k'\] are on the meta device.*no _init_weights"):
        offload.initialize(WithBuffer, engine_cfg("host"))


class ParentReads(nn.Module):
    """The root's forward reads `emb.weight` itself (a tied head written as F.linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.body(self.emb(x))), self.emb.weight)


@pytest.mark.parametrize("params,grads,optimizer", PLACEMENTS, ids=IDS)
def test_weights_used_outside_their_unit_name_parameter_and_unit(engine_cfg, params, grads,
                                                                 optimizer):
    """A parent reading a child unit's weight, or a submodule called directly, raise an
    error naming the parameter, the unit and what to do; metadata reads still work."""
    x = torch.randint(0, 64, (2, 5))
    engine = offload.initialize(ParentReads(), engine_cfg(params, grads, optimizer,
                                                          group_size=1200))
    try:
        assert engine.module.emb.weight.shape == (64, 32)
        assert engine.module.emb.weight.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' is used outside the "
                           r"forward of unit 'emb'.*raise engine.group_size"):
            engine(x)
    finally:
        engine.close()
    torch.manual_seed(0)
    ref = ParentReads()
    engine = offload.initialize(copy.deepcopy(ref), engine_cfg(params, grads, optimizer,
                                                               group_size=ONE_GROUP))
    try:  # one unit holds both: the parent's read works, as in torch
        torch.testing.assert_close(engine(x), ref(x), atol=1e-6, rtol=0)
        with pytest.raises(RuntimeError, match=r"parameter 'body.weight' is used outside the "
                           r"forward of unit '<root>'.*Call that unit"):
            engine.module.body(torch.randn(2, 32))
        torch.testing.assert_close(engine(x), ref(x), atol=1e-6, rtol=0)  # still works
    finally:
        engine.close()
