"""Save and resume across changes a user makes between runs: another placement, another
grouping, frozen parameters, gradient accumulation, fp16; and models or inputs that
differ from what was saved."""

import pytest
import torch
from torch import nn

import offload

from .models import TiedTwice, lm_batches, lm_loss, lm_train
from .ranks import gloo_group, spawn
from .test_checkpoint import Dropped, _assert_identical, schedule


def _cfg(engine_cfg, tmp_path, name, placement=("host", "host", "host"), dtype="fp32",
         **engine):
    cfg = engine_cfg(*placement, dtype=dtype, **engine)
    cfg["io"]["paths"] = [str(tmp_path / name)]
    return cfg


def _reference(cfg, model, batches, ck, at=3, **kw):
    """Trains `model` on `batches`, saving at step `at`; the final state."""
    torch.manual_seed(0)
    with offload.initialize(model(), cfg, **kw) as a:
        lm_train(a, batches[:at])
        a.save_checkpoint(ck)
        losses = lm_train(a, batches[at:])
        return losses, a.state_dict(), a.global_step


@pytest.mark.parametrize("saved,resumed", [
    (("host", "host", "host"), ("nvme", "nvme", "nvme")),
    (("nvme", "nvme", "nvme"), ("device", "host", "host"))])
def test_resume_on_another_placement_continues_identically(tmp_path, engine_cfg, saved,
                                                            resumed):
    batches = lm_batches(5)
    ck = tmp_path / "ck"
    losses, want, _ = _reference(_cfg(engine_cfg, tmp_path, "a", saved, "bf16"), Dropped,
                                 batches, ck, lr_lambda=schedule)
    torch.manual_seed(7)
    with offload.initialize(Dropped, _cfg(engine_cfg, tmp_path, "b", resumed, "bf16"),
                            lr_lambda=schedule, resume=ck) as b:
        assert lm_train(b, batches[3:]) == losses
        _assert_identical(b.state_dict(), want)


def test_resume_with_another_group_size_continues_identically(tmp_path, engine_cfg):
    batches = lm_batches(5)
    ck = tmp_path / "ck"
    losses, want, _ = _reference(_cfg(engine_cfg, tmp_path, "a", group_size=1000), Dropped,
                                 batches, ck, lr_lambda=schedule)
    with offload.initialize(Dropped, _cfg(engine_cfg, tmp_path, "b", group_size=100000),
                            lr_lambda=schedule, resume=ck) as b:
        assert len(b.groups) == 1
        assert lm_train(b, batches[3:]) == losses
        _assert_identical(b.state_dict(), want)


class Untied(TiedTwice):
    """TiedTwice whose head has a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = nn.Parameter(self.emb.weight.detach().clone())


def test_tied_checkpoint_into_an_untied_model_is_refused(tmp_path, engine_cfg):
    """One saved tensor is not read into two parameters (which would then train apart
    from the same moments), nor two saved ones into one."""
    ck = tmp_path / "ck"
    _reference(_cfg(engine_cfg, tmp_path, "a"), TiedTwice, lm_batches(1), ck, at=1)
    with pytest.raises(offload.CheckpointError, match=r"tensor 'emb\.weight' holds weights "
                                                      r"that were tied in the save .*'emb\."
                                                      r"weight' and 'head\.weight' as "
                                                      r"separate parameters"):
        offload.initialize(Untied, _cfg(engine_cfg, tmp_path, "b"), resume=ck)
    ck2 = tmp_path / "ck2"
    _reference(_cfg(engine_cfg, tmp_path, "c"), Untied, lm_batches(1), ck2, at=1)
    with pytest.raises(offload.CheckpointError, match=r"tensor 'head\.weight' was saved as a "
                                                      r"parameter of its own, the model ties "
                                                      r"it to 'emb\.weight'"):
        offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "d"), resume=ck2)


class HalfFrozen(Dropped):
    def __init__(self) -> None:
        super().__init__()
        self.l1.requires_grad_(False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_frozen_parameters_resume_identically(tmp_path, engine_cfg, dtype):
    batches = lm_batches(5)
    ck = tmp_path / "ck"
    losses, want, _ = _reference(_cfg(engine_cfg, tmp_path, "a", dtype=dtype), HalfFrozen,
                                 batches, ck)
    with offload.initialize(HalfFrozen, _cfg(engine_cfg, tmp_path, "b", dtype=dtype),
                            resume=ck) as b:
        assert lm_train(b, batches[3:]) == losses
        _assert_identical(b.state_dict(), want)


def _train_accum(engine, batches, n):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        if (i + 1) % n == 0:
            engine.step()
        losses.append(loss.item())
    return losses


def test_gradient_accumulation_resumes_identically(tmp_path, engine_cfg):
    batches = lm_batches(8)
    ck = tmp_path / "ck"
    cfg = _cfg(engine_cfg, tmp_path, "a", ("nvme", "nvme", "nvme"), "bf16", grad_accum_steps=2)
    torch.manual_seed(0)
    with offload.initialize(Dropped(), cfg, lr_lambda=schedule) as a:
        _train_accum(a, batches[:4], 2)
        a.save_checkpoint(ck)
        losses = _train_accum(a, batches[4:], 2)
        want, micro = a.state_dict(), a.micro_step
    cfg = _cfg(engine_cfg, tmp_path, "b", ("host", "host", "host"), "bf16", grad_accum_steps=2)
    with offload.initialize(Dropped, cfg, lr_lambda=schedule, resume=ck) as b:
        assert b.global_step == 2 and b.micro_step == 4
        assert _train_accum(b, batches[4:], 2) == losses
        _assert_identical(b.state_dict(), want)
        assert b.micro_step == micro


def test_fp16_resumes_identically(tmp_path, engine_cfg):
    batches = lm_batches(6)
    ck = tmp_path / "ck"
    losses, want, step = _reference(_cfg(engine_cfg, tmp_path, "a", dtype="fp16"), Dropped,
                                    batches, ck)
    with offload.initialize(Dropped, _cfg(engine_cfg, tmp_path, "b", dtype="fp16"),
                            resume=ck) as b:
        assert lm_train(b, batches[3:]) == losses
        _assert_identical(b.state_dict(), want)
        assert b.global_step == step


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))


def test_missing_or_swapped_buffers_file_is_damage(tmp_path, engine_cfg):
    """The module's buffers (BatchNorm's statistics) are part of the state: a checkpoint
    without its buffers.json, or with another save's, is refused (never resumed with
    the model's fresh buffers) and `verify` names the file."""
    from offload.engine import CheckpointReader
    torch.manual_seed(0)
    with offload.initialize(_bn_model(), _cfg(engine_cfg, tmp_path, "a")) as a:
        for k in range(2):
            a.backward(a(torch.randn(8, 32) * 3 + 1).square().mean())
            a.step()
            a.save_checkpoint(tmp_path / f"ck{k}")
    (tmp_path / "ck1" / "buffers.json").replace(tmp_path / "ck0" / "buffers.json")
    for ck, why in ((tmp_path / "ck1", "is missing"), (tmp_path / "ck0", "is not the one its "
                                                        "commit record lists")):
        with pytest.raises(offload.CheckpointCorruptError,
                           match=rf"{ck}/buffers\.json {why}"):
            offload.initialize(_bn_model(), _cfg(engine_cfg, tmp_path, "b"), resume=ck)
        assert any(f"{ck}/buffers.json {why}" in p for p in CheckpointReader(ck).verify())


class WideTied(TiedTwice):
    """Wide enough that, on two ranks, rank 1 alone holds `l1.bias` (group_size 3000)."""

    def __init__(self) -> None:
        super().__init__(vocab=128, dim=64, hidden=96)


def _resume_worker(rank, world, init_file, cfg, ck, out):
    from offload.comm import RankFailedError
    with gloo_group(rank, world, init_file):
        try:
            engine = offload.initialize(WideTied, cfg, resume=ck)
        except offload.CheckpointCorruptError as e:
            outcome = f"damaged: {e}"
        except RankFailedError:
            outcome = "another rank failed"
        else:
            outcome = "resumed"
            engine.close()
        with open(f"{out}.{rank}", "w") as f:
            f.write(outcome)


@pytest.mark.distributed
def test_damage_one_rank_finds_fails_the_resume_on_every_rank(tmp_path, engine_cfg):
    """Each rank reads its own chunks: one that fails its checksum on rank 1 only must
    fail the resume on rank 0 too, or rank 0 trains on from this checkpoint while
    rank 1 stops, or, following its error's advice, resumes from another one."""
    from offload.engine.checkpoint_layout import _rank_range
    from offload.engine.units import build_units
    _units, groups = build_units(WideTied(), 3000, 2)
    slot = {s.fqn: (g, s) for g in groups for s in g.slots}["l1.bias"]
    a0, b0 = _rank_range(*slot, 0)
    assert a0 >= b0 and _rank_range(*slot, 1) == (0, 96)  # rank 1's alone
    ck = tmp_path / "ck"
    _reference(_cfg(engine_cfg, tmp_path, "a"), WideTied, lm_batches(1), ck, at=1)
    shard = ck / "exp_avg_sq" / "l1.bias" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[8] ^= 0x10
    shard.write_bytes(bytes(data))
    out = tmp_path / "outcome"
    spawn(_resume_worker, str(tmp_path / "init"), _cfg(engine_cfg, tmp_path, "b"), str(ck),
          str(out))
    assert (tmp_path / "outcome.0").read_text() == "another rank failed"
    assert (tmp_path / "outcome.1").read_text().startswith(
        "damaged: checkpoint " + str(ck) + ": array exp_avg_sq/l1.bias, chunk (0)")


def test_resume_from_the_parent_of_checkpoints_names_them(tmp_path, engine_cfg):
    """`resume` given the directory save_checkpoint saved into (not a checkpoint) says
    which checkpoints it holds."""
    _reference(_cfg(engine_cfg, tmp_path, "a"), TiedTwice, lm_batches(2), tmp_path / "ck" /
               "step-1", at=1)
    with pytest.raises(offload.CheckpointError,
                       match=rf"{tmp_path}/ck is not a checkpoint but holds 1: step-1; pass "
                             rf"one of them \(e\.g\. {tmp_path}/ck/step-1\)"):
        offload.initialize(TiedTwice, _cfg(engine_cfg, tmp_path, "b"), resume=tmp_path / "ck")


def _read_only_mount(path):
    """Makes `path` a read-only bind mount of itself; False where mounts are not allowed."""
    import subprocess
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        return False
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)],
                      capture_output=True).returncode:
        subprocess.run(["umount", str(path)], check=False)
        return False
    return True


def test_save_onto_a_read_only_directory_says_what_to_do(tmp_path, engine_cfg):
    import subprocess
    ro = tmp_path / "ro"
    (ro / "ck").mkdir(parents=True)
    if not _read_only_mount(ro / "ck"):
        pytest.skip("cannot mount a read-only directory here")
    try:
        with offload.initialize(TiedTwice(), _cfg(engine_cfg, tmp_path, "a")) as e:
            lm_train(e, lm_batches(1))
            with pytest.raises(offload.CheckpointError,
                               match=r"writing .*/ck/step-1 failed .*Read-only file system.*"
                                     r"save to a directory this process may write"):
                e.save_checkpoint(ro / "ck" / "step-1")
    finally:
        subprocess.run(["umount", str(ro / "ck")], check=False)


def _save_worker(rank, world, init_file, cfg, root, out):
    import datetime

    import torch.distributed as dist

    from offload.comm import RankFailedError
    # a short timeout: a rank left waiting for a save the other refused fails the test
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    outcomes = []
    try:
        torch.manual_seed(0)
        with offload.initialize(TiedTwice(), cfg) as e:
            lm_train(e, lm_batches(1))
            for path, extra in ((f"{root}/a", {"pos": 1} if rank == 0 else {"pos": object()}),
                                (f"{root}/b-{rank}", None), (f"{root}/c", None)):
                try:
                    e.save_checkpoint(path, extra=extra)
                    outcomes.append("saved")
                except RankFailedError:
                    outcomes.append("another rank refused")
                except offload.CheckpointError as err:
                    outcomes.append(str(err).split(":")[1].strip())
                except Exception as err:
                    outcomes.append(f"{type(err).__name__}: {err}")
                    break
    finally:
        with open(f"{out}.{rank}", "w") as f:
            f.write("\n".join(outcomes))
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_save_one_rank_refuses_is_refused_on_every_rank(tmp_path, engine_cfg):
    """A refusal on one rank (its own `extra` cannot be saved) or names that differ
    between the ranks refuse the save on every rank, with nothing written, where the
    other ranks used to wait for the refusing one at the save's first barrier; the
    next save, the same on every rank, is written."""
    root = tmp_path / "ckpts"
    spawn(_save_worker, str(tmp_path / "init"), _cfg(engine_cfg, tmp_path, "swap"),
          str(root), str(tmp_path / "outcome"))
    outcomes = [(tmp_path / f"outcome.{r}").read_text().splitlines() for r in range(2)]
    assert outcomes[0] == ["another rank refused", "the ranks gave different names (this rank",
                           "saved"]
    assert outcomes[1] == ["extra must be JSON-serialisable, with keys of one type (strings)",
                           "the ranks gave different names (this rank", "saved"]
    assert sorted(p.name for p in root.iterdir()) == ["c"]


class _SharedScale(nn.Module):
    """Two layers share one buffer (one tensor registered in both)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        scale = torch.arange(4.0)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)

    def forward(self, x):
        return self.b(self.a(x) * self.a.scale) * self.b.scale


def test_a_buffer_two_modules_share_resumes_shared_into_a_meta_built_model(engine_cfg,
                                                                           tmp_path):
    """The save may name a shared buffer once; a model built on meta for the resume gets
    it under every name, as one tensor again (a later in-place change reaches both)."""
    cfg = engine_cfg()
    model = _SharedScale()
    with offload.initialize(model, cfg) as e:
        model.a.scale.mul_(3.0)  # through one name: the other sees it
        e.backward(e(torch.randn(2, 4)).sum())
        e.step()
        e.save_checkpoint(tmp_path / "ck")
        want = e.state_dict()
    cfg["io"]["paths"] = [str(tmp_path / "resumed")]
    with offload.initialize(_SharedScale, cfg, resume=tmp_path / "ck") as e:
        m = e.module
        assert m.a.scale is m.b.scale
        got = e.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 24), nn.Linear(24, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_int8_moments_resumed_in_another_form_keep_the_first_moments_bound(tmp_path,
                                                                          engine_cfg, state):
    """Saved from int8 codes, an element's sqrt(v) may decode to 0 beside an exp_avg
    that does not; the int8 update bounds exp_avg by C sqrt(v), fp32 and bf16 Adam then
    stepped it m / eps: 150 lr in one step here. Resumed in either form, the step
    equals the int8 run's own (to the new form's rounding)."""
    def cfg(name, sd):
        c = engine_cfg("host", "host", "host", dtype="bf16", group_size=300)
        c["optim"].update(lr=1e-2, weight_decay=0.1, state_dtype=sd)
        c["io"]["paths"] = [str(tmp_path / name)]
        return c

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
               for _ in range(4)]

    def train(e, part):
        for x, y in part:
            e.backward(nn.functional.mse_loss(e(x.bfloat16()).float(), y))
            e.step()

    torch.manual_seed(0)
    with offload.initialize(_Mlp(), cfg("s", "int8")) as e:
        train(e, batches[:3])
        e.save_checkpoint(tmp_path / "ck")
        train(e, batches[3:])
        want = {k: v.float() for k, v in e.state_dict().items()}
    with offload.initialize(_Mlp, cfg("r", state), resume=tmp_path / "ck") as e:
        train(e, batches[3:])
        got = {k: v.float() for k, v in e.state_dict().items()}
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4, msg=k)
