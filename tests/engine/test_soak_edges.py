"""Soak tests: what a long training job or a notebook accumulates. With parameters,
gradients and optimizer state on NVMe, after a few warm-up steps the open file
descriptors, the Python threads, the swap files' sizes on disk and the store's
partitions stay exactly as they were: over more steps, failed forwards, backwards
and steps, background checkpoint saves with `keep_checkpoints`, and evaluation
forwards; `close()` gives back every thread, file and swap file, and the engine is
collected once dropped."""

import gc
import os
import threading
import weakref

import pytest
import torch
from torch import nn

import offload
from offload.engine.step import StepFailedError


class _Boom(nn.Module):
    """A linear layer whose forward, or backward, raises while armed."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.in_forward = False
        self.in_backward = False

    def forward(self, x):
        if self.in_forward:
            raise ValueError("forward failed")
        y = self.inner(x)
        if self.in_backward and y.requires_grad:
            def boom(grad):
                raise ValueError("backward failed")
            y.register_hook(boom)
        return y


class _MLP(nn.Module):
    def __init__(self, dim: int = 64, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.boom = _Boom(dim)  # after the second layer: some units ran before it
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                x = self.boom(x)
        return self.out(x)


def _cfg(tmp_path, **engine):
    return {
        "engine": {"params": "nvme", "grads": "nvme", "optimizer": "nvme", "dtype": "fp32",
                   "group_size": 5000, **engine},
        "optim": {"lr": 1e-3, "chunk_elems": 4096},
        "io": {"paths": [str(tmp_path / "swap")], "buffer_budget": "8MiB", "grow_step": "1MiB"},
        "store": {"host_budget": "128KiB", "device_budget": "64KiB", "device": "cpu"},
    }


def _step(engine, x) -> None:
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _swap_files(tmp_path) -> dict[str, int]:
    """Each file under the swap directory and its size in bytes."""
    d = tmp_path / "swap"
    return {f.name: f.stat().st_size for f in d.iterdir()} if d.exists() else {}


def _held(engine, tmp_path) -> dict:
    """What must not grow: fds, Python threads, swap file sizes, store partitions."""
    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")),
            "threads": sorted(t.name for t in threading.enumerate()),
            "swap": _swap_files(tmp_path),
            "partitions": engine.store.stats().summary().split(";")[0]}


def test_many_steps_hold_fds_threads_swap_files_and_partitions_flat(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    with offload.initialize(_MLP(), _cfg(tmp_path)) as engine:
        for _ in range(3):
            _step(engine, x)
        warm = _held(engine, tmp_path)
        for _ in range(25):
            _step(engine, x)
        assert _held(engine, tmp_path) == warm


def test_failed_forwards_backwards_and_steps_leave_nothing_behind(tmp_path):
    """An exception in the model's forward, one in its backward after early updates,
    and a StepFailedError (a partition pinned at the commit) leave no fd, thread,
    swap space or partition behind."""
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 64)
    with offload.initialize(model, _cfg(tmp_path)) as engine:
        for _ in range(3):
            _step(engine, x)
        warm = _held(engine, tmp_path)
        failed = 0
        for _ in range(4):
            model.boom.in_forward = True
            with pytest.raises(ValueError, match="forward failed"):
                engine(x)
            model.boom.in_forward = False
            _step(engine, x)
            model.boom.in_backward = True
            with pytest.raises(ValueError, match="backward failed"):
                engine.backward(engine(x).pow(2).mean())
            model.boom.in_backward = False
            _step(engine, x)
            engine.backward(engine(x).pow(2).mean())
            key = ("p", engine.groups[0].gid)
            engine.store.pin(key)
            try:
                with pytest.raises(StepFailedError):
                    engine.step()
                failed += 1
            finally:
                engine.store.unpin(key)
            _step(engine, x)
        assert failed == 4
        assert _held(engine, tmp_path) == warm


def test_background_saves_keep_k_checkpoints_and_no_threads_or_fds(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    ckpts = tmp_path / "ckpt"
    with offload.initialize(_MLP(), _cfg(tmp_path, keep_checkpoints=2)) as engine:
        for _ in range(2):
            _step(engine, x)
            engine.save_checkpoint(ckpts / f"step-{engine.global_step}", blocking=False)
        engine.wait_for_checkpoint()
        warm = _held(engine, tmp_path)
        for _ in range(8):
            _step(engine, x)
            engine.save_checkpoint(ckpts / f"step-{engine.global_step}", blocking=False)
        engine.wait_for_checkpoint()
        assert _held(engine, tmp_path) == warm
        # the two newest, and nothing else: no partial directories, no lock files
        assert sorted(os.listdir(ckpts)) == ["step-10", "step-9"]


def test_eval_forwards_between_steps_hold_everything_flat(tmp_path):
    """no_grad and inference_mode forwards, and a grad-enabled forward whose output
    is dropped without a backward, between steps."""
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 64)
    with offload.initialize(model, _cfg(tmp_path)) as engine:
        def evaluate():
            with torch.no_grad():
                engine(x)
            with torch.inference_mode():
                engine(x)
            model.eval()
            engine(x)  # dropped: no backward
            model.train()
        for _ in range(3):
            _step(engine, x)
            evaluate()
        warm = _held(engine, tmp_path)
        for _ in range(12):
            _step(engine, x)
            evaluate()
        assert _held(engine, tmp_path) == warm


def test_initialize_close_cycles_give_back_threads_fds_swap_files_and_the_engine(tmp_path):
    x = torch.randn(8, 64)
    gc.collect()
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    engines = []
    for _ in range(3):
        model = _MLP()
        with offload.initialize(model, _cfg(tmp_path)) as engine:
            _step(engine, x)
            engine.save_checkpoint(tmp_path / f"ckpt{len(engines)}", blocking=False)
        engines.append((weakref.ref(engine), weakref.ref(model)))
        del engine, model
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == fds
        assert threading.active_count() == threads
        assert _swap_files(tmp_path) == {}
    assert [(e(), m()) for e, m in engines] == [(None, None)] * 3


def test_an_engine_dropped_without_close_gives_back_its_threads_and_swap_files(tmp_path):
    """[Note: an engine dropped without close()]: a notebook cell run twice drops the
    first engine with its model; its threads and swap files come back when it is
    collected, with a ResourceWarning, as for a file left open."""
    x = torch.randn(8, 64)
    gc.collect()
    threads = threading.active_count()
    engine = offload.initialize(_MLP(), _cfg(tmp_path))
    try:
        _step(engine, x)
        alive = weakref.ref(engine)
        assert any(n.endswith(".swap") for n in _swap_files(tmp_path))
        with pytest.warns(ResourceWarning, match="without close"):
            del engine
            gc.collect()
        assert alive() is None
        assert threading.active_count() == threads
        assert not any(n.endswith(".swap") for n in _swap_files(tmp_path))
    finally:
        leaked = alive()
        if leaked is not None:  # let the rest of the session go on without it
            leaked.close()


def test_a_dropped_engine_whose_model_is_kept_stays_usable(tmp_path):
    """The model's hooks hold the engine: dropping the engine but keeping the model it
    wraps keeps both working, and nothing is released under them."""
    x = torch.randn(8, 64)
    model = _MLP()
    engine = offload.initialize(model, _cfg(tmp_path))
    _step(engine, x)
    want = engine(x).detach()
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is not None
    assert torch.equal(model(x).detach(), want)
    alive().close()
