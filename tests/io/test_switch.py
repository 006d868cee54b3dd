"""The process's switch interval: shortened while holds are open, restored by the last."""

import gc
import sys

import pytest

from offload.io import hold_switch_interval


@pytest.fixture(autouse=True)
def _restore():
    before = sys.getswitchinterval()
    yield
    assert sys.getswitchinterval() == before  # every test gave back what it held
    sys.setswitchinterval(before)


def test_last_release_restores_in_any_order():
    before = sys.getswitchinterval()
    a = hold_switch_interval(0.002)
    b = hold_switch_interval(0.0004)
    assert sys.getswitchinterval() == pytest.approx(0.0004)
    b.release()
    assert sys.getswitchinterval() == pytest.approx(0.002)
    c = hold_switch_interval(0.003)
    a.release()
    assert sys.getswitchinterval() == pytest.approx(0.003)
    c.release()
    c.release()  # idempotent
    assert sys.getswitchinterval() == before


def test_zero_leaves_it_alone_and_a_collected_hold_gives_back():
    before = sys.getswitchinterval()
    none = hold_switch_interval(0)
    assert not none.held and sys.getswitchinterval() == before
    h = hold_switch_interval(0.0006)
    assert h.held and sys.getswitchinterval() == pytest.approx(0.0006)
    del h
    gc.collect()
    assert sys.getswitchinterval() == before


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        hold_switch_interval(2.0)
