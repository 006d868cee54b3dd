"""An optimizer never closed, at interpreter exit: its update threads are stopped
before finalization. A worker whose idle wait ran out during finalization freed its
scratch tensors there and aborted the process ("terminate called without an active
exception", exit code 134), in about half the runs of tests/optim."""

import subprocess
import sys
import textwrap


def test_an_unclosed_optimizers_threads_end_before_finalization(tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading

        def check():  # registered first, so it runs after offload's own exit hooks
            left = [t.name for t in threading.enumerate() if t.name.startswith("offload-adam")]
            print("left:", left, flush=True)

        atexit.register(check)
        import torch
        from offload.config import OptimConfig
        from offload.optim import CpuAdam, blocks
        opt = CpuAdam(OptimConfig(state_dtype="int8"))
        opt.kernel = blocks.BlockUpdater("auto", 1 << 12, threads=2)
        opt.add_partition("p", torch.zeros(1 << 16))
        opt.step({"p": torch.ones(1 << 16)})
        print("workers:", sum(t.name.startswith("offload-adam") for t in threading.enumerate()))
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "workers: 2" in r.stdout and "left: []" in r.stdout, (r.stdout, r.stderr)


def test_an_update_after_close_raises_instead_of_waiting():
    """After close() (or the exit's), workers return at once: an update waited for
    them for good."""
    import threading

    import pytest

    from offload.optim.blocks import BlockUpdater

    updater = BlockUpdater("auto", 4096, threads=2)
    updater.close()
    got: list = []

    def run():
        try:
            updater._each(lambda w: None)
            got.append("ran")
        except RuntimeError as e:
            got.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if not got:
        pytest.fail("the update waited for closed workers")
    assert "closed" in got[0]
    import torch

    from offload.optim.codec import new_moment
    one = BlockUpdater("auto", 4096, threads=1)  # the path without workers
    one.close()
    m, v = new_moment("fp32", "exp_avg", 8), new_moment("fp32", "exp_avg_sq", 8)
    with pytest.raises(RuntimeError, match="closed"):
        one.update([(0, 8, None, 0)], 0, torch.zeros(8), torch.zeros(8), m, v, None, 1.0)
