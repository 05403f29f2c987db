"""Our C++ CPU kernels, compiled on first use (torch.utils.cpp_extension, cached per machine).

Every caller has a pure-torch fallback: set CONVEYOR_DISABLE_KERNEL=1, or lack a compiler,
and everything still runs (slower, and without the chunk-invariance of the attention kernel).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import lru_cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))


def _headers_digest() -> str:
    # torch re-builds when a source or a flag changes, but not a header: fold them into a flag.
    return hashlib.sha1(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:12]


_EXTENSION = "conveyor_cpu_kernels"
_STALE_LOCK_S = 600  # a build takes ~30-90 s; a lock this old belongs to a killed build


def _clear_stale_build_lock() -> None:
    """torch waits forever on the build lock of a process killed mid-build (Ctrl-C during the
    first start): every later start would hang. A lock older than any build is removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(_EXTENSION, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            logger.warning("removing a stale kernel build lock %s", lock)
            lock.unlink(missing_ok=True)
    except Exception:  # a private torch helper: if it moves, keep the old behaviour
        pass


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    if os.environ.get("CONVEYOR_DISABLE_KERNEL") == "1":
        return None
    _clear_stale_build_lock()
    try:
        from torch.utils.cpp_extension import load

        return load(name=_EXTENSION, sources=[str(s) for s in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DCONVEYOR_HEADERS={_headers_digest()}"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # compiler or ninja missing: the torch paths still work
        logger.warning("C++ kernels unavailable (%s); using torch reference paths", exc)
        return None
