"""Importing conveyor makes torch's OpenMP waiters sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose."""

import os
import subprocess
import sys

PROBE = "import conveyor, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy_after_import(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_passive_by_default_and_the_users_choice_wins():
    assert _policy_after_import(None) == "PASSIVE"
    assert _policy_after_import("ACTIVE") == "ACTIVE"
