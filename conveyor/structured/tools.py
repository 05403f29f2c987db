"""Tool calling: the prompt that offers tools, the grammar that forces a call, the parser that finds calls.

Calls are written in the Hermes / Qwen format, one JSON object per call between markers:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that render `tools` themselves (Qwen2.5/3, Hermes, Llama 3.1 ...) get the tools
passed in; for the others (SmolLM2) a system instruction describing them is injected.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from conveyor.structured.grammar import JSON_OPTIONS, GrammarSpec

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_SYSTEM_PROMPT = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    @classmethod
    def make(cls, name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def tool_system_prompt(tools: list[dict]) -> str:
    return _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def messages_for_template(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """Messages ready for a template that does not know tools (`native` False): the tools become a
    system instruction, earlier calls and their results become text in the same format."""
    if native:
        return messages
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in message["tool_calls"])
            out.append({**_plain(message), "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(_plain(message))
    if tools:
        instruction = tool_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instruction}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out


def _plain(message: dict) -> dict:
    return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # a client stored broken arguments: echo them as they were
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def tool_grammar(tools: list[dict], name: str | None, parallel: bool) -> GrammarSpec:
    """A Lark grammar (llguidance dialect) admitting only calls of `tools` (or of the one named)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    schemas = [_call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # (read at the top level only)
    # A newline may follow the last call too: models end a line before they end the turn, and a forced
    # newline-then-call would make them call again (and again) instead of stopping.
    repeat = ' ("\\n" tool_call)*' if parallel else ""
    lark = (f'start: tool_call{repeat} "\\n"?\n'
            f'tool_call: "{TOOL_CALL_OPEN}\\n" %json {json.dumps(schema, ensure_ascii=False)} "\\n{TOOL_CALL_CLOSE}"\n')
    return GrammarSpec("lark", lark)


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments_schema(function)},
            "required": ["name", "arguments"], "additionalProperties": False}


def arguments_schema(function: dict) -> dict:
    """The JSON schema a forced call's arguments are written under."""
    parameters = dict(function.get("parameters") or {"type": "object"})
    # NOTE: a forced call writes only the declared arguments (as OpenAI's strict mode does) unless the
    # schema asks for more: JSON schema's default would let a model invent keys until max_tokens.
    if "properties" in parameters:
        parameters.setdefault("additionalProperties", False)
    return parameters


# -- parsing ---------------------------------------------------------------------------------
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _parse_call(text: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall.make(obj["name"], arguments)


def _parse_bare(text: str, names: set[str]) -> list[ToolCall]:
    """A reply that is nothing but a call object (or a list of them), maybe in a ```json fence."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    body = fenced.group(1) if fenced else stripped
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_parse_call(json.dumps(item), names) for item in items]
    return calls if calls and all(c is not None for c in calls) else []  # type: ignore[return-value]


class ToolCallStream:
    """Splits generated text into content and tool calls, incrementally (a call is released whole).

    Text that might be the start of a marker is held back until it is decided; a reply that
    opens with `{` or a code fence is held to the end, since it may be a bare call object.
    """

    def __init__(self, tool_names: set[str]) -> None:
        self.names = tool_names
        self._buffer = ""
        self._inside = False
        self._held_whitespace = ""
        self._started = False  # any non-whitespace content seen
        self._bare = False  # holding the whole reply: it may be a bare JSON call
        self.num_calls = 0
        self.cut_call = False  # the reply ended inside a call, which was dropped

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                call = _parse_call(self._buffer[:end].strip(), self.names)
                if call is None:  # not a valid call: it stays text
                    content += TOOL_CALL_OPEN + self._buffer[:end + len(TOOL_CALL_CLOSE)]
                else:
                    calls.append(call)
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                continue
            if not self._started and not self._bare and self._buffer.strip():
                self._bare = self._buffer.lstrip()[:1] in ("{", "[", "`")
            if self._bare:
                break
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
            content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return self._release(content, calls)

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest of the reply. A call cut short (by max_tokens, a stop string, or an end before its
        close marker) is dropped: never returned as text, never as half a call. `truncated` (max_tokens
        cut the reply) also drops a held-back partial open marker such as `<tool_c`."""
        content, calls = "", []
        if self._bare:
            calls = _parse_bare(self._buffer, self.names)
            self.cut_call = not calls and _opens_call(self._buffer, self.names)
            if not calls and not self.cut_call:
                content = self._buffer
        elif self._inside:  # ended inside a call: keep it only if what came is a whole call
            call = _parse_call(self._buffer.strip(), self.names)
            calls, self.cut_call = ([call], False) if call is not None else ([], True)
        elif truncated and _partial_suffix(self._buffer, TOOL_CALL_OPEN):
            self.cut_call = True
        else:
            content = self._buffer
        self._buffer = ""
        content, calls = self._release(content, calls)
        return content, calls

    def _release(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        """Whitespace before the reply and around calls is not content: hold it until real text follows."""
        self.num_calls += len(calls)
        if not self._started:
            content = content.lstrip()
        if not content.strip():
            self._held_whitespace += content
            return "", calls
        out, self._held_whitespace, self._started = self._held_whitespace + content, "", True
        return out, calls


# The head of a bare call object to an offered tool: `{"name": "get_weather"` (maybe fenced, or in a list).
_BARE_CALL_HEAD = re.compile(r'^\s*(?:```(?:json)?\s*)?(?:\[\s*)?\{\s*"name"\s*:\s*"([^"\\]*)"')


def _opens_call(text: str, names: set[str]) -> bool:
    """A held bare reply that is the start of a call object (cut before it parsed), not JSON content."""
    head = _BARE_CALL_HEAD.match(text)
    return head is not None and head.group(1) in names


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
