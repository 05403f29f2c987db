"""Kernel tests run on the backend the environment asks for (CONVEYOR_KERNEL_ARCH selects the
ISA level). Under CONVEYOR_REQUIRE_KERNELS=1 (make test) a kernel that does not build fails the
run instead of skipping its tests."""

import pytest

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import KernelBackend, cpu_backend


def kernel_backend(*needed: str) -> KernelBackend:
    """The CPU backend, or a module-level skip naming the missing kernel (never under REQUIRE)."""
    backend = cpu_backend(kernel_settings_from_env())  # raises KernelsRequiredError under CONVEYOR_REQUIRE_KERNELS=1
    for kernel in needed:
        if getattr(backend, {"fused_ops": "fused"}.get(kernel, kernel)) is None:
            pytest.skip(f"C++ kernel {kernel!r} unavailable: {backend.errors.get(kernel)}", allow_module_level=True)
    return backend
