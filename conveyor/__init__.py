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
