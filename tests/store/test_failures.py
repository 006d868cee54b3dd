"""Failure injection with real mechanisms: a write refused by the file-size limit, a full
swap space, a corrupted extent on disk, and a swap directory left by a killed process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from offload.io import CorruptionError, SwapFullError
from offload.store import BudgetExceededError, Residency, Tier, TieredStore

from ..conftest import flip_byte
from .conftest import ENGINES, PAGE, page_tensor, store_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
ROOT = Path(__file__).resolve().parents[2]


def _python(script: str, *args: str, **kw) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-c", textwrap.dedent(script), *args]
    if kw.pop("popen", False):
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


_WRITE_FAILS = """
import json, resource, sys, torch
from offload.io import IoError
from offload.store import TieredStore, Tier
from tests.store.conftest import store_config, page_tensor

path, engine, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
s = TieredStore(store_config(path, engine=engine, device_pages=8, host_pages=8))
s.put("b", page_tensor(9, 4), tier="NVME").wait()        # holds swap bytes [0, 16 KiB)
ref_a, ref_c = page_tensor(1, 4) + 1, page_tensor(2, 4)
s.put("a", page_tensor(1, 4), tier="NVME").wait()
s.fetch("a", Tier.HOST).wait()
with s.modify("a", Tier.HOST) as t:                      # dirty; its old extent is freed
    t += 1
s.put("c", ref_c, tier="DEVICE")                         # dirty on DEVICE
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # writes past it fail
for key in ("a", "c"):
    try:
        s.evict(key, Tier.NVME).wait()
        out[key + "_error"] = None
    except IoError as e:
        out[key + "_error"] = f"{type(e).__name__}: {e}"
    info = s.info(key)
    out[key + "_state"], out[key + "_valid"] = str(info.state), sorted(t.name for t in info.valid)
    out[key + "_host_ok"] = bool(torch.equal(s.get(key, Tier.HOST),
                                             ref_a if key == "a" else ref_c))
s.audit()
out["nvme_used"] = s.stats().tiers["NVME"].used
out["failures"] = s.stats().moves["HOST->NVME"].failures
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
for key, ref in (("a", ref_a), ("c", ref_c)):
    s.evict(key, Tier.NVME).wait()
    out[key + "_after"] = sorted(t.name for t in s.info(key).valid)
    out[key + "_roundtrip"] = bool(torch.equal(s.fetch(key, Tier.DEVICE).wait(), ref))
s.audit()
s.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("limit", [16 << 10, 20 << 10])  # 20 KiB: the writes stop short
def test_failed_write_keeps_previous_copy(tmp_path, engine, limit):
    """A write past the file size limit fails naming it, whether it starts past the
    limit (EFBIG) or straddles it (the kernel writes up to the limit, a short count),
    and the copy it was writing stays valid where it was."""
    r = _python(_WRITE_FAILS, str(tmp_path / "swap"), engine, str(limit))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("a", "c"):
        assert "File too large" in out[key + "_error"], out
        assert f"past {limit} bytes (RLIMIT_FSIZE" in out[key + "_error"], out
        assert out[key + "_state"] == "HOST" and out[key + "_valid"] == ["HOST"], out
        assert out[key + "_host_ok"], out
        assert out[key + "_after"] == ["NVME"], out
        assert out[key + "_roundtrip"], out
    assert out["nvme_used"] == 4 * PAGE and out["failures"] == 2, out
    assert not os.listdir(tmp_path / "swap")


def test_full_swap_space_refuses_before_writing(tmp_path):
    cfg = store_config(tmp_path / "swap", host_pages=128)
    cfg.io.max_swap_size = 1 << 20
    with TieredStore(cfg) as s:
        refs = {k: page_tensor(i, 64) for i, k in enumerate("abcdef")}  # 256 KiB each
        for k in "abcd":
            s.put(k, refs[k], tier="NVME").wait()
        s.put("e", refs["e"], tier="HOST")
        with pytest.raises(SwapFullError, match="max_swap_size"):
            s.evict("e", N)
        assert s.info("e").state is Residency.HOST and torch.equal(s.get("e", H), refs["e"])
        s.put("f", refs["f"], tier="HOST")
        with pytest.raises(SwapFullError):  # the policy's victim cannot go down either
            s.put("g", page_tensor(7, 64), tier="HOST")
        assert "g" not in s
        s.audit()
        assert torch.equal(s.get("e", H), refs["e"]) and torch.equal(s.get("f", H), refs["f"])
        s.free("e")
        for k in "abcd":
            assert torch.equal(s.fetch(k, H).wait(), refs[k]), k
            s.evict(k, N).wait()  # clean: dropped, no write


def test_nvme_budget_is_hard(make_store):
    s = make_store(nvme_pages=2)
    s.put("a", page_tensor(1, 2), tier="NVME").wait()
    s.put("b", page_tensor(2), tier="HOST")
    with pytest.raises(BudgetExceededError, match="NVME holds 8192 of 8192 bytes"):
        s.evict("b", N)
    assert s.info("b").valid == {H}
    s.audit()


@pytest.mark.parametrize("engine", ENGINES)
def test_corrupted_extent_raises_and_hands_out_nothing(make_store, engine):
    s = make_store(engine=engine)
    ref = page_tensor(5, 2)
    s.put("a", ref, tier="NVME").wait()
    s.put("b", page_tensor(6), tier="NVME").wait()
    offset, _ = s.info("a").extent
    path = s.swap_paths("param")[0]
    flip_byte(path, offset + 100)
    for to in (H, D):
        h = s.fetch("a", to)
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            h.wait()
        info = s.info("a")
        assert info.state is Residency.NVME and info.valid == {N} and info.held == {N}
        with pytest.raises(RuntimeError, match="not valid"):
            s.get("a", to)
        st = s.stats()
        assert st.tiers["HOST"].used == 0 and st.tiers["DEVICE"].used == 0
        failed = st.moves["NVME->HOST"].failures + st.moves["NVME->DEVICE"].failures
        assert failed >= 1 + (to is D)
        s.audit()
    assert torch.equal(s.fetch("b", H).wait(), page_tensor(6))  # the others are untouched
    flip_byte(path, offset + 100)  # repaired on disk: the same record reads back
    assert torch.equal(s.fetch("a", D).wait(), ref)
    s.audit()


_HOLD_AND_WAIT = """
import sys, time, torch
from offload.store import TieredStore
from tests.store.conftest import store_config, page_tensor

s = TieredStore(store_config(sys.argv[1], host_pages=16))
s.put("a", page_tensor(1, 8), tier="NVME").wait()
s.put("b", page_tensor(2, 8), tier="NVME")               # maybe still in flight when killed
print("ready", flush=True)
time.sleep(120)
"""


def test_swap_dir_of_killed_process_is_reused_at_once(tmp_path):
    swap = tmp_path / "swap"
    p = _python(_HOLD_AND_WAIT, str(swap), popen=True)
    try:
        assert p.stdout.readline().strip() == "ready"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    left = sorted(os.listdir(swap))
    assert "offload-r0-param.swap" in left and "offload-r0-param.swap.lock" in left
    # The dead holder's flock died with it: the files are reclaimed at once.
    with TieredStore(store_config(swap, host_pages=16)) as s:
        s.put("a", page_tensor(3, 8), tier="NVME").wait()
        assert torch.equal(s.fetch("a", H).wait(), page_tensor(3, 8))
    assert not os.listdir(swap)


def test_could_hold_says_when_copies_can_never_be_resident_together(make_store):
    """`could_hold`: a set of copies whose bytes in a tier exceed its budget can never
    be pinned together (the engine then stages its updates without trying, and
    moves nothing); one within the budgets may be tried."""
    s = make_store(host_pages=4, device_pages=2)
    for k in "abc":
        s.put(k, page_tensor(1, 2), tier="NVME").wait()  # 2 pages each
    assert s.could_hold({"a": H, "b": H})
    assert not s.could_hold({"a": H, "b": H, "c": H})
    assert s.could_hold({"a": H, "b": H, "c": D})
    assert not s.could_hold({"a": D, "b": D})
    assert s.could_hold({"a": N, "b": N, "c": N})
    assert s.stats().moves["NVME->HOST"].moves == 0  # asking moved nothing


_VICTIM_FAILS = """
import json, resource, sys, time
from offload.io import IoError
from offload.store import TieredStore, Tier
from tests.store.conftest import store_config, page_tensor

s = TieredStore(store_config(sys.argv[1], device_pages=1, host_pages=1, wait_timeout=20.0))
s.put("b", page_tensor(3), tier="NVME").wait()           # the swap file grown ...
s.free("b")                                              # ... and its room free
s.put("a", page_tensor(1), tier="HOST")                  # dirty, its only copy
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))     # no write to the swap file fits
t0, out = time.monotonic(), {}
try:
    s.put("x", page_tensor(2), tier="HOST")
    out["error"] = None
except IoError as e:  # the write's error (a budget's sent the user to raise one)
    out["error"] = f"{type(e).__name__}: {e}"
out["seconds"] = time.monotonic() - t0
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
out["a_ok"] = bool((s.get("a", Tier.HOST) == page_tensor(1)).all())
s.audit()
s.close()
print(json.dumps(out))
"""


def test_a_victim_whose_write_fails_fails_the_reservation_at_once(tmp_path):
    """Room is made by writing the only copy of a dirty partition down; where that write
    fails, the put that needed the room raises at once naming the partition (not after
    store.wait_timeout), and the partition stays where it was."""
    r = _python(_VICTIM_FAILS, str(tmp_path / "swap"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] and "evicting partition 'a' failed" in out["error"], out
    assert out["error"].startswith("IoError: cannot make room") and "ulimit -f" in out["error"]
    assert out["seconds"] < 10 and out["a_ok"], out


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_whose_submit_raises_gives_its_room_back(make_store, op):
    """The engine refuses the read or write as it is submitted (here: closed under the
    store): the move fails naming the cause, the room it reserved is free again and
    the partition stays whole where it was."""
    s = make_store(engine="threads", host_pages=2, device_pages=2)
    was, to = (Tier.NVME, Tier.HOST) if op == "read" else (Tier.HOST, Tier.NVME)
    s.put("a", page_tensor(1), tier=was.name).wait()
    s._engine.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        (s.fetch("a", to=to) if op == "read" else s.evict("a", to=to)).wait()
    assert s.info("a").valid == {was}
    assert s.stats().tiers[to.name].used == 0
    s.audit()
