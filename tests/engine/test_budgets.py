"""Budgets: `initialize` refuses one below the minimum working set, naming the key and
the minimum; at the minimum itself every placement trains, waiting for room and
never failing, to the same numbers as with room to spare."""

import itertools

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, load_config
from offload.engine.units import build_units
from offload.engine.working_set import working_set


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def _cfg(tmp_path, params, grads, optimizer, dtype, clip=0.0, **store):
    return {"engine": {"params": params, "grads": grads, "optimizer": optimizer,
                       "dtype": dtype, "group_size": 64 * 65},
            "optim": {"chunk_elems": 4096, "max_grad_norm": clip, "lr": 1e-2},
            "io": {"paths": [str(tmp_path / f"swap-{len(store)}-{params}{grads}{optimizer}")],
                   "buffer_budget": "8MiB", "block_size": "64KiB", "grow_step": "1MiB"},
            "store": {"device": "cpu", "wait_timeout": 30, **store}}


def _minimum(cfg, dtype) -> tuple[int, int]:
    c = load_config(cfg)
    _, groups = build_units(_model(), c.engine.group_size, 1)
    ws = working_set(c, groups, dtype)
    return ws.device, ws.host


def _train(engine, dtype, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
        assert engine.step()
    return engine.state_dict()


CASES = [c for c in itertools.product(["nvme", "host", "device"], ["host", "nvme", "device"],
                                      ["nvme", "host"], ["fp32", "bf16"])
         if c[3] == "fp32" or c[0] == c[1] == "nvme"]
CASES.append(("nvme", "host", "nvme", "fp16"))  # fp16's loss scale stores the gradients


@pytest.mark.parametrize("params,grads,optimizer,dtype", CASES)
def test_minimum_budgets_only_wait(tmp_path, params, grads, optimizer, dtype):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # stored gradients too (fp16 stores them without clipping)
    clip = 1.0 if optimizer == "nvme" and grads == "host" and dtype != "fp16" else 0.0
    tight = _cfg(tmp_path, params, grads, optimizer, dtype, clip)
    device, host = _minimum(tight, dt)
    tight["store"].update(device_budget=device, host_budget=host)
    roomy = _cfg(tmp_path, params, grads, optimizer, dtype, clip, device_budget="64MiB",
                 host_budget="64MiB")
    a = offload.initialize(_model(), tight)
    b = offload.initialize(_model(), roomy)
    try:
        got, want = _train(a, dt), _train(b, dt)
        assert a.store.stats().evictions > 0  # the budgets were really tight
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("key", ["device_budget", "host_budget"])
def test_budget_below_the_minimum_is_refused_before_any_file_is_made(tmp_path, key):
    cfg = _cfg(tmp_path, "nvme", "host", "host", "fp32")
    device, host = _minimum(cfg, torch.float32)
    cfg["store"].update(device_budget=device, host_budget=host)
    cfg["store"][key] -= 4096
    with pytest.raises(ConfigError, match=rf"store\.{key}: .* below this model's minimum "
                                          rf"working set of .*\({device if key[0] == 'd' else host} "
                                          rf"bytes\).* raise store\.{key} to at least"):
        offload.initialize(_model(), cfg)
    assert not (tmp_path / cfg["io"]["paths"][0]).exists()


def test_exception_in_forward_then_training_goes_on_at_the_minimum(tmp_path):
    """A forward that raises half way leaves nothing gathered or pinned: at the
    minimum budgets the next steps run, to the numbers of a run that never raised."""
    cfg = _cfg(tmp_path, "nvme", "host", "nvme", "fp32")
    device, host = _minimum(cfg, torch.float32)
    cfg["store"].update(device_budget=device, host_budget=host)
    engine = offload.initialize(_model(), cfg)
    ref = offload.initialize(_model(), _cfg(tmp_path, "nvme", "host", "nvme", "fp32",
                                            device_budget="64MiB", host_budget="64MiB"))
    g = torch.Generator().manual_seed(2)
    try:
        for _ in range(5):
            x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
            with pytest.raises(RuntimeError, match="mat1 and mat2"):
                engine(torch.randn(8, 63))  # wrong width: the first Linear raises
            for e in (engine, ref):
                e.backward(nn.functional.mse_loss(e(x), y))
                assert e.step()
        assert all(engine.store.info(k).pins == 0 for k in engine.store.keys())
        got, want = engine.state_dict(), ref.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        engine.close()
        ref.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_early_updates_gradient_is_a_host_record_where_host_has_room(tmp_path, dtype):
    """[Note: the gradient's fp32 copy is a record] With room beside the minimum working
    set, an early update reads its gradient from a HOST record, counted in HOST's
    budget; at the minimum it keeps its own copy. Both give the same numbers."""
    from offload.store import footprint
    from offload.trace import TraceRecorder

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    _, groups = build_units(_model(), 64 * 65, 1)  # a group: one Linear(64, 64)
    grad_bytes = max(footprint(g.shard * 4) for g in groups)
    states, grads_held = [], []
    for extra in (grad_bytes, 0):
        cfg = _cfg(tmp_path, "nvme", "nvme", "nvme", dtype)
        device, host = _minimum(cfg, dt)
        cfg["store"].update(device_budget=device, host_budget=host + extra)
        rec = TraceRecorder(enabled=True)
        engine = offload.initialize(_model(), cfg, recorder=rec)
        try:
            states.append(_train(engine, dt))
            assert engine.store.stats().evictions > 0  # the budgets were really tight
        finally:
            engine.close()
        held = [e.args.get("grad", 0) for e in rec.events()
                if e.phase == "C" and e.name == "tier:HOST"]
        assert held and max(held) <= host + extra
        grads_held.append(max(held))
    assert grads_held[0] >= grad_bytes and grads_held[1] == 0
    for k in states[1]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_gradients_placed_on_nvme_stay_there_between_micro_batches(tmp_path):
    """`engine.grads = "nvme"` with accumulation: each micro-batch adds into the stored
    gradient and writes it back down, where HOST, with room to spare, would otherwise
    keep it dirty until the step."""
    from offload.store import Tier
    cfg = _cfg(tmp_path, "nvme", "nvme", "nvme", "fp32")
    cfg["engine"]["grad_accum_steps"] = 3
    cfg["store"].update(host_budget="64MiB", device_budget="64MiB")
    with offload.initialize(_model(), cfg) as engine:
        x = torch.randn(8, 64)
        for _ in range(2):
            engine.backward(engine(x).square().mean())
            engine.store.wait_all()  # the last write-backs may be in flight
            grads = [k for k in engine.store.keys() if k[0] == "g"]
            assert grads and all(engine.store.info(k).valid == {Tier.NVME} for k in grads), \
                {k: engine.store.info(k).valid for k in grads}


def test_the_memory_check_counts_bf16s_masters_and_every_rank_on_the_machine(tmp_path,
                                                                              monkeypatch):
    """What `initialize` keeps in memory outside the budgets: the host optimizer's moments
    and, in bf16, its fp32 masters (4 bytes a parameter); times the ranks torchrun
    started on this machine (LOCAL_WORLD_SIZE). Memory for one rank but not for four
    is refused, where the job would end in the OOM killer."""
    from offload.engine import working_set as ws
    from offload.planner.sizes import moment_bytes
    _, groups = build_units(_model(), 64 * 65, 1)
    cfg = load_config(_cfg(tmp_path, "nvme", "host", "host", "bf16"))
    placed = ws.memory_bytes_placed(cfg, groups, torch.bfloat16, "cpu")
    one = sum(moment_bytes("fp32", g.shard) + 4 * g.shard for g in groups)
    assert placed == {'engine.optimizer = "host"': one}
    monkeypatch.setattr(ws, "available_memory", lambda: 2 * one)  # this machine's room
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ws.check_memory(cfg, groups, torch.bfloat16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"engine\.optimizer"):
        ws.check_memory(cfg, groups, torch.bfloat16)


class _Tied(nn.Module):
    """A tied embedding (the largest gradient) beside layers of uneven sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64),
                                  nn.Linear(64, 64))
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def test_accumulating_into_gradients_on_the_device_at_the_minimum_only_waits(tmp_path):
    """Gradients homed on the device, bf16, two micro-batches, at the minimum budgets:
    fetching a gradient back to accumulate into it, the policy named the embedding's
    dirty gradient, which HOST had no room to take, and the backward raised
    BudgetExceededError while clean parameters, free to drop, sat beside it
    ([Note: a victim that cannot leave] in offload/store/store.py)."""
    def cfg(**store):
        return {"engine": {"params": "nvme", "grads": "device", "optimizer": "host",
                           "dtype": "bf16", "group_size": 64 * 65, "grad_accum_steps": 2},
                "optim": {"chunk_elems": 4096, "lr": 1e-2},
                "io": {"paths": [str(tmp_path / f"swap{len(store)}")], "buffer_budget": "8MiB",
                       "block_size": "64KiB", "grow_step": "1MiB"},
                "store": {"device": "cpu", "wait_timeout": 30, **store}}
    torch.manual_seed(0)
    _, groups = build_units(_Tied(), 64 * 65, 1)
    ws = working_set(load_config(cfg()), groups, torch.bfloat16)
    states = []
    for store in ({"device_budget": ws.device, "host_budget": ws.host},
                  {"device_budget": "64MiB", "host_budget": "64MiB"}):
        torch.manual_seed(0)
        with offload.initialize(_Tied(), cfg(**store)) as engine:
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                for _ in range(2):
                    x = torch.randint(0, 512, (4, 8), generator=g)
                    engine.backward(engine(x).float().square().mean())
                assert engine.step()
            states.append(engine.state_dict())
    for k in states[1]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_a_partition_of_one_parameter_is_not_told_to_lower_group_size(tmp_path):
    """One parameter is never split across groups: lowering engine.group_size, the fix
    the refusal gave, changed nothing."""
    cfg = _cfg(tmp_path, "nvme", "nvme", "nvme", "fp32", device_budget="64KiB",
               host_budget="64MiB")
    cfg["engine"]["group_size"] = 1024
    with pytest.raises(ConfigError, match=r"run on more ranks: the largest partition is "
                                          r"mostly one parameter \(0\.weight\)"):
        offload.initialize(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 2)), cfg)


def test_the_nvme_budget_counts_gradients_homed_there(tmp_path):
    """Gradients homed on NVMe and stored until step() (host optimizer state) take swap
    space beside the parameters: a budget below both is refused at initialize naming
    the least that trains, and that least trains."""
    import re

    cfg = _cfg(tmp_path, "nvme", "nvme", "host", "fp32", device_budget="64MiB",
               host_budget="64MiB")
    cfg["store"]["nvme_budget"] = 1
    with pytest.raises(ConfigError, match=r"store\.nvme_budget") as err:
        offload.initialize(_model(), cfg)
    need = int(re.search(r"at least (\d+) bytes", str(err.value)).group(1))
    assert need >= 2 * 6 * 20480  # six 64 x 65 fp32 partitions (4 KiB steps) of each kind
    cfg["store"]["nvme_budget"] = need
    with offload.initialize(_model(), cfg) as engine:
        _train(engine, torch.float32, steps=2)


def test_a_frozen_base_needs_less_than_training_it_all(tmp_path):
    """A base frozen under a trainable head (LoRA-style) holds no gradient or optimizer
    state: its minimum working set is below the same model's trained whole, and a run
    at that minimum trains."""
    def model(frozen: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)], nn.Linear(256, 8))
        for layer in list(m)[:4]:
            layer.requires_grad_(not frozen)
        return m
    cfg = _cfg(tmp_path, "nvme", "host", "host", "fp32")
    cfg["engine"]["group_size"] = 256 * 257
    c = load_config(cfg)
    least = {}
    for frozen in (True, False):
        _, groups = build_units(model(frozen), c.engine.group_size, 1)
        ws = working_set(c, groups, torch.float32)
        least[frozen] = (ws.device, ws.host)
    assert least[True][1] < least[False][1], least
    cfg["store"].update(device_budget=least[True][0], host_budget=least[True][1])
    with offload.initialize(model(True), cfg) as engine:
        for _ in range(2):
            engine.backward(engine(torch.randn(8, 256)).square().mean())
            assert engine.step()


def _two_rank_minimum(rank, world, init_file, out, swap, placement):
    from .ranks import gloo_group, run_cases

    def case():
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4))

        def cfg(**store):
            return {"engine": {"params": placement, "optimizer": "nvme", "group_size": 2000},
                    "optim": {"chunk_elems": 4096, "lr": 1e-2},
                    "io": {"paths": [f"{swap}/{len(store)}-r{rank}"], "buffer_budget": "8MiB",
                           "block_size": "64KiB", "grow_step": "1MiB"},
                    "store": {"device": "cpu", "wait_timeout": 30, **store}}
        c = load_config(cfg())
        _, groups = build_units(model(), c.engine.group_size, world)
        ws = working_set(c, groups, torch.float32)
        got = []
        for store in ({"device_budget": ws.device, "host_budget": ws.host},
                      {"device_budget": "64MiB", "host_budget": "64MiB"}):
            with offload.initialize(model(), cfg(**store)) as e:
                g = torch.Generator().manual_seed(1 + rank)
                for _ in range(3):
                    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                    e.backward(nn.functional.mse_loss(e(x), y))
                    assert e.step()
                got.append(e.state_dict())
        return ws.device, ws.device_why, all(torch.equal(got[0][k], got[1][k]) for k in got[1])

    with gloo_group(rank, world, init_file):
        run_cases({"train": case}, f"{out}.{rank}")


@pytest.mark.parametrize("placement", ["nvme", "host"])
def test_two_ranks_train_at_the_minimum(tmp_path, placement):
    """On two ranks a look-ahead all-gather holds the next group's partition in DEVICE
    while the current one is gathered, by the same thread: the minimum counts it (a
    device budget of one partition failed the first backward, BudgetExceededError)."""
    from .ranks import spawn_cases

    results = spawn_cases(_two_rank_minimum, str(tmp_path), args=(str(tmp_path / "swap"),
                                                                  placement))
    for r in results:
        device, why, same = r["train"] if "crash" not in r["train"] else (0, r["train"], 0)
        assert same is True, why
        assert "look-ahead" in why and device == 2 * 4096 * 4, (device, why)
