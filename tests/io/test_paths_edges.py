"""Swap paths as a user writes them, through `offload.initialize`: several paths (the
bytes really land on each), paths on other file systems, `~` and relative paths, a
path that fills up while training, swap files removed or cut short by someone else,
`io.direct = false` and extreme queue depths and block sizes. Real files, O_DIRECT,
and the numbers of plain torch AdamW."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch

import offload
from offload.config import ConfigError, IoConfig
from offload.engine.step import StepFailedError
from offload.io import IoError, SwapFullError, SwapPathError, SwapSpace, make_engine
from offload.store import Tier, TieredStore

from ..engine.conftest import small_fs  # noqa: F401  (a fixture)
from ..engine.disks import fill
from ..engine.test_numbers import Sometimes, _data, _loss
from ..store.conftest import page_tensor, store_config
from .conftest import build_engine

KINDS = ("param", "optim")  # what an all-NVMe placement keeps in swap files


def _cfg(paths, **io):
    """Everything on NVMe, small stripes and grow steps, so a tiny model's state is
    spread over every path."""
    return {"engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme",
                       "dtype": "fp32", "group_size": 1200},
            "optim": {"lr": 1e-2, "weight_decay": 0.1, "chunk_elems": 4096},
            "io": {"paths": [str(p) for p in paths], "buffer_budget": "32MiB",
                   "grow_step": "64KiB", "stripe_size": "16KiB", **io},
            "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}


def _pair(cfg):
    """An engine and the plain torch model and AdamW it must match."""
    torch.manual_seed(0)
    ref = Sometimes()
    engine = offload.initialize(copy.deepcopy(ref), cfg)
    return engine, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1,
                                          fused=True)


def _step_both(engine, ref, opt, batch):
    x, y = batch
    engine.backward(_loss(engine, x, y, True))
    assert engine.step()
    opt.zero_grad()
    _loss(ref, x, y, True).backward()
    opt.step()


def _same_as_torch(engine, ref):
    sd = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def _blocks_in_use(path) -> int:
    """4 KiB blocks of a file that hold anything but zeros."""
    data = open(path, "rb").read()
    return sum(1 for i in range(0, len(data), 4096) if any(data[i:i + 4096]))


def _snapshot(engine) -> dict:
    out = {"step": engine.global_step}
    for g in engine.groups:
        out[("p", g.gid)] = engine.store.fetch(("p", g.gid), to=Tier.HOST).wait().cpu().clone()
        for k, v in engine.optimizer.partition_state(g.gid).items():
            out[(k, g.gid)] = v.clone()
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


# -- several paths ---------------------------------------------------------------------

@pytest.mark.parametrize("io", [{}, {"queue_depth": 1, "block_size": 4096},
                                {"direct": False}],
                         ids=["default", "depth1-block4k", "buffered"])
def test_state_is_striped_over_every_path_and_trains_as_torch(tmp_path, io):
    paths = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    engine, ref, opt = _pair(_cfg(paths, **io))
    try:
        assert engine.store.io_engine.direct == io.get("direct", True)
        for batch in _data(3):
            _step_both(engine, ref, opt, batch)
        _same_as_torch(engine, ref)
        for kind in KINDS:
            files = engine.store.swap_paths(kind)
            assert [os.path.dirname(f) for f in files] == [str(p) for p in paths]
            sizes = [os.path.getsize(f) for f in files]
            assert len(set(sizes)) == 1 and sizes[0] > 0, (kind, sizes)  # an even share each
            assert all(_blocks_in_use(f) for f in files), kind  # and real bytes in each
    finally:
        engine.close()
    assert all(os.listdir(p) == [] for p in paths)


def test_a_path_that_refuses_o_direct_beside_one_that_takes_it(tmp_path, no_direct_dir):
    """auto falls back to buffered I/O for every path, naming the one that refuses;
    asking for O_DIRECT names it in the error. The bytes still stripe over both."""
    paths = [str(tmp_path / "disk"), str(no_direct_dir)]
    refused = re.escape(str(no_direct_dir)) + r" refuses O_DIRECT.*io.direct = false"
    with pytest.raises(ConfigError, match=refused):
        make_engine(IoConfig(paths=paths, engine="threads"))
    cfg = store_config(paths[0], device_pages=16, host_pages=16)
    cfg.io.paths, cfg.io.stripe_size, cfg.io.grow_step = paths, 16 << 10, 64 << 10
    s = TieredStore(cfg)
    try:
        assert s.io_engine.name == "threads" and not s.io_engine.direct
        t = page_tensor(4, 9)  # a little over two 16 KiB stripes
        s.put("x", t, tier="NVME").wait()
        assert all(_blocks_in_use(f) for f in s.swap_paths("param"))
        assert torch.equal(s.fetch("x", Tier.HOST).wait(), t)
    finally:
        s.close()
    assert os.listdir(no_direct_dir) == [] and os.listdir(paths[0]) == []


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: no size limit, and statvfs says 0 blocks of 0."""
    from ..conftest import _mount, _umount
    d = tmp_path / "ramfs"
    d.mkdir()
    why = _mount("ramfs", d) if os.geteuid() == 0 else "not root"
    if why is not None:
        pytest.skip(f"cannot mount ramfs: {why}")
    yield d
    _umount(d)


def test_a_file_system_without_a_size_is_not_refused_as_full(tmp_path, ramfs):
    engine, ref, opt = _pair(_cfg([tmp_path / "disk", ramfs], direct=False))
    try:
        _step_both(engine, ref, opt, _data(1)[0])
        _same_as_torch(engine, ref)
    finally:
        engine.close()


# -- paths as written -------------------------------------------------------------------

def test_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """No shell reads a config file: "~/swap" named a directory "~" under the current
    one, made there and filled with swap files."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert IoConfig(paths=["~/swap"]).paths == [str(home / "swap")]
    engine, ref, opt = _pair(_cfg(["~/swap"]))
    try:
        _step_both(engine, ref, opt, _data(1)[0])
        assert {os.path.dirname(f) for f in engine.store.swap_paths("optim")} == \
            {str(home / "swap")}
    finally:
        engine.close()
    assert os.listdir(work) == []


def test_relative_paths_hold_after_the_process_changes_directory(tmp_path, monkeypatch):
    """Swap files opened under a relative path were removed by that relative name at
    close: after an os.chdir() the engine left its own files and removed a file of the
    same name under the new directory (another job's swap file)."""
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    (later / "swap").mkdir(parents=True)
    monkeypatch.chdir(first)
    engine, ref, opt = _pair(_cfg(["swap"]))
    try:
        _step_both(engine, ref, opt, _data(1)[0])
        os.chdir(later)
        other = later / "swap" / os.path.basename(engine.store.swap_paths("optim")[0])
        other.write_bytes(b"another job's swap file")
        _step_both(engine, ref, opt, _data(2)[1])
        _same_as_torch(engine, ref)
    finally:
        engine.close()
    assert os.listdir(first / "swap") == []
    assert other.read_bytes() == b"another job's swap file"


def test_a_kind_opened_after_a_chdir_lands_beside_the_others(tmp_path, monkeypatch):
    """Kinds beyond store.swap_kinds open on first use, under the directory the store
    was given, whatever the current directory is by then."""
    monkeypatch.chdir(tmp_path)
    cfg = store_config("swap", engine="threads", device_pages=8, host_pages=8)
    cfg.store.swap_kinds = ["param"]
    s = TieredStore(cfg)
    try:
        (tmp_path / "elsewhere").mkdir()
        os.chdir(tmp_path / "elsewhere")
        t = page_tensor(3, 2)
        s.put("x", t, kind="late", tier="NVME").wait()
        assert s.swap_paths("late") == [str(tmp_path / "swap" / "offload-r0-late.swap")]
        assert torch.equal(s.fetch("x", Tier.HOST).wait(), t)
    finally:
        s.close()
    assert os.listdir(tmp_path / "elsewhere") == []
    assert os.listdir(tmp_path / "swap") == []


def test_a_swap_space_on_a_relative_path_removes_its_own_files_after_a_chdir(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = build_engine("threads")
    try:
        sw = SwapSpace(["rel"], "t", engine)
        assert sw.paths == [str(tmp_path / "rel" / "offload-t.swap")]
        (tmp_path / "other" / "rel").mkdir(parents=True)
        os.chdir(tmp_path / "other")
        decoy = tmp_path / "other" / "rel" / "offload-t.swap"
        decoy.write_text("keep")
        sw.close()
    finally:
        engine.close()
    assert os.listdir(tmp_path / "rel") == [] and decoy.read_text() == "keep"


# -- a path that fills up ---------------------------------------------------------------

def test_one_of_two_paths_fills_up_during_a_step(tmp_path, small_fs):  # noqa: F811
    """The step fails whole, naming the full path and what to do; every partition is
    as before; once space is freed training goes on as if the step never failed."""
    small = small_fs(16)
    paths = [tmp_path / "big", small]
    engine, ref, opt = _pair(_cfg(paths))
    try:
        before = _snapshot(engine)
        fill(Path(small), 0)
        x, y = _data(1)[0]
        engine.backward(_loss(engine, x, y, True))
        with pytest.raises(StepFailedError) as err:
            engine.step()
        full = err.value.__cause__
        while full is not None and not isinstance(full, SwapFullError):
            full = full.__cause__
        assert isinstance(full, SwapFullError), err.value
        msg = str(full)
        assert small in msg and "free disk space" in msg and "io.paths" in msg, msg
        assert str(tmp_path / "big") not in msg
        _assert_same(_snapshot(engine), before)
        os.unlink(os.path.join(small, "fill"))
        for batch in _data(3):
            _step_both(engine, ref, opt, batch)
        _same_as_torch(engine, ref)
    finally:
        engine.close()
    assert os.listdir(tmp_path / "big") == [] and sorted(os.listdir(small)) == ["lost+found"]


# -- swap files changed by someone else -------------------------------------------------

def test_a_swap_file_cut_short_mid_run_is_an_error_naming_it(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    engine, ref, opt = _pair(_cfg(paths))
    try:
        _step_both(engine, ref, opt, _data(1)[0])
        victim = engine.store.swap_paths("optim")[1]
        os.truncate(victim, 0)
        x, y = _data(2)[1]
        with pytest.raises(Exception) as err:
            engine.backward(_loss(engine, x, y, True))
            engine.step()
        chain, e = [], err.value
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        io = next((e for e in chain if isinstance(e, IoError)), None)
        assert io is not None, repr(err.value)
        assert victim in str(io) and "file ends before" in str(io)
    finally:
        engine.close()
    assert all(os.listdir(p) == [] for p in paths)


def test_swap_files_removed_mid_run_leave_training_unharmed(tmp_path):
    """An unlinked file lives on through its descriptor: training goes on, and close
    does not fail over the missing names."""
    paths = [tmp_path / "a", tmp_path / "b"]
    engine, ref, opt = _pair(_cfg(paths))
    try:
        _step_both(engine, ref, opt, _data(1)[0])
        for p in paths:
            for name in os.listdir(p):
                os.unlink(p / name)
        for batch in _data(3)[1:]:
            _step_both(engine, ref, opt, batch)
        _same_as_torch(engine, ref)
    finally:
        engine.close()
    assert all(os.listdir(p) == [] for p in paths)


def test_two_paths_on_one_file_system_are_counted_together_before_any_file(
        tmp_path, small_fs):  # noqa: F811
    mnt = Path(small_fs(16))
    fill(mnt, (100 << 10) // os.statvfs(mnt).f_frsize)  # 100 KiB: above one path's
    # 72 KiB share, below the 144 KiB of both
    with pytest.raises(SwapPathError, match=r"io.paths\[\d\]: .* free"):
        offload.initialize(Sometimes(), _cfg([mnt / "a", mnt / "b"]))
