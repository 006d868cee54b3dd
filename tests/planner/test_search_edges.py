"""The tuner's arithmetic at its edges: bad inputs say what is wrong (no KeyError or
ZeroDivisionError), and candidates that move nothing need no disk rates."""

import pytest

from offload.planner import Rates
from offload.planner.estimate import ModelBytes, Placement, kind_bytes
from offload.planner.search import Budgets, Candidate, Machine, Space, score, search
from offload.planner.sizes import auto_chunk_elems

from .test_search import SHAPE

MiB = 1 << 20


def test_an_unknown_dtype_is_a_value_error_that_lists_the_known_ones():
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of"):
        kind_bytes(ModelBytes(((10, True),), "fp8"))


@pytest.mark.parametrize("buffers", [0, -1])
def test_chunk_elems_without_buffers_is_a_value_error(buffers):
    with pytest.raises(ValueError, match="buffers"):
        auto_chunk_elems(64 * MiB, buffers)


def test_placements_in_memory_are_scored_without_the_disk_rates_of_the_default_io_keys():
    """A candidate that keeps everything in memory moves no bytes to or from NVMe, so
    the defaults' (block size, queue depth) need not be among those probed; one that
    uses NVMe at a key not probed is a ValueError naming it, not a KeyError."""
    machine = Machine({(1 * MiB, 8): Rates(2e9, 2e9)}, adam_eps=1e9)
    defaults = Candidate(Placement("device", "host", "host"), SHAPE.group_size, 2, 6,
                         64 * MiB, 4 * MiB, 32, 0, 0)
    roomy = Budgets(host=4096 * MiB, device=4096 * MiB)
    memory = Space(placements=(Placement("device", "host", "host"),
                               Placement("host", "host", "host")))
    got = search([SHAPE], memory, roomy, machine, defaults)
    assert len(got) == 2 and all(s.bytes_read == s.bytes_written == 0 for s in got)
    nvme = Candidate(Placement("nvme", "host", "host"), SHAPE.group_size, 2, 6, 64 * MiB,
                     4 * MiB, 32, 0, 0)
    with pytest.raises(ValueError, match=r"block size 4194304, queue depth 32.*\(1048576, 8\)"):
        score(SHAPE, nvme, roomy, machine)


@pytest.mark.parametrize("kw, match", [
    (dict(adam_eps=0.0), "adam_eps"), (dict(adam_eps=float("nan")), "adam_eps"),
    (dict(adam_eps=1e9, copy_Bps=-1.0), "copy_Bps"),
    (dict(adam_eps=1e9, unit_overhead_s=float("nan")), "unit_overhead_s"),
    (dict(adam_eps=1e9, chunk_overhead_s=-1.0), "chunk_overhead_s"),
    (dict(adam_eps=1e9, adam_eps_by_state={"int8": 0.0}), "int8"),
])
def test_a_machine_whose_rates_are_no_rates_is_refused(kw, match):
    """Measured rates of zero or NaN would divide by zero or predict NaN steps deep in
    the search; the machine is refused where it is built, naming the rate."""
    with pytest.raises(ValueError, match=match):
        Machine({(4 * MiB, 32): Rates(2e9, 2e9)}, **kw)
