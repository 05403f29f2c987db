"""`<think>...</think>` (Qwen3, DeepSeek-R1 style) split out of the reply into reasoning_content."""

from __future__ import annotations

from conveyor.structured.tools import _partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def template_thinks(chat_template: str | None) -> bool:
    return bool(chat_template) and THINK_OPEN in chat_template  # type: ignore[operator]


def prompt_opens_thinking(prompt: str) -> bool:
    """The generation prompt already opened a think block (e.g. `...assistant\\n<think>\\n`)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningStream:
    """Incremental split of generated text into (reasoning, content); partial tags are held back."""

    def __init__(self, thinking: bool = False) -> None:
        self._thinking = thinking
        self._buffer = ""
        self._fresh = True  # strip the whitespace that opens the reply, a think block, or follows one

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = "", ""
        while self._buffer:
            marker = THINK_CLOSE if self._thinking else THINK_OPEN
            at = self._buffer.find(marker)
            cut = at if at >= 0 else len(self._buffer) - _partial_suffix(self._buffer, marker)
            piece = self._strip(self._buffer[:cut])
            self._buffer = self._buffer[cut + len(marker):] if at >= 0 else self._buffer[cut:]
            if self._thinking:
                reasoning += piece
            else:
                content += piece
            if at < 0:
                break
            self._thinking, self._fresh = not self._thinking, True
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._strip(self._buffer), ""
        return (rest, "") if self._thinking else ("", rest)

    def _strip(self, piece: str) -> str:
        if self._fresh:
            piece = piece.lstrip()
            self._fresh = not piece
        return piece
