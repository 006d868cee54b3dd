"""OpenMP's wait policy ([Note: OpenMP's wait policy] in offload/__init__.py): `import
offload` before torch sets OMP_WAIT_POLICY=PASSIVE unless the environment names a
policy; after torch it changes nothing, and an engine whose updates run beside
backward says once how to set it. Each case is a process of its own: libgomp reads
the variable when torch loads it."""

import os
import subprocess
import sys

import pytest

from ..conftest import run_together

REPORT = ("import os, offload; print(os.environ.get('OMP_WAIT_POLICY'), "
          "repr(offload.omp_wait_policy()))")


def _env(policy: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return env


def _run(code: str, policy: str | None, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=_env(policy),
                          capture_output=True, text=True, timeout=300)


def test_import_sets_passive_only_before_torch_and_never_over_the_user():
    cases = [  # (imports, the environment's policy, printed)
        ("import offload, torch", None, "PASSIVE 'PASSIVE'"),  # set before torch loads
        ("import offload, torch", "ACTIVE", "ACTIVE 'ACTIVE'"),  # the user's choice stays
        ("import torch, offload", None, "None ''"),  # too late: nothing changed, told later
        ("import torch, offload", "passive", "passive 'passive'"),
    ]
    runs = run_together([[sys.executable, "-c", f"{first}\n{REPORT}"] for first, _, _ in cases],
                        timeout=300, envs=[_env(policy) for _, policy, _ in cases])
    for (first, policy, printed), r in zip(cases, runs):
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == printed, (first, policy)


TRAIN = """
import logging, sys, torch, offload
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
cfg = {"engine": {"params": "device", "grads": "host", "optimizer": "%s"},
       "io": {"paths": [sys.argv[1]]}, "store": {"device": "cpu"}}
for _ in range(2):  # said once per process
    eng = offload.initialize(torch.nn.Sequential(torch.nn.Linear(64, 64)), cfg)
    eng.backward(eng(torch.randn(4, 64)).square().mean()); eng.step(); eng.close()
"""


@pytest.mark.parametrize("optimizer, policy, warned", [
    ("nvme", None, 1),  # updates beside backward, threads spinning: told once
    ("nvme", "PASSIVE", 0),
    pytest.param("host", None, 0, marks=pytest.mark.slow),  # no early updates: nothing to say
])
def test_the_engine_says_once_how_to_stop_the_spinning(tmp_path, optimizer, policy, warned):
    r = _run(TRAIN % optimizer, policy, str(tmp_path / "swap"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("Set OMP_WAIT_POLICY=PASSIVE") == warned, r.stderr
