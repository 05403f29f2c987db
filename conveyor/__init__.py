"""conveyor: a continuous-batching LLM inference server on PyTorch."""

from __future__ import annotations

import os
import sys
from typing import Any

# torch's own OpenMP ops end each parallel region at a barrier where, by default, the waiting thread
# spins; on a shared box that spin holds the core its partner needs and every such op stalls for a
# time slice. Sleeping waiters measured faster beside two CPU hogs and no slower alone
# (benchmarks/results.md, issue #19). libgomp reads this when torch loads it, so it is set here,
# before any torch import; a value already in the environment wins. Our kernels do not use
# OpenMP's barrier (kernels/csrc/parallel.h).
# Too late where torch (and its OpenMP) loaded first without the variable: then every torch op that goes parallel
# (a state copy, a logits conversion) leaves its waiters spinning on the cores our kernels' next call needs; an MTP
# verify round measured ~10 % slower that way. The backend warns (kernels/backend.py: omp_spin_warning).
OMP_WAIT_POLICY_TOO_LATE = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _keep_freed_heap() -> None:
    """glibc gives a block over 128 KB (its threshold grows to at most 32 MB) a mapping of its own, unmapped when freed,
    and trims the heap's top past 2x that: every prefill step then page-faults its activations in again (a 1,480-token
    step of a 1B model allocates ~1 GB of them, 48 MB a gate|up output), and the kernel zeroes each page first. So freed
    memory stays in the heap for reuse (that step 3.4 -> 3.0 s on a Zen 5), and no block gets a mapping: the ones past
    32 MB (gate|up outputs from ~1,000 prompt tokens on a 1B model) came and went each layer (1,480 tokens 2.84 ->
    2.48 s; benchmarks/results.md, issue #43). One arena for every thread: the engine runs on its own thread, and a
    thread's arena grows in 64 MB heaps, mapping any larger block regardless. torch's own advice for CPU inference is
    the same (jemalloc / tcmalloc that never give memory back). After a load, and when a model unloads,
    loading.heap.trim_heap() still returns what is free. Set before any large allocation or thread; a MALLOC_*
    variable already in the environment, or CONVEYOR_MALLOC_KEEP=0, leaves glibc's defaults."""
    opted_out = os.environ.get("CONVEYOR_MALLOC_KEEP", "1") == "0" or any(k.startswith("MALLOC_") for k in os.environ)
    if opted_out or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl)
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    mallopt(M_MMAP_MAX, 0)  # no block gets its own mapping (the main heap still maps more room when brk cannot grow)
    mallopt(M_ARENA_MAX, 1)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


_keep_freed_heap()

__all__ = ["LLM", "CompletionResult", "GrammarSpec", "InvalidRequestError", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: `conveyor bench` and the CLI parser should not pay for importing torch.
    if name in ("LLM", "CompletionResult"):
        from conveyor.engine import llm

        return getattr(llm, name)
    if name in ("InvalidRequestError", "SamplingParams"):
        from conveyor.engine import sampling_params

        return getattr(sampling_params, name)
    if name == "GrammarSpec":
        from conveyor.structured.grammar import GrammarSpec

        return GrammarSpec
    raise AttributeError(name)
