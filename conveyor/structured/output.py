"""A chat reply's text -> content, reasoning_content and tool calls; one parser per choice, streamed or not."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.structured.harmony import HarmonyStream
from conveyor.structured.reasoning import ReasoningStream
from conveyor.structured.tools import ToolCall, ToolCallStream


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True)
class ChatParsing:
    """How a request's replies are parsed: None fields are off."""

    tool_names: frozenset[str] | None = None  # tools offered (auto / required / named)
    thinking: bool | None = None  # reasoning parser on; True when the prompt already opened <think>
    harmony: bool = False  # GPT-OSS: channels and calls of the harmony format (structured/harmony.py)

    @property
    def enabled(self) -> bool:
        return self.tool_names is not None or self.thinking is not None or self.harmony

    @property
    def reasons(self) -> bool:
        """Replies carry reasoning_content (a <think> parser, or harmony's analysis channel)."""
        return self.thinking is not None or self.harmony

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self)


class ChatOutputParser:
    def __init__(self, parsing: ChatParsing) -> None:
        names = set(parsing.tool_names) if parsing.tool_names is not None else None
        # harmony replies carry their own channels and calls: one parser for all three
        self._harmony = HarmonyStream(names or set()) if parsing.harmony else None
        harmony = self._harmony is not None
        self._reasoning = ReasoningStream(parsing.thinking) if parsing.thinking is not None and not harmony else None
        self._tools = ToolCallStream(names) if names is not None and not harmony else None

    @property
    def num_tool_calls(self) -> int:
        parser = self._harmony or self._tools
        return parser.num_calls if parser is not None else 0

    @property
    def cut_tool_call(self) -> bool:
        parser = self._harmony or self._tools
        return parser is not None and parser.cut_call

    def feed(self, text: str) -> ChatDelta:
        if self._harmony is not None:
            reasoning, content, calls = self._harmony.feed(text)
            return ChatDelta(content, reasoning, calls)
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._content(reasoning, content, finish=False)

    def finish(self, truncated: bool = False) -> ChatDelta:
        """The end of the reply; `truncated` when max_tokens cut it (finish_reason "length")."""
        if self._harmony is not None:
            reasoning, content, calls = self._harmony.finish(truncated)
            return ChatDelta(content, reasoning, calls)
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._content(reasoning, content, finish=True, truncated=truncated)

    def _content(self, reasoning: str, content: str, finish: bool, truncated: bool = False) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content, reasoning)
        content, calls = self._tools.feed(content)
        if finish:
            more, last = self._tools.finish(truncated)
            content, calls = content + more, calls + last
        return ChatDelta(content, reasoning, calls)

    def parse(self, text: str, truncated: bool = False) -> ChatDelta:
        """A whole reply at once (non-streaming)."""
        delta = self.feed(text)
        delta += self.finish(truncated)
        if delta.tool_calls or self.cut_tool_call:
            delta.content = delta.content.strip()
        delta.reasoning = delta.reasoning.strip()
        return delta
