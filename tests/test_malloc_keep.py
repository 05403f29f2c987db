"""conveyor's import keeps freed heap memory for reuse (glibc's mmap threshold at its largest, trimming late):
a 24 MB block then comes from the heap instead of its own mapping, so a prefill's activations are not
page-faulted in again every step. Checked in a fresh interpreter, by glibc's own accounting (mallinfo2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys
if sys.argv[1] == "import":
    import conveyor  # noqa: F401
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
block = libc.malloc(24 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(json.dumps({"mapped": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")

def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "CONVEYOR_MALLOC_KEEP"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, check=True, capture_output=True,
                         text=True)

    return json.loads(out.stdout)

def test_import_keeps_a_freed_24mb_block_in_the_heap():
    kept = _probe("import")
    assert kept["mapped"] == 0, "the block got its own mapping: the mmap threshold was not raised"
    assert kept["free_in_heap"] >= 24 << 20, "the freed block was trimmed back to the OS"

def test_without_conveyor_or_with_the_opt_out_glibc_maps_it():
    assert _probe("bare")["mapped"] >= 24 << 20
    assert _probe("import", CONVEYOR_MALLOC_KEEP="0")["mapped"] >= 24 << 20

def test_a_malloc_variable_in_the_environment_wins():
    assert _probe("import", MALLOC_ARENA_MAX="4")["mapped"] >= 24 << 20
