"""Building on the meta device runs no initialiser on storage-less tensors that would
load torch's compiler stack ([Note: normal_ on meta tensors] in engine/meta.py)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

from offload.engine.meta import meta_device

_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import offload
    from tests.engine.models import TiedTwice

    cfg = json.loads(sys.argv[1])
    engine = offload.initialize(lambda: TiedTwice(vocab=256), cfg)
    emb = engine.state_dict()["emb.weight"]
    engine.close()
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "emb_std": emb.std().item()}))
""")


def test_initialize_on_meta_loads_no_compiler_and_still_initialises(engine_cfg, tmp_path):
    """A fresh process: `initialize(lambda: model)` with an nn.Embedding (whose init is
    normal_) leaves torch._dynamo unimported, and the embedding still gets
    nn.Embedding's N(0, 1) on real storage. (torch.distributed.tensor, and sympy with
    it, is still imported: torch's C++ loads it the first time a tensor subclass, the
    absent weight, is detached.)"""
    cfg = engine_cfg("nvme", optimizer="nvme")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True,
                         text=True, timeout=120, cwd=str(Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["dynamo"], got
    assert 0.8 < got["emb_std"] < 1.2, got  # N(0, 1), 256 x 32 samples


def test_meta_device_skips_only_normal_on_meta_tensors():
    with meta_device():
        w = torch.empty(4, 4)
        assert nn.init.normal_(w, std=0.02) is w and w.is_meta
        assert w.normal_(0.0, 1.0) is w
        lin = nn.Linear(3, 5)
        assert lin.weight.is_meta and lin.weight.shape == (5, 3)
        real = torch.empty(64, device="cpu")
        nn.init.normal_(real, mean=3.0, std=0.01)  # real storage: filled as torch fills it
    assert abs(real.mean().item() - 3.0) < 0.01
    assert torch.empty(2).device.type == "cpu"  # the context is gone afterwards
