"""`offload checkpoint info` and `offload checkpoint export` on a real checkpoint."""

import json

import pytest
import torch
from safetensors import safe_open

import offload

from ..engine.models import TiedTwice, lm_batches, lm_loss


@pytest.fixture
def saved(tmp_path):
    cfg = {"engine": {"params": "host", "grads": "host", "optimizer": "nvme", "dtype": "bf16",
                      "group_size": 3000},
           "optim": {"lr": 1e-2, "chunk_elems": 4096},
           "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "32MiB",
                  "grow_step": "4MiB"},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    torch.manual_seed(0)
    with offload.initialize(TiedTwice(), cfg) as e:
        for x, y in lm_batches(2):
            e.backward(lm_loss(e(x), y))
            e.step()
        e.save_checkpoint(tmp_path / "ck", extra={"epoch": 1})
        sd = e.state_dict()
    return tmp_path / "ck", sd


def test_info(saved, offload_cli):
    ck, sd = saved
    rc, out, err = offload_cli(["checkpoint", "info", str(ck), "--json"])
    assert rc == 0, err
    info = json.loads(out)
    n = sum(v.numel() for k, v in sd.items() if k != "head.weight")
    assert info["global_step"] == 2 and info["world"] == 1 and info["dtype"] == "bf16"
    assert info["parameters"] == n
    assert info["bytes"] == {"param": 2 * n, "master": 4 * n, "exp_avg": 4 * n,
                             "exp_avg_sq": 4 * n}
    assert info["integrity"] == "ok" and info["extra"] == {"epoch": 1}
    assert info["bytes_on_disk"] == sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
    rc, out, _ = offload_cli(["checkpoint", "info", str(ck)])
    assert rc == 0 and "step 2" in out and "integrity: ok" in out


def test_info_reports_damage(saved, offload_cli):
    ck, _ = saved
    chunk = ck / "exp_avg" / "l2.weight" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    rc, out, _ = offload_cli(["checkpoint", "info", str(ck)])
    assert rc == 1
    assert "integrity: damaged" in out and "exp_avg/l2.weight, chunk (0, 0)" in out
    # unverified, it is not called intact: "not checked", not "ok"
    rc, out, _ = offload_cli(["checkpoint", "info", str(ck), "--no-verify", "--json"])
    info = json.loads(out)
    assert rc == 0 and info["integrity"] == "not checked" and info["problems"] == []


def test_info_json_reports_a_damaged_record_on_stdout(saved, offload_cli):
    """--json promises one object on stdout: a damaged checkpoint.json gave none."""
    ck, _ = saved
    (ck / "checkpoint.json").write_text("{not json")
    rc, out, err = offload_cli(["checkpoint", "info", str(ck), "--json"])
    assert rc == 1 and "checkpoint.json is not valid JSON" in err
    info = json.loads(out)
    assert info["integrity"] == "damaged" and "checkpoint.json" in info["problems"][0]


def test_info_refuses_what_is_not_a_checkpoint(tmp_path, offload_cli):
    rc, _, err = offload_cli(["checkpoint", "info", str(tmp_path)])
    assert rc == 2
    assert err == (f"offload checkpoint info: path: '{tmp_path}' holds no checkpoint.json; "
                   "give a checkpoint directory (written by engine.save_checkpoint)\n")


@pytest.mark.parametrize("dtype,shard_size", [("fp32", "5GB"), ("saved", "4KB"),
                                              ("fp16", "5GB")])
def test_export_safetensors_loads_back(saved, tmp_path, offload_cli, dtype, shard_size):
    ck, sd = saved
    out = tmp_path / "hf"
    rc, stdout, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(out),
                                   "--dtype", dtype, "--shard-size", shard_size])
    assert rc == 0, err
    files = sorted(p.name for p in out.iterdir())
    if shard_size == "5GB":
        assert files == ["model.safetensors"]
    else:
        assert "model.safetensors.index.json" in files and len(files) > 2
    got = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    assert set(got) == set(sd) - {"head.weight"}  # tied: written once
    for k, v in got.items():
        # fp16 from the fp32 master, not from the bf16 parameter (rounded twice)
        want = sd[k].to({"fp32": torch.float32, "saved": torch.bfloat16,
                         "fp16": torch.float16}[dtype])
        assert v.dtype == want.dtype and torch.equal(v, want), k
    # the exported weights start a new run (initialize's checkpoint=)
    cfg = {"engine": {"params": "host", "grads": "host", "group_size": 3000},
           "io": {"paths": [str(tmp_path / "swap2")]},
           "store": {"device": "cpu"}}
    with offload.initialize(TiedTwice(), cfg, checkpoint=out) as e:
        for k, v in e.state_dict().items():
            assert torch.equal(v, got["emb.weight" if k == "head.weight" else k].float()), k
    rc, _, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(out)])
    assert rc == 2 and "already holds safetensors files" in err



def test_export_of_a_damaged_checkpoint_leaves_no_new_directory(saved, tmp_path, offload_cli):
    ck, _ = saved
    chunk = ck / "param" / "l2.weight" / "c" / "0" / "0"  # after emb and l1: a shard is begun
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    rc, _, err = offload_cli(["checkpoint", "export", str(ck), "--to",
                              str(tmp_path / "out" / "hf"), "--shard-size", "4KB"])
    assert rc == 1 and "param/l2.weight" in err, err
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()  # a --to that was there before stays, empty
    rc, _, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(tmp_path / "mine")])
    assert rc == 1, err
    assert list((tmp_path / "mine").iterdir()) == []


@pytest.mark.parametrize("name, text, says", [
    ("config.json", '{"model_type": "llama", "mine": true}', "exists"),
    # --config has none: from_pretrained would read another model's beside the weights (it
    # was exit code 0, the file left)
    ("generation_config.json", '{"max_length": 7}', "exists and --config {model} has no "
     "generation_config.json")])
def test_export_does_not_replace_or_keep_another_models_config_in_to(saved, tmp_path,
                                                                      offload_cli, name, text,
                                                                      says):
    """A config file in --to that is not --config's is refused before anything is
    written."""
    ck, _ = saved
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    out = tmp_path / "hf"
    out.mkdir()
    (out / name).write_text(text)
    rc, stdout, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(out),
                                   "--config", str(model)])
    assert rc == 2 and stdout == "", err
    assert err.startswith(f"offload checkpoint export: --to: {out / name} "
                          f"{says.format(model=model)}"), err
    assert err.count("\n") == 1 and "--config" in err
    assert (out / name).read_text() == text
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_bench_checkpoint_small(tmp_path, offload_cli):
    rc, out, err = offload_cli(["bench", "checkpoint", "--params", "300K", "--dim", "256",
                                "--batch", "8", "--path", str(tmp_path), "--json"])
    assert rc == 0, err
    r = json.loads(out)
    assert r["bytes"] == 12 * r["parameters"] and r["layers"] == 5
    for k in ("save", "load"):
        assert r[k]["GBps"] > 0 and r[k]["ratio"] > 0
    b = r["background"]
    assert b["seconds"] > 0 and 0 <= b["stalled"] <= b["seconds"] and b["steps_during"] >= 1
    assert not (tmp_path / "ckpt").exists()  # the checkpoints are removed


def test_bench_checkpoint_reference_writes_random_bytes(tmp_path):
    """The write reference holds bytes like a checkpoint's, not zeros (which this
    host's disk unmaps, and reads back slower), in whole 4 MiB writes."""
    from offload.cli.bench_checkpoint import _reference_write

    f = tmp_path / "ref"
    assert _reference_write(str(f), 9 << 20) > 0
    data = f.read_bytes()
    assert len(data) == 8 << 20 and data.count(0) < len(data) // 100


@pytest.mark.parametrize("command", ["info", "export"])
def test_a_damaged_commit_record_is_exit_code_1(saved, tmp_path, offload_cli, command):
    """checkpoint.json fails its checksum: damage, not a flag's fault (exit code 1, one
    line naming the file), as a damaged chunk is."""
    ck, _ = saved
    record = ck / "checkpoint.json"
    record.write_text(record.read_text().replace('"global_step": ', '"global_step": 1'))
    argv = ["checkpoint", command, str(ck)] + (["--to", str(tmp_path / "hf")]
                                               if command == "export" else [])
    rc, _, err = offload_cli(argv)
    assert rc == 1 and str(record) in err and err.count("\n") == 1, (rc, err)
    assert not (tmp_path / "hf").exists()


def test_export_into_the_checkpoint_is_refused(saved, offload_cli):
    """`--to CK` (or a folder inside it) wrote model.safetensors into a published
    checkpoint, whose size `info` then counted; it is refused, nothing written."""
    ck, _ = saved
    before = sorted(p.relative_to(ck) for p in ck.rglob("*"))
    for to in (ck, ck / "hf", ck / "param"):
        rc, stdout, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(to)])
        assert rc == 2 and stdout == "", err
        assert "inside the checkpoint" in err and err.count("\n") == 1, err
    assert sorted(p.relative_to(ck) for p in ck.rglob("*")) == before


@pytest.mark.parametrize("dtype,key,was,written", [("bf16", "dtype", "float32", "bfloat16"),
                                                   ("fp32", "torch_dtype", "bfloat16",
                                                    "float32"),
                                                   ("saved", "dtype", "float32", "bfloat16")])
def test_export_config_names_the_dtype_of_the_weights(saved, tmp_path, offload_cli, dtype, key,
                                                      was, written):
    """The copied config.json's dtype field (transformers 4's `torch_dtype` too) names the
    exported weights' dtype, as `engine.save_pretrained(dtype=...)` writes it:
    from_pretrained builds the model in the config's dtype (was copied unchanged: bf16
    weights loaded as float32). The --config file itself is left as it was."""
    ck, _ = saved  # trained in bf16: --dtype saved writes bf16
    model = tmp_path / "model"
    model.mkdir()
    text = json.dumps({"model_type": "gpt2", key: was, "n_embd": 32})
    (model / "config.json").write_text(text)
    out = tmp_path / "hf"
    rc, _, err = offload_cli(["checkpoint", "export", str(ck), "--to", str(out), "--dtype",
                              dtype, "--config", str(model)])
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text()) == {"model_type": "gpt2",
                                                             key: written, "n_embd": 32}
    assert (model / "config.json").read_text() == text
