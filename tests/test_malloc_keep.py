"""conveyor's import keeps freed heap memory for reuse (no block gets its own mapping, one arena, trimming late):
a 24 MB block, and an 80 MB one allocated on another thread (as the engine's), then come from the heap instead of
their own mappings, so a prefill's activations are not page-faulted in again every step. Checked in a fresh
interpreter, by glibc's own accounting (mallinfo2, which counts the main arena: a block in another thread's arena
would not show as free there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys, threading
if sys.argv[1] == "import":
    import conveyor  # noqa: F401
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
size = int(sys.argv[2]) << 20
result = {}
def probe():
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    result["mapped"] = libc.mallinfo2().hblkhd - before
    libc.free(block)
    result["free_in_heap"] = libc.mallinfo2().fordblks
if sys.argv[3] == "thread":
    worker = threading.Thread(target=probe)
    worker.start()
    worker.join()
else:
    probe()
print(json.dumps(result))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")

def _probe(mode: str, mb: int = 24, where: str = "main", **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "CONVEYOR_MALLOC_KEEP"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(mb), where], env={**clean, **env}, check=True,
                         capture_output=True, text=True)

    return json.loads(out.stdout)

def test_import_keeps_a_freed_24mb_block_in_the_heap():
    kept = _probe("import")
    assert kept["mapped"] == 0, "the block got its own mapping: the mmap threshold was not raised"
    assert kept["free_in_heap"] >= 24 << 20, "the freed block was trimmed back to the OS"

def test_import_keeps_an_80mb_block_of_another_thread_in_the_heap():
    """Past glibc's largest mmap threshold (32 MB) and a thread arena's 64 MB heaps: a long prompt's gate|up output,
    allocated on the engine's thread."""
    kept = _probe("import", mb=80, where="thread")
    assert kept["mapped"] == 0, "the block got its own mapping"
    assert kept["free_in_heap"] >= 80 << 20, "the freed block is not free in the main heap (another arena, or trimmed)"


def test_without_conveyor_or_with_the_opt_out_glibc_maps_it():
    assert _probe("bare")["mapped"] >= 24 << 20
    assert _probe("bare", mb=80, where="thread")["mapped"] >= 80 << 20
    assert _probe("import", CONVEYOR_MALLOC_KEEP="0")["mapped"] >= 24 << 20

def test_a_malloc_variable_in_the_environment_wins():
    assert _probe("import", MALLOC_ARENA_MAX="4")["mapped"] >= 24 << 20
