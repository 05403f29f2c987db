import os
import time
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

from conveyor.kernels import build


def test_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's lock behind, and torch would wait on it forever."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory(build.extension_name("gemm", "native"), verbose=False)) / "lock"
    lock.touch()
    build._clear_stale_build_lock(build.extension_name("gemm", "native"))
    assert lock.exists()  # fresh: another process may be building right now
    old = time.time() - build._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    build._clear_stale_build_lock(build.extension_name("gemm", "native"))
    assert not lock.exists()
