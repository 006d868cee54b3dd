import pytest

from offload.io import AioEngine, BufferPool, ThreadEngine, libaio_status

AIO_OK, AIO_WHY = libaio_status()
ENGINES = ["threads", pytest.param("aio", marks=pytest.mark.skipif(not AIO_OK, reason=AIO_WHY))]


def build_engine(name: str, **kw):
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


@pytest.fixture
def pool():
    p = BufferPool(256 << 20)
    yield p
    p.close(force=True)
