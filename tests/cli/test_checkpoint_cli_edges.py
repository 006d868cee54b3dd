"""`offload checkpoint info` / `export` as a user runs them: the export holds what a
loaded model needs to compute as the trained one (buffers included, from one rank
or two), and every bad input is one line naming the file and the fix, with its
exit code, no traceback and nothing written in `--to`."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import offload

from ..engine.conftest import small_fs  # noqa: F401  (a fixture)
from ..engine.models import TiedTwice, lm_batches, lm_loss
from ..engine.ranks import gloo_group, spawn


def _cfg(swap, dtype="bf16", optimizer="nvme", **optim):
    return {"engine": {"params": "host", "grads": "host", "optimizer": optimizer,
                       "dtype": dtype, "group_size": 3000},
            "optim": {"lr": 1e-2, "chunk_elems": 4096, **optim},
            "io": {"paths": [str(swap)], "buffer_budget": "32MiB", "grow_step": "4MiB"},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-step bf16 checkpoint of TiedTwice (optimizer state on NVMe); tests damage
    copies of it (`copy`)."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), _cfg(root / "swap")) as e:
        for x, y in lm_batches(2):
            e.backward(lm_loss(e(x), y))
            e.step()
        e.save_checkpoint(root / "ck")
    return root / "ck"


@pytest.fixture
def copy(saved, tmp_path):
    def make(name="ck"):
        shutil.copytree(saved, tmp_path / name)
        return tmp_path / name
    return make


def _read(out: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    return got


def _one_line(rc, out, err, want_rc):
    assert rc == want_rc and out == "", (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- what the export holds -------------------------------------------------------------
class Normed(nn.Module):
    """A BatchNorm between two layers: its running statistics (and batch count) are
    buffers, not parameters, and decide the output in eval mode."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


@pytest.mark.parametrize("dtype", ["saved", "bf16"])
def test_export_holds_the_buffers(tmp_path, offload_cli, dtype):
    """The export wrote the parameters only: BatchNorm's running statistics were left
    out, so a model loaded from it computed other outputs in eval mode (as
    save_pretrained writes them, they come after the parameters; a conversion
    converts the floating ones and keeps the batch count an integer)."""
    torch.manual_seed(0)
    with offload.initialize(Normed(), _cfg(tmp_path / "swap", "fp32", "host")) as e:
        for _ in range(2):
            e.backward(e(torch.randn(8, 8)).pow(2).mean())
            e.step()
        e.save_checkpoint(tmp_path / "ck")
        want = e.state_dict()
        e.module.eval()
        x = torch.randn(4, 8)
        logits = e(x).detach()
    rc, _, err = offload_cli(["checkpoint", "export", str(tmp_path / "ck"), "--to",
                              str(tmp_path / "hf"), "--dtype", dtype])
    assert rc == 0, err
    got = _read(tmp_path / "hf")
    assert set(got) == set(want)
    assert got["bn.num_batches_tracked"].dtype == torch.int64
    assert int(got["bn.num_batches_tracked"]) == 2
    for k, v in want.items():
        assert torch.equal(got[k], v if dtype == "saved" or not v.is_floating_point()
                           else v.to(torch.bfloat16)), k
    if dtype == "saved":
        m = Normed()
        m.load_state_dict(got)  # strict: every key
        m.eval()
        assert torch.equal(m(x), logits)


def test_fp16_that_would_overflow_is_refused(tmp_path, offload_cli):
    """--dtype fp16 of a weight above 65504 wrote inf silently; it is refused, naming
    the tensor and the dtypes that hold it, and nothing is written."""
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), _cfg(tmp_path / "swap", "fp32", "host")) as e:
        with e.full_weights(writable=True) as w, torch.no_grad():
            w["l1.bias"][3] = 1e5
        e.save_checkpoint(tmp_path / "ck")
    out = tmp_path / "new" / "hf"
    err = _one_line(*offload_cli(["checkpoint", "export", str(tmp_path / "ck"), "--to",
                                  str(out), "--dtype", "fp16"]), 2)
    assert "--dtype fp16: tensor 'l1.bias' holds values beyond the range of float16" in err
    assert "give --dtype bf16 or fp32" in err
    assert not (tmp_path / "new").exists()
    rc, _, err = offload_cli(["checkpoint", "export", str(tmp_path / "ck"), "--to", str(out),
                              "--dtype", "bf16"])
    assert rc == 0, err
    assert _read(out)["l1.bias"][3].item() == 1e5 - 1e5 % 512  # bf16's nearest


# -- damaged or wrong input --------------------------------------------------------------
def _truncate(ck):
    f = ck / "param" / "l1.weight" / "c" / "0" / "0"
    os.truncate(f, 100)
    return "param/l1.weight, chunk (0, 0)"


def _empty(ck):
    os.truncate(ck / "master" / "l2.weight" / "c" / "0" / "0", 0)
    return "master/l2.weight, chunk (0, 0)"


def _no_metadata(ck):
    (ck / "param" / "l2.bias" / "zarr.json").unlink()
    return "param/l2.bias/zarr.json"


def _cut_record(ck):
    os.truncate(ck / "checkpoint.json", 50)
    return f"{ck / 'checkpoint.json'} is not valid JSON"


def _no_buffers(ck):
    (ck / "buffers.json").unlink()
    return f"{ck / 'buffers.json'} is missing"


@pytest.mark.parametrize("damage", [_truncate, _empty, _no_metadata, _cut_record,
                                    _no_buffers])
def test_damaged_checkpoint_is_one_line_naming_the_file(copy, tmp_path, offload_cli, damage):
    """Damage is exit code 1 for both commands: one line naming the file, and the export
    leaves no directory it made (it reads the masters for fp32, the parameters else)."""
    ck = copy()
    want = damage(ck)
    out = tmp_path / "made" / "hf"
    dtype = "fp32" if want.startswith("master/") else "saved"
    err = _one_line(*offload_cli(["checkpoint", "export", str(ck), "--to", str(out),
                                  "--dtype", dtype]), 1)
    assert want in err, err
    assert not (tmp_path / "made").exists()
    rc, stdout, err = offload_cli(["checkpoint", "info", str(ck)])
    assert rc == 1 and "Traceback" not in err, err
    assert want in stdout + err


def test_unfinished_save_is_refused(copy, tmp_path, offload_cli):
    ck = copy(".step-3.partial")
    err = _one_line(*offload_cli(["checkpoint", "export", str(ck), "--to",
                                  str(tmp_path / "hf")]), 2)
    assert "is not a committed checkpoint" in err and ".partial" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("to, want", [
    ("a-file", "'{to}' exists and is not a directory"),
    ("a-file/sub", "cannot be created: {tmp}/a-file is a file")])
def test_to_that_cannot_be_a_directory(saved, tmp_path, offload_cli, to, want):
    (tmp_path / "a-file").write_text("mine")
    err = _one_line(*offload_cli(["checkpoint", "export", str(saved), "--to",
                                  str(tmp_path / to)]), 2)
    assert want.format(to=tmp_path / to, tmp=tmp_path) in err, err
    assert (tmp_path / "a-file").read_text() == "mine"


def test_an_earlier_export_is_never_overwritten(saved, tmp_path, offload_cli):
    out = tmp_path / "hf"
    assert offload_cli(["checkpoint", "export", str(saved), "--to", str(out),
                        "--shard-size", "4KB"])[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    err = _one_line(*offload_cli(["checkpoint", "export", str(saved), "--to", str(out),
                                  "--dtype", "fp32"]), 2)
    assert "already holds safetensors files" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_read_only_to_is_refused_before_anything(saved, small_fs, offload_cli):  # noqa: F811
    mnt = Path(small_fs(8))
    (mnt / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    for to in (mnt / "out", mnt / "new"):
        err = _one_line(*offload_cli(["checkpoint", "export", str(saved), "--to", str(to)]),
                        2)
        assert "read-only file system" in err and "give a writable directory" in err, err
    assert sorted(os.listdir(mnt)) == ["lost+found", "out"]


# -- two ranks, a transformers model ------------------------------------------------------
def _gpt2():
    import transformers
    hf = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                 n_head=2)
    return hf, transformers.GPT2LMHeadModel(hf)


def _two_rank_worker(rank, world, init_file, root):
    with gloo_group(rank, world, init_file):
        torch.manual_seed(0)
        hf, model = _gpt2()
        cfg = _cfg(Path(root) / f"swap{rank}", state_dtype="int8")
        with offload.initialize(model, cfg) as e:
            x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
            for _ in range(2):
                e.backward(e(input_ids=x, labels=x).loss)
                e.step()
            e.save_checkpoint(Path(root) / "ck")
            e.module.eval()  # from_pretrained's mode: no dropout
            logits = e(input_ids=x).logits.detach()
            sd = e.state_dict()
        if rank == 0:
            hf.save_pretrained(Path(root) / "model")
            torch.save({"x": x, "logits": logits, "sd": sd}, Path(root) / "want.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A bf16 GPT-2 trained and saved on two gloo ranks, with int8 moments."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("two-ranks")
    spawn(_two_rank_worker, str(root / "init"), str(root))
    return root


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_checkpoint_exports_the_trained_model(two_ranks, offload_cli):
    """As DeepSpeed's zero_to_fp32: the ranks' partitions become whole tensors; fp32 is
    the masters bit for bit, and from_pretrained of the export computes the engine's
    logits."""
    transformers = pytest.importorskip("transformers")
    root = two_ranks
    want = torch.load(root / "want.pt")
    rc, stdout, err = offload_cli(["checkpoint", "info", str(root / "ck"), "--json"])
    assert rc == 0, err
    assert json.loads(stdout)["world"] == 2 and json.loads(stdout)["integrity"] == "ok"
    for dtype in ("fp32", "saved"):
        out = root / f"hf-{dtype}"
        rc, _, err = offload_cli(["checkpoint", "export", str(root / "ck"), "--to", str(out),
                                  "--dtype", dtype, "--shard-size", "40KB",
                                  "--config", str(root / "model")])
        assert rc == 0, err
        got = transformers.AutoModelForCausalLM.from_pretrained(
            out, torch_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
        sd = got.state_dict()
        for k, v in want["sd"].items():
            v = v if dtype == "fp32" else v.to(torch.bfloat16)
            assert torch.equal(sd[k], v), (dtype, k)
        if dtype == "saved":  # the engine computes in bf16 from the bf16 parameters
            logits = got(input_ids=want["x"]).logits.float()
            torch.testing.assert_close(logits, want["logits"].float(), rtol=2e-2, atol=2e-2)
