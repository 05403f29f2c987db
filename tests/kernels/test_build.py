import fcntl
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

from conveyor.kernels import build

NAME = "conveyor_gemm_locktest"


def _build_dir() -> Path:
    return Path(_get_build_directory(NAME, verbose=False))


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch waits forever on the lock file of a build killed mid-way; under our OS lock it is stale."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _build_dir().mkdir(parents=True, exist_ok=True)
    (_build_dir() / "lock").touch()
    with build._build_lock(NAME):
        assert not (_build_dir() / "lock").exists()


def test_the_build_lock_excludes_others_and_dies_with_its_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from conveyor.kernels import build\n"
        f"with build._build_lock({NAME!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(_build_dir() / "conveyor.lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("a second process got the build lock while it was held")
            except BlockingIOError:
                pass
            holder.kill()  # kill -9 mid-"build": the kernel releases the lock
            holder.wait(timeout=10)
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the lock outlived its holder"
                    time.sleep(0.05)
    finally:
        holder.kill()
