"""GPT-OSS's harmony format, output side: a reply is a run of messages, each a header then a body,

    <|channel|>analysis<|message|>...<|end|>                                  -> reasoning_content
    <|start|>assistant<|channel|>final<|message|>...<|return|>                 -> content
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{json}<|call|>   -> tool_calls
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>         (either order)

The special tokens must reach the parser: harmony requests decode with skip_special_tokens off
(server/request_plan.py). The input side is the checkpoint's own Jinja template (loading/chat_template.py);
`harmony_messages` only hands it tool-call arguments as objects, which is what it expects. A forced
tool_choice is a grammar over harmony's own call message (`harmony_tool_grammar`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from conveyor.structured.grammar import JSON_OPTIONS, GrammarSpec
from conveyor.structured.tools import ToolCall, _partial_suffix, arguments_schema

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def harmony_tool_grammar(tools: list[dict], name: str | None) -> GrammarSpec:
    """tool_choice required or named, in harmony's own shape: the reply is one commentary message to
    functions.NAME (an offered tool, or the one named) with JSON arguments of its schema. The grammar's end
    ends the reply, as <|call|> would; no analysis message comes first (as a forced call elsewhere has no
    thinking either)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = []
    for i, function in enumerate(functions):
        header = f"{CHANNEL}commentary to=functions.{function['name']} <|constrain|>json{MESSAGE}"
        schema = {**arguments_schema(function), "x-guidance": JSON_OPTIONS}
        rules.append(f"call_{i}: {json.dumps(header)} %json {json.dumps(schema, ensure_ascii=False)}")
    start = "start: " + " | ".join(f"call_{i}" for i in range(len(rules)))
    return GrammarSpec("lark", "\n".join([start, *rules]) + "\n")


def template_is_harmony(chat_template: str | None) -> bool:
    return bool(chat_template) and CHANNEL in chat_template and "<|call|>" in chat_template  # type: ignore[operator]


def harmony_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages for the harmony template: assistant tool-call arguments (JSON text on the wire) as objects,
    since the template writes them with `tojson` (text would be quoted twice)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_decoded(call) for call in calls]}
        out.append(message)
    return out


def harmony_tools(tools: list[dict]) -> list[dict]:
    """Tools for the harmony template, which writes every function's description unconditionally."""
    return [{**tool, "function": {"description": "", **tool["function"]}} for tool in tools]


def _decoded(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # broken arguments from the client: passed on as they were
    # the template reads `tool_call.function` when present, else the call itself
    return {**call, "function": function, "name": function.get("name", ""), "arguments": function.get("arguments")}


@dataclass
class _Header:
    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> _Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else None)

    def tool_name(self, names: set[str] | None) -> str | None:
        """`functions.NAME` of an offered tool."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        name = self.recipient.removeprefix("functions.")
        return name if names is None or name in names else None


class HarmonyStream:
    """Incremental split of a harmony reply into (reasoning, content, tool calls).

    analysis -> reasoning; final, and commentary without a recipient (preambles the user sees) -> content;
    a message to `functions.NAME` of an offered tool -> one call, released whole when its body ends. A message to
    any other recipient (a built-in tool, a tool not offered) is the model's own business: reasoning. Text that
    might be the start of a marker is held back until it is decided.
    """

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.names = tool_names
        self._buffer = ""
        self._header: _Header | None = None  # None: reading a header
        self._fresh = True  # strip whitespace that opens a body
        self._seen_header = False
        self.num_calls = 0
        self.cut_call = False

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        self._buffer += text
        reasoning, content, calls = "", "", []
        while True:
            if self._header is None:
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    break
                self._header, self._fresh, self._seen_header = _Header.parse(self._buffer[:at]), True, True
                self._buffer = self._buffer[at + len(MESSAGE):]
                continue
            end, marker = _first_end(self._buffer)
            if end < 0 and self._is_call():
                break  # a call is released whole
            cut = end if end >= 0 else len(self._buffer) - max(_partial_suffix(self._buffer, m) for m in MARKERS)
            r, c, call = self._body(self._buffer[:cut])
            reasoning, content = reasoning + r, content + c
            calls += call
            if end < 0:
                self._buffer = self._buffer[cut:]
                break
            self._buffer, self._header = self._buffer[end + len(marker):], None
        self.num_calls += len(calls)
        return reasoning, content, calls

    def finish(self, truncated: bool = False) -> tuple[str, str, list[ToolCall]]:
        """The rest: an open body ends here (a call only if its JSON is whole, however the reply was cut, so
        `truncated` changes nothing); text without any harmony header (a reply that ignored the format) is content."""
        rest, self._buffer = self._buffer, ""
        if self._header is not None:
            reasoning, content, calls = self._body(rest)
            self.num_calls += len(calls)
            return reasoning, content, calls
        if not self._seen_header and not any(m in rest for m in MARKERS):
            return "", rest.strip(), []
        return "", "", []  # a header cut short: nothing of its message came

    def _is_call(self) -> bool:
        return self._header is not None and self._header.recipient is not None

    def _body(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """A body piece (a call: the whole body) by channel and recipient."""
        header = self._header
        assert header is not None
        if header.recipient is not None:
            name = header.tool_name(self.names)
            if name is None:
                return text, "", []
            call = _call(name, text)
            self.cut_call |= call is None
            return "", "", [call] if call is not None else []
        if self._fresh:  # (no rstrip at the end: a streamed piece is out already, and both ways must agree)
            text = text.lstrip()
            self._fresh = not text
        return (text, "", []) if header.channel == "analysis" else ("", text, [])


def _first_end(text: str) -> tuple[int, str]:
    found = [(at, marker) for marker in ENDS if (at := text.find(marker)) >= 0]
    # NOTE: a new header without an end marker also closes the body (a reply cut and resumed)
    start = text.find(START)
    if start >= 0:
        found.append((start, ""))
    return min(found) if found else (-1, "")


def _call(name: str, body: str) -> ToolCall | None:
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return ToolCall.make(name, arguments) if isinstance(arguments, dict) else None
