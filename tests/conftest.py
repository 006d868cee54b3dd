"""Shared by every test package: `gpu` tests skip without CUDA, and the I/O
engines (threads always, aio where libaio loads) as a parametrised fixture."""

import os

import pytest
import torch

from offload.io import AioEngine, ThreadEngine, libaio_status

AIO_OK, AIO_WHY = libaio_status()
ENGINES = ["threads", pytest.param("aio", marks=pytest.mark.skipif(not AIO_OK, reason=AIO_WHY))]


def build_engine(name: str, **kw):
    """A small-block engine, so small test files still split into many blocks."""
    kw.setdefault("block_size", 64 << 10)
    kw.setdefault("queue_depth", 8)
    if name == "aio":
        return AioEngine(**kw)
    return ThreadEngine(threads=4, **kw)


@pytest.fixture(params=ENGINES)
def engine(request):
    eng = build_engine(request.param)
    yield eng
    eng.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def flip_byte(path, offset: int) -> None:
    """Flips one byte of a file behind offload's back, through a normal (buffered) fd
    apart from its O_DIRECT one; flipping it again restores it."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
