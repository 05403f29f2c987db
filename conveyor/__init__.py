"""conveyor: a continuous-batching LLM inference server on PyTorch."""

from __future__ import annotations

from typing import Any

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
