"""The engine against plain PyTorch: same init, same data, torch.optim.AdamW."""

import copy

import pytest
import torch
from torch import nn

import offload

from .models import Branchy, TiedTwice, lm_batches, lm_loss


def _reference(model, batches, steps, lr=1e-2, wd=0.1, clip=0.0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for x, y in batches[:steps]:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _train(engine, batches, steps):
    losses = []
    for x, y in batches[:steps]:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _compare(engine, ref, atol):
    sd = engine.state_dict()
    want = ref.state_dict()
    assert set(sd) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(sd[k], v, atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("params,grads,optimizer", [
    ("device", "host", "host"), ("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_fp32_matches_adamw(engine_cfg, params, grads, optimizer):
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(6)
    engine = offload.initialize(model, engine_cfg(params, grads, optimizer))
    try:
        got = _train(engine, batches, 6)
        want = _reference(ref, batches, 6)
        assert got == pytest.approx(want, abs=1e-5)
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("host_budget", ["64MiB", "24KiB"])
def test_nvme_params_cached_in_memory_or_written_back(engine_cfg, host_budget):
    """Updated NVMe-homed parameters stay in memory while the budgets have room (no
    NVMe traffic for them after the first step) and are written back when evicted."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(6)
    cfg = engine_cfg("nvme", "host", "host")
    cfg["store"].update(host_budget=host_budget, device_budget="24KiB")
    engine = offload.initialize(model, cfg)
    try:
        _train(engine, batches, 2)
        before = engine.nvme_bytes()
        got = _train(engine, batches[2:], 4)
        moved = [a - b for a, b in zip(engine.nvme_bytes(), before)]
        if host_budget == "64MiB":  # all 5 groups (8 KiB each) fit
            assert moved == [0, 0]
        else:
            assert moved[0] > 0 and moved[1] > 0  # parameters stream, dirty ones written back
        want = _reference(ref, batches, 6)
        assert got == pytest.approx(want[2:], abs=1e-5)
        _compare(engine, ref, atol=2e-6)
        engine.store.audit()
    finally:
        engine.close()


def test_bf16_within_tolerance(engine_cfg):
    """bf16 compute with fp32 masters, against fp32 training. Stated tolerance: losses
    within 2% relative; weights within 5 Adam steps of lr (a bf16 gradient whose sign
    differs moves a weight by up to 2 lr) at worst, and 2e-3 on average."""
    torch.manual_seed(0)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    batches = lm_batches(6)
    engine = offload.initialize(model, engine_cfg("nvme", "host", "nvme", dtype="bf16"))
    try:
        got = _train(engine, batches, 6)
        want = _reference(ref, batches, 6)
        assert got == pytest.approx(want, rel=2e-2)
        sd = engine.state_dict()
        for k, v in ref.state_dict().items():
            diff = (sd[k] - v).abs()
            assert diff.max() < 5e-2 and diff.mean() < 2e-3, (k, diff.max(), diff.mean())
    finally:
        engine.close()


@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_accumulation_is_the_mean_over_micro_batches(engine_cfg, clip, optimizer):
    """engine.grad_accum_steps=2: each micro-batch's own loss goes to the engine, which
    divides by 2 itself; torch gets the loss divided by 2 by hand. A large eps makes
    Adam's update depend on the gradient's scale, so a factor of 2 shows."""
    torch.manual_seed(1)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    cfg = engine_cfg("host", optimizer=optimizer, grad_accum_steps=2)
    cfg["optim"].update(max_grad_norm=clip, eps=0.05)
    engine = offload.initialize(model, cfg)
    batches = lm_batches(8, seed=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=0.05)
    try:
        for i in range(0, 8, 2):
            for k, (x, y) in enumerate(batches[i:i + 2]):
                engine.backward(lm_loss(engine(x), y))
                (lm_loss(ref(x), y) / 2).backward()
                assert engine.step() is (k == 1)  # steps on the last micro-batch only
            if clip:  # engine.grad_norm: the norm torch's clipping returns
                want = nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
                assert engine.grad_norm == pytest.approx(want, rel=1e-5)
            else:
                assert engine.grad_norm is None
            opt.step()
            opt.zero_grad()
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_dynamic_control_flow_falls_back_and_rerecords(engine_cfg):
    torch.manual_seed(2)
    ref = Branchy()
    model = copy.deepcopy(ref)
    engine = offload.initialize(model, engine_cfg("nvme", group_size=1200))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    routes = [[0, 1, 2], [0, 1, 2], [3, 1], [2, 0, 3, 1], [0, 1, 2], [1]]
    g = torch.Generator().manual_seed(0)
    try:
        for route in routes:
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)
            loss = nn.functional.mse_loss(engine(x, route), y)
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            nn.functional.mse_loss(ref(x, route), y).backward()
            opt.step()
        assert engine.trace.rerecords >= 3  # each change of route re-recorded the trace
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_meta_built_model_trains(engine_cfg):
    """Built on meta: materialised group by group with each module's own init."""
    cfg = engine_cfg("nvme", optimizer="nvme")
    engine = offload.initialize(lambda: TiedTwice(), cfg)
    try:
        sd = engine.state_dict()
        assert all(torch.isfinite(v).all() for v in sd.values())
        assert sd["head.weight"] is sd["emb.weight"] or torch.equal(sd["head.weight"],
                                                                    sd["emb.weight"])
        assert sd["l1.weight"].std() > 0 and torch.equal(sd["scale"], torch.ones(32))
        # the same seed makes the same weights
        other = engine_cfg("host")
        other["io"]["paths"] = [cfg["io"]["paths"][0] + "-2"]  # a live job's swap is locked
        again = offload.initialize(lambda: TiedTwice(), other)
        torch.testing.assert_close(again.state_dict()["l1.weight"], sd["l1.weight"])
        again.close()
        batches = lm_batches(1, seed=5) * 25
        losses = _train(engine, batches, 25)
        assert losses[-1] < losses[0] * 0.7
    finally:
        engine.close()


def test_fp16_dynamic_loss_scale_skips_overflow(engine_cfg):
    torch.manual_seed(3)
    model = TiedTwice()
    engine = offload.initialize(model, engine_cfg("host", dtype="fp16", initial_loss_scale=2.0 ** 30))
    try:
        x, y = lm_batches(1)[0]
        before = engine.state_dict()
        engine.backward(lm_loss(engine(x), y))
        assert engine.step() is False            # 2^30 overflows fp16 gradients
        assert engine.loss_scale == 2.0 ** 29
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        for _ in range(20):
            engine.backward(lm_loss(engine(x), y))
            if engine.step():
                break
        assert engine.global_step == 1 and engine.loss_scale < 2.0 ** 29
    finally:
        engine.close()


def test_meta_model_from_safetensors_checkpoint(engine_cfg, tmp_path):
    """Weights read lazily from a checkpoint: training continues exactly as from them."""
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(4)
    ref = TiedTwice()
    sd = {k: v for k, v in ref.state_dict().items() if k != "head.weight"}  # tied: stored once
    safetensors.save_file(sd, str(tmp_path / "model.safetensors"))
    engine = offload.initialize(lambda: TiedTwice(), engine_cfg("nvme"),
                                checkpoint=tmp_path / "model.safetensors")
    try:
        _compare(engine, ref, atol=0)
        batches = lm_batches(3, seed=9)
        assert _train(engine, batches, 3) == pytest.approx(_reference(ref, batches, 3), abs=1e-5)
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_lr_schedule_hook(engine_cfg):
    torch.manual_seed(5)
    ref = TiedTwice()
    model = copy.deepcopy(ref)
    sched = lambda k: 1.0 / (1 + k)  # noqa: E731
    engine = offload.initialize(model, engine_cfg("host"), lr_lambda=sched)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, sched)
    try:
        for x, y in lm_batches(4, seed=6):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            opt.step()
            lr_sched.step()
        _compare(engine, ref, atol=2e-6)
    finally:
        engine.close()


def test_missing_checkpoint_tensors_are_initialised_and_named(engine_cfg, tmp_path, caplog):
    """[Note: weights a checkpoint lacks] What the checkpoint holds is loaded, the rest
    keeps the model's init, named in a warning; a checkpoint holding none of the
    model's parameters is refused, leaving nothing behind."""
    import logging
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file({"emb.weight": torch.zeros(64, 32)}, str(tmp_path / "m.safetensors"))
    torch.manual_seed(3)
    model = TiedTwice()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(model, engine_cfg("host"),
                               checkpoint=tmp_path / "m.safetensors") as engine:
        sd = engine.state_dict()
    assert not sd["emb.weight"].any()
    assert all(torch.equal(sd[k], v) for k, v in want.items() if k not in ("emb.weight",
                                                                            "head.weight"))
    assert any("not in checkpoint" in r.getMessage() and "l1.weight" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    safetensors.save_file({"other.weight": torch.zeros(3)}, str(tmp_path / "o.safetensors"))
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        offload.initialize(lambda: TiedTwice(), engine_cfg("host"),
                           checkpoint=tmp_path / "o.safetensors")
    assert not list((tmp_path / "swap").glob("*.swap"))  # nothing left behind


def _shards(d, first: dict, second: dict) -> None:
    """`first` and `second` as two shards of `d` with transformers' index."""
    import json

    from safetensors.torch import save_file
    d.mkdir()
    index = {}
    for name, part in (("a.safetensors", first), ("b.safetensors", second)):
        save_file(part, str(d / name))
        index.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


def test_checkpoint_files_are_checked_before_any_weight_is_read(engine_cfg, tmp_path, caplog):
    """Every shard's header is read first: a missing shard, an index naming a tensor its
    shard lacks, a wrong shape or a non-float dtype in the last shard were found only as
    its group was reached (every earlier group read and written to swap by then), or
    not at all (an int tensor was cast); each is refused naming the tensor and file."""
    import logging
    import traceback
    pytest.importorskip("safetensors")
    torch.manual_seed(8)
    sd = {k: v for k, v in TiedTwice().state_dict().items() if k != "head.weight"}
    first = {k: v for k, v in sd.items() if k in ("emb.weight", "scale", "l1.weight")}
    second = {k: v for k, v in sd.items() if k not in first}
    cases = {
        "shard": (dict(second), r"puts '.*' .* in .*b.safetensors, which does not exist"),
        "index": (dict(second), r"index .* puts 'l2.bias' in .*b.safetensors, which does "
                                r"not hold it"),
        "shape": ({**second, "l2.bias": torch.zeros(33)},
                  r"tensor 'l2.bias' \(.*b.safetensors\) for l2.bias has shape \(33,\), the "
                  r"model expects \(32,\)"),
        "dtype": ({**second, "l2.bias": torch.zeros(32, dtype=torch.int32)},
                  r"tensor 'l2.bias' .* is I32, not a floating-point dtype"),
    }
    for case, (part, match) in cases.items():
        d = tmp_path / case
        _shards(d, first, part)
        if case == "shard":
            (d / "b.safetensors").unlink()
        if case == "index":
            from safetensors.torch import save_file
            save_file({k: v for k, v in part.items() if k != "l2.bias"}, str(d / "b.safetensors"))
        with pytest.raises((ValueError, FileNotFoundError), match=match) as err:
            offload.initialize(lambda: TiedTwice(), engine_cfg("host", group_size=600),
                               checkpoint=d)
        assert "_materialise" not in "".join(traceback.format_tb(err.value.__traceback__))
    # untied in the file, tied in the model: the last name's values, with a warning;
    # a tensor no name matches is named
    d = tmp_path / "untied"
    head = torch.randn(64, 32)
    _shards(d, first, {**second, "head.weight": head, "extra.weight": torch.zeros(2)})
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(lambda: TiedTwice(), engine_cfg("host"), checkpoint=d) as engine:
        got = engine.state_dict()
    assert torch.equal(got["emb.weight"], head) and torch.equal(got["head.weight"], head)
    assert "'emb.weight' and 'head.weight' hold different values" in caplog.text
    assert "match no parameter or buffer of the model and are not loaded: extra.weight" \
        in caplog.text


def test_failed_initialize_leaves_the_model_whole(engine_cfg, tmp_path):
    torch.manual_seed(6)
    model = TiedTwice()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = engine_cfg("host")
    cfg["store"]["host_budget"] = "4KiB"  # far too small: the puts fail
    cfg["store"]["device_budget"] = "4KiB"
    with pytest.raises(Exception, match="budget|BudgetExceeded|room|resident"):
        offload.initialize(model, cfg)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert isinstance(model.l1.weight, nn.Parameter)
    lm_loss(model(lm_batches(1)[0][0]), lm_batches(1)[0][1]).backward()  # still trains


def test_optimizer_state_of_the_first_update_is_read_ahead(engine_cfg):
    """After a step the optimizer's NVMe reads for the group updated first have begun."""
    torch.manual_seed(0)
    engine = offload.initialize(TiedTwice(), engine_cfg("nvme", "host", "nvme"))
    try:
        batches = lm_batches(2)
        order = []
        real = engine._update_group
        engine._update_group = lambda gid, *a: (order.append(gid), real(gid, *a))[1]
        _train(engine, batches, 1)
        assert order and engine.optimizer._pipeline.prefetched() == [order[0]]
        _train(engine, batches[1:], 1)  # the prefetched reads are used, results unchanged
    finally:
        engine.close()


def test_each_update_reads_the_next_groups_state_ahead(engine_cfg):
    """While a group updates, the optimizer's NVMe reads for the group updated next have
    begun: more than the first update of a step finds its state read ahead."""
    torch.manual_seed(0)
    engine = offload.initialize(TiedTwice(), engine_cfg("nvme", "host", "nvme",
                                                        group_size=600))
    try:
        ahead = []
        real, pipeline = engine._update_group, engine.optimizer._pipeline
        engine._update_group = lambda gid, *a: (ahead.append(gid in pipeline.prefetched()),
                                                real(gid, *a))[1]
        _train(engine, lm_batches(2), 2)
        assert len(ahead) > 4 and sum(ahead) > 2, ahead
    finally:
        engine.close()


def test_bf16_written_back_equals_kept_in_memory(engine_cfg):
    """bf16 parameters homed on NVMe: streaming them (dirty ones written back on
    eviction) gives bit-identical weights to keeping them all in memory."""
    results = []
    for host_budget in ("64MiB", "16KiB"):
        torch.manual_seed(0)
        model = TiedTwice()
        cfg = engine_cfg("nvme", "host", "nvme", dtype="bf16")
        cfg["store"].update(host_budget=host_budget, device_budget="24KiB")
        engine = offload.initialize(model, cfg)
        try:
            losses = _train(engine, lm_batches(4), 4)
            results.append((losses, engine.state_dict()))
        finally:
            engine.close()
    (l1, a), (l2, b) = results
    assert l1 == l2
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_switch_interval_set_while_open_and_restored(engine_cfg):
    import sys

    before = sys.getswitchinterval()
    cfg = engine_cfg("nvme", "host", "host")
    cfg["io"]["switch_interval"] = 0.0007
    engine = offload.initialize(TiedTwice(), cfg)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        engine.close()
    assert sys.getswitchinterval() == before
    engine.close()  # idempotent: nothing left to restore
    assert sys.getswitchinterval() == before
