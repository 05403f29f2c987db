"""trim_heap gives back the holes freed tensors leave inside glibc's heap (what packing a big GGUF leaves)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np
    from conveyor.loading.heap import trim_heap

    def rss_anon_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) // 1024

    big = np.ones((16 << 20) // 8)  # mmapped; freeing it raises glibc's mmap threshold to 16 MB
    del big
    kept, freed = [], []
    for i in range(128):  # 4 MB arrays from the heap, every other one freed: holes between kept ones
        (kept if i % 2 else freed).append(np.ones((4 << 20) // 8))
    del freed
    before = rss_anon_mb()
    trim_heap()
    print(before, rss_anon_mb())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc are Linux's")
def test_trim_heap_returns_the_holes_between_kept_arrays() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    before, after = (int(v) for v in out.split())
    assert before - after >= 200, (before, after)  # 64 holes of 4 MB
