import pytest

from offload.io import BufferPool

from ..conftest import AIO_OK, ENGINES, build_engine  # noqa: F401  (for the tests here)


@pytest.fixture
def pool():
    p = BufferPool(256 << 20)
    yield p
    p.close(force=True)
