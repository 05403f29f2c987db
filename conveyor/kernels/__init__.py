"""Compute kernels and the backend object that picks them (below both `models` and `runner`).

- build.py: compiling/loading the C++ CPU kernels (csrc/) per ISA level, compile-only checks
- backend.py: KernelBackend, resolved once per model: the ops every layer calls, with torch fallbacks
- attention.py: paged-attention metadata and the torch reference path
"""

from conveyor.kernels.attention import AttentionMetadata
from conveyor.kernels.backend import KernelBackend, KernelSettings, KernelsRequiredError, cpu_backend, resolve_backend

__all__ = ["AttentionMetadata", "KernelBackend", "KernelSettings", "KernelsRequiredError", "cpu_backend",
           "resolve_backend"]
