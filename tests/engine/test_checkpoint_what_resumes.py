"""What a resume restores or refuses beyond the weights: the data loader's RNG states, buffers
the model lacks or keeps in another dtype, the fp16 loss scale's floor, `extra`'s keys,
and commit records or array metadata that lack or change what the reader uses."""

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

import offload
from offload.engine.checkpoint_files import _read_json, _write_json
from offload.engine.training_checkpoint import RECORD


def _cfg(tmp_path, name, dtype="fp32", **engine):
    return {
        "engine": {"params": "host", "grads": "host", "optimizer": "host", "dtype": dtype,
                   "group_size": 3000, **engine},
        "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
        "io": {"paths": [str(tmp_path / name)], "buffer_budget": "32MiB", "grow_step": "4MiB"},
        "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"},
    }


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))


def _saved(tmp_path, model=None, **kw):
    """A checkpoint of one step of `model` (default: Linear, BatchNorm, Linear)."""
    cfg = _cfg(tmp_path, "a", **kw)
    with offload.initialize(model if model is not None else _bn_model(), cfg) as e:
        e.backward(e(torch.randn(8, 32)).square().mean())
        e.step()
        e.save_checkpoint(tmp_path / "ck")
    return tmp_path / "ck"


def test_resume_restores_numpy_and_python_rng(tmp_path):
    """A data loader's shuffling (numpy, random) continues after a resume as it would
    have without one: the save keeps those RNG states, the resume puts them back."""
    ck = _saved(tmp_path)
    want_np, want_py = np.random.rand(4), [random.random() for _ in range(4)]
    np.random.seed(123)
    random.seed(123)
    with offload.initialize(_bn_model(), _cfg(tmp_path, "b"), resume=ck):
        pass
    assert np.array_equal(np.random.rand(4), want_np)
    assert [random.random() for _ in range(4)] == want_py


def test_a_checkpoint_buffer_the_model_lacks_is_refused(tmp_path):
    """BatchNorm statistics the checkpoint holds and the model has no place for are
    refused, not dropped in silence (here: the same parameters, a BatchNorm that
    keeps no running statistics)."""
    ck = _saved(tmp_path)
    no_bn = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32, track_running_stats=False),
                          nn.Linear(32, 8))
    with pytest.raises(offload.CheckpointError, match=r"the model's buffers differ from the "
                                                      r"checkpoint's .*1\.running_mean"):
        offload.initialize(no_bn, _cfg(tmp_path, "b"), resume=ck)


def test_a_buffer_of_another_dtype_is_refused(tmp_path):
    """A buffer saved in one dtype is not cast in silence into a model whose buffer has
    another."""
    def model(dtype):
        m = _bn_model()
        m[1].register_buffer("scale", torch.ones(32, dtype=dtype))
        return m
    ck = _saved(tmp_path, model(torch.float64))
    with pytest.raises(offload.CheckpointError, match=r"buffer '1\.scale' is .*float32.*"
                                                      r"float64"):
        offload.initialize(model(torch.float32), _cfg(tmp_path, "b"), resume=ck)


def test_fp16_resume_keeps_to_this_runs_min_loss_scale(tmp_path):
    """A dynamic loss scale resumed below this run's engine.min_loss_scale starts at
    the floor (a scale under it is one this run never uses)."""
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    cfg = _cfg(tmp_path, "a", dtype="fp16", initial_loss_scale=256.0, min_loss_scale=1.0)
    with offload.initialize(mlp(), cfg) as e:
        e.backward(e(torch.randn(8, 32, dtype=torch.float16)).float().square().mean())
        e.step()
        e.loss_scale = 2.0
        e.save_checkpoint(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / RECORD).read_text())["loss_scale"] == 2.0
    cfg = _cfg(tmp_path, "b", dtype="fp16", initial_loss_scale=256.0, min_loss_scale=16.0)
    with offload.initialize(mlp(), cfg, resume=tmp_path / "ck") as e:
        assert e.loss_scale == 16.0


def test_extra_with_keys_that_are_not_strings_is_refused_before_writing(tmp_path):
    """JSON writes the key 1 as "1": resumed_extra would differ from what was saved, so
    the save is refused and nothing is written."""
    with offload.initialize(_bn_model(), _cfg(tmp_path, "a")) as e:
        with pytest.raises(offload.CheckpointError, match=r"extra has the key 1 \(int\)"):
            e.save_checkpoint(tmp_path / "ck", extra={"epoch": {1: "a"}})
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("edit,field", [
    (lambda r: r["tensors"]["0.weight"]["kinds"].pop("param"), r"tensors\['0\.weight'\]"),
    (lambda r: r["ranks"][0]["writes"].pop(next(iter(r["ranks"][0]["writes"]))),
     r"ranks\[0\]"),
], ids=["a tensor without its param array", "a rank without a group's range"])
def test_a_record_lacking_what_the_reader_uses_is_damage(tmp_path, edit, field):
    """A commit record (its sha256 matching) without a field the reader indexes is a
    CheckpointCorruptError naming the field, not a raw KeyError."""
    ck = _saved(tmp_path)
    rec = _read_json(ck / RECORD)
    del rec["sha256"]
    edit(rec)
    _write_json(ck / RECORD, rec)
    with pytest.raises(offload.CheckpointCorruptError, match=rf"damaged record: {field}"):
        offload.initialize(_bn_model(), _cfg(tmp_path, "b"), resume=ck)


def test_an_array_whose_metadata_shape_changed_is_damage(tmp_path):
    """zarr.json is what other zarr readers follow: a shape there that is not the
    commit record's is damage, found before anything is resumed."""
    ck = _saved(tmp_path)
    meta = ck / "param" / "0.weight" / "zarr.json"
    m = json.loads(meta.read_text())
    m["shape"] = [m["shape"][0] * 2] + m["shape"][1:]
    meta.write_text(json.dumps(m))
    with pytest.raises(offload.CheckpointCorruptError, match=r"param/0\.weight.*shape"):
        offload.initialize(_bn_model(), _cfg(tmp_path, "b"), resume=ck)


class _Versioned(nn.Linear):
    """A layer with extra state (torch's get_extra_state / set_extra_state)."""

    def __init__(self) -> None:
        super().__init__(32, 8)
        self.meta = {"version": 1, "scale": torch.ones(2)}

    def get_extra_state(self) -> dict:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in self.meta.items()}

    def set_extra_state(self, state: dict) -> None:
        self.meta = state


def _versioned() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), _Versioned())


def test_a_modules_extra_state_resumes_as_it_was_at_the_save(tmp_path):
    """[Note: extra states in a checkpoint]: get_extra_state's value was not saved, and a
    resume left the module's own. A background save keeps it as it was at the call."""
    with offload.initialize(_versioned(), _cfg(tmp_path, "a")) as e:
        e.module[1].meta = {"version": 7, "scale": torch.tensor([2.0, 3.0])}
        save = e.save_checkpoint(tmp_path / "ck", blocking=False)
        e.module[1].meta = {"version": 8, "scale": torch.zeros(2)}  # after the call
        save.wait()
    model = _versioned()
    with offload.initialize(model, _cfg(tmp_path, "b"), resume=tmp_path / "ck") as e:
        assert model[1].meta["version"] == 7
        assert torch.equal(model[1].meta["scale"], torch.tensor([2.0, 3.0]))
        assert e.state_dict()["1._extra_state"]["version"] == 7
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    with pytest.raises(offload.CheckpointError, match=r"modules with extra state "
                                                      r"\(set_extra_state\) differ .*\['1'\]"):
        offload.initialize(plain, _cfg(tmp_path, "c"), resume=tmp_path / "ck")
    (tmp_path / "x").mkdir()
    with pytest.raises(offload.CheckpointError, match=r"modules with extra state"):
        offload.initialize(_versioned(), _cfg(tmp_path, "d"),
                           resume=_saved(tmp_path / "x", model=plain))


class _Opaque:
    pass


def test_an_extra_state_that_would_not_resume_is_refused_before_writing(tmp_path):
    """A value torch.load(weights_only=True) cannot read back is refused at the save,
    naming the module, not published to fail at the resume."""
    with offload.initialize(_versioned(), _cfg(tmp_path, "a")) as e:
        e.module[1].meta = {"version": 2, "owner": _Opaque()}
        with pytest.raises(offload.CheckpointError, match=r"extra state of module '1' .*"
                                                          r"nothing was written"):
            e.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_numpy_scalars_in_the_lr_and_the_schedule_save_and_resume(tmp_path):
    """An lr of np.float32 (torch takes it; a schedule's arithmetic on numpy gives it)
    failed every save ("float32 is not JSON serializable"), from the scheduler with a
    hint about LambdaLR's lambdas. Saved as numbers, resumed as an unbroken run."""
    import numpy as np

    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: np.float32(0.9) ** k)

    def run(e, batches):
        for x in batches:
            e.backward(e(x).square().mean())
            e.step()

    torch.manual_seed(1)
    data = [torch.randn(8, 32) for _ in range(4)]
    with offload.initialize(_bn_model(), _cfg(tmp_path, "a"), lr_scheduler=sched) as e:
        e.optimizer.param_groups[0]["weight_decay"] = np.float32(0.05)
        run(e, data[:2])
        e.save_checkpoint(tmp_path / "ck")
        run(e, data[2:])
        want = e.state_dict()
    with offload.initialize(_bn_model(), _cfg(tmp_path, "b"), lr_scheduler=sched,
                            resume=tmp_path / "ck") as e:
        run(e, data[2:])
        got = e.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)


def test_a_resume_with_another_optimizer_rule_says_so(tmp_path, caplog):
    """The hyper-parameters resume from the checkpoint, the update's rule from the
    config: a resume whose optim.name differs (Adam's weight decay added to the
    gradient, where the save trained with AdamW's decoupled one) trained on under
    the other rule with no word."""
    ck = _saved(tmp_path)
    cfg = _cfg(tmp_path, "b")
    with caplog.at_level("WARNING", logger="offload"):
        with offload.initialize(_bn_model(), cfg, resume=ck):
            pass
    assert "optim.name" not in caplog.text
    cfg["optim"]["name"] = "adam"
    with caplog.at_level("WARNING", logger="offload"):
        with offload.initialize(_bn_model(), cfg, resume=ck):
            pass
    assert "trained with optim.name 'adamw'; this resume's config says 'adam'" in caplog.text
