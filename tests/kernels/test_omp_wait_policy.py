"""OMP_WAIT_POLICY: conveyor asks for sleeping OpenMP waiters before torch loads OpenMP, and says so plainly where
torch was imported first (its spinning waiters slow our kernels' next calls)."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
{first}
import conveyor
from conveyor.kernels.backend import omp_spin_warning
print("too_late", conveyor.OMP_WAIT_POLICY_TOO_LATE, "policy", os.environ.get("OMP_WAIT_POLICY"))
print("warned", omp_spin_warning())
"""


def _run(first: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], capture_output=True, text=True,
                          env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("first, env, late", [
    ("", {}, False),  # conveyor first: it sets the policy before torch loads
    ("import torch", {}, True),  # torch first, nothing set: the warning
    ("import torch", {"OMP_WAIT_POLICY": "ACTIVE"}, False),  # the user's own choice is theirs
])
def test_policy_and_warning(first, env, late):
    out = _run(first, **env)
    assert f"too_late {late}" in out
    assert f"warned {late}" in out
    assert ("torch was imported before conveyor" in out) == late
    if not env:
        assert "policy PASSIVE" in out
