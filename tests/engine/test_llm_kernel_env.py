"""LLM() takes the kernel knobs from the environment, as `conveyor serve` does: the kernel-level stage of
`make test` (scripts/kernel-levels.sh) selects a level with CONVEYOR_KERNEL_ARCH and runs engine tests
through LLM(), which must then build that level, not the native one."""

from __future__ import annotations

import conveyor.engine.llm as llm_module
from conveyor.engine.llm import LLM


class _Captured:
    def __init__(self, config, checkpoint, draft_checkpoint) -> None:
        self.config = config
        self.tokenizer = None


def test_kernel_knobs_come_from_the_environment_unless_passed(monkeypatch):
    monkeypatch.setattr(llm_module, "EngineCore", _Captured)
    monkeypatch.setenv("CONVEYOR_KERNEL_ARCH", "x86-64-v3")
    monkeypatch.setenv("CONVEYOR_REQUIRE_KERNELS", "1")
    config = LLM(model="unused").engine.config
    assert (config.kernel_arch, config.require_kernels, config.disable_kernel) == ("x86-64-v3", True, False)
    config = LLM(model="unused", kernel_arch="x86-64", require_kernels=False).engine.config
    assert (config.kernel_arch, config.require_kernels) == ("x86-64", False)  # an argument wins
    monkeypatch.delenv("CONVEYOR_KERNEL_ARCH")
    monkeypatch.delenv("CONVEYOR_REQUIRE_KERNELS")
    config = LLM(model="unused").engine.config
    assert (config.kernel_arch, config.require_kernels) == ("native", False)
