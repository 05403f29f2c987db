"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): a thin adapter.

The body becomes the chat request the server already plans (system + turns, tool_use / tool_result
as tool calls and tool messages, tools and tool_choice as chat's, stop_sequences, thinking as the
template's enable_thinking), so templates, grammars, limits and metrics are chat's own. The reply goes
back as Anthropic writes it: content blocks (thinking, text, tool_use), stop_reason, usage with
cache_read_input_tokens from the prefix cache, the exact SSE event sequence, and errors in its shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.config import ServerConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.server import errors
from conveyor.server.front import ServingFront
from conveyor.server.apis.body import check_header_priority, json_object, validated
from conveyor.server.apis.thinking_budget import start_with_budget
from conveyor.server.apis.turns import merged_turns
from conveyor.server.limits import RequestLimits, check_request
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.reply import CLIENT_CLOSED_REQUEST, SSEResponse, collect_choices, parsed_deltas
from conveyor.server.request_plan import RequestPlan
from conveyor.server.responses import ChoiceState
from conveyor.structured.output import ChatDelta
from conveyor.structured.tools import ToolCall

# Block and tool types Anthropic defines that this server does not serve, with the reason a 400 gives.
_REFUSED_BLOCKS = {
    "document": "document blocks (files, PDFs) are not supported",
    "search_result": "search_result blocks are not supported",
    "container_upload": "container uploads are not supported",
}
_SERVER_TOOL_PREFIXES = ("server_tool_use", "web_search", "web_fetch", "code_execution", "bash_code_execution",
                         "text_editor_code_execution", "mcp_tool", "tool_search")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _CacheControlled(_Body):
    cache_control: dict | None = None  # our prefix cache is automatic: accepted, nothing to do


class TextBlock(_CacheControlled):
    type: Literal["text"]
    text: str
    citations: list[dict] | None = None


class ToolUseBlock(_CacheControlled):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    caller: dict | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Body):
    type: Literal["url"]
    url: str


class ImageBlock(_CacheControlled):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def chat_part(self) -> dict:
        """Chat's image_url part: base64 as a data URL, so both APIs meet one decoder and one set of limits."""
        source = self.source
        url = source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolResultBlock(_CacheControlled):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False
    toolset_name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content if isinstance(b, TextBlock))

    def chat_content(self) -> str | list[dict]:
        """The tool message's content: its text, or (with images, as Anthropic passes them to the model) chat's parts
        in order, so the template renders the images in the tool message."""
        error = "Error: " if self.is_error else ""
        if isinstance(self.content, str) or not any(isinstance(b, ImageBlock) for b in self.content):
            return error + self.text()
        parts = [{"type": "text", "text": error}] if error else []
        for block in self.content:
            parts.append(block.chat_part() if isinstance(block, ImageBlock) else {"type": "text", "text": block.text})
        return parts


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})
Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # system: a system message in the conversation (text only)
    content: str | list[Block]
    output_config: dict | None = None  # Claude Code sets it on a system message; nothing here reads it


class Tool(_CacheControlled):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    strict: bool | None = None
    # Accepted and ignored: hints for Anthropic's own tool runner.
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict] | None = None
    allowed_callers: list[str] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(_Body):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    priority: int | None = None  # ours (and vLLM's; SMG forwards it): higher runs first, as chat's
    # Accepted and ignored: they change nothing about generation here.
    metadata: dict | None = None
    service_tier: str | None = None
    cache_control: dict | None = None
    context_management: dict | None = None
    diagnostics: dict | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Refused by name (below): Anthropic-hosted features.
    container: Any = None
    mcp_servers: Any = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Annotated[int, Field(ge=1)] = 1  # count_tokens takes no max_tokens


# -- errors ---------------------------------------------------------------------------------------
def _refused_fields(data: dict, ignore_hosted: bool) -> None:
    """Hosted tools, files and citations: a 400 that names them, before any other validation (server tools
    are left out instead with --hosted-tools ignore)."""
    for name in ("container", "mcp_servers"):
        if data.get(name):
            raise errors.invalid(f"{name} is not supported by this server (Anthropic-hosted feature)", name)
    if ignore_hosted and isinstance(data.get("tools"), list):
        data["tools"] = [t for t in data["tools"] if not isinstance(t, dict) or t.get("type") in (None, "custom")]
    for i, tool in enumerate(_list(data.get("tools"))):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise errors.invalid(f"server tool {kind!r} is not supported: only custom tools (name, description, "
                                 f"input_schema) run here (--hosted-tools ignore leaves them out)", f"tools.[{i}].type")
    for i, message in enumerate(_list(data.get("messages"))):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(_list(content)):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages.[{i}].content.[{j}]"
            if kind in _REFUSED_BLOCKS:
                raise errors.invalid(_REFUSED_BLOCKS[kind], where)
            if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
                raise errors.invalid(f"{kind} blocks are not supported: no server tools run here", where)
            if kind not in _BLOCK_TYPES:
                raise errors.invalid(f"unknown content block type {kind!r} (expected one of "
                                     f"{', '.join(sorted(_BLOCK_TYPES))})", f"{where}.type")
            if kind == "image":
                _check_image_source(block.get("source"), where)
            if kind == "tool_result":  # its images go to the model in the tool message (server/chat_images.py)
                for k, inner in enumerate(_list(block.get("content"))):
                    if isinstance(inner, dict) and inner.get("type") == "image":
                        _check_image_source(inner.get("source"), f"{where}.content.[{k}]")
            if isinstance(block, dict) and block.get("citations"):
                raise errors.invalid("citations are not supported", f"{where}.citations")


def _check_image_source(source: Any, where: str) -> None:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "file":
        raise errors.invalid("image source type 'file' is not supported (no Files API here): give base64 or url",
                             f"{where}.source.type")
    if kind not in ("base64", "url"):
        raise errors.invalid(f"image source type must be 'base64' or 'url', got {kind!r}", f"{where}.source.type")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []  # anything else is pydantic's 400 below


async def _parse(request: Request, model: type[MessagesRequest], limits: RequestLimits,
                 ignore_hosted: bool) -> MessagesRequest:
    data = await json_object(request, limits)
    _refused_fields(data, ignore_hosted)
    return validated(model, data)


# -- request -> chat ------------------------------------------------------------------------------
def to_chat(body: MessagesRequest, limits: RequestLimits) -> ChatCompletionRequest:
    """The same conversation as a chat/completions body: what the server plans and runs."""
    messages: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        if message.role == "assistant":
            messages.append(_assistant_turn(blocks, calls, i))
        elif message.role == "system":
            messages += _system_turn(blocks, i)
        else:
            messages.extend(_user_turn(blocks, calls, i))
    chat: dict[str, Any] = {"model": body.model, "messages": merged_turns(messages), "max_tokens": body.max_tokens,
                            "stream": body.stream}
    for name in ("temperature", "top_p", "top_k", "priority"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in body.tools]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise errors.from_validation(exc) from None
    check_request(request, limits)
    return request


def _assistant_turn(blocks: list, calls: set[str], index: int) -> dict:
    text, tool_calls = "", []
    for block in blocks:
        if isinstance(block, TextBlock):
            text += block.text
        elif isinstance(block, ToolUseBlock):
            calls.add(block.id)
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, (ToolResultBlock, ImageBlock)):
            raise errors.invalid(f"{block.type} blocks belong in a user turn", f"messages.[{index}].content")
        # thinking / redacted_thinking: earlier turns' reasoning is not replayed (templates drop it too)
    turn: dict = {"role": "assistant", "content": text}
    if tool_calls:
        turn["tool_calls"] = tool_calls
    return turn


def _system_turn(blocks: list, index: int) -> list[dict]:
    if any(not isinstance(block, TextBlock) for block in blocks):
        raise errors.invalid("a system message holds text blocks only", f"messages.[{index}].content")
    text = "".join(block.text for block in blocks)
    return [{"role": "system", "content": text}] if text else []  # an empty one says nothing


def _user_turn(blocks: list, calls: set[str], index: int) -> list[dict]:
    """Tool results become tool messages (first, as Anthropic orders them), the text and images one user message
    (its images in place, as chat's image_url parts)."""
    out, text, parts = [], "", []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise errors.invalid(f"tool_result names tool_use_id {block.tool_use_id!r}, which no earlier "
                                     f"assistant tool_use block has", f"messages.[{index}].content")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.chat_content()})
        elif isinstance(block, TextBlock):
            text += block.text
        elif isinstance(block, ImageBlock):
            parts += [{"type": "text", "text": text}] if text else []
            parts.append(block.chat_part())
            text = ""
        else:
            raise errors.invalid(f"{block.type} blocks belong in an assistant turn", f"messages.[{index}].content")
    if parts:
        out.append({"role": "user", "content": parts + ([{"type": "text", "text": text}] if text else [])})
    elif text or not out:
        out.append({"role": "user", "content": text})
    return out


def _tool_choice(choice: ToolChoice) -> dict:
    picked: dict[str, Any] = {"none": {"tool_choice": "none"}, "auto": {"tool_choice": "auto"},
                              "any": {"tool_choice": "required"}}.get(choice.type, {})
    if choice.type == "tool":
        if not choice.name:
            raise errors.invalid("tool_choice of type tool needs a name", "tool_choice.name")
        picked = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use:
        picked["parallel_tool_calls"] = False
    return picked


# -- reply ----------------------------------------------------------------------------------------
def _stop_reason(finish_reason: str | None, stop_sequence: str | None, called_tools: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called_tools:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _usage(choice: ChoiceState | RequestOutput) -> dict:
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt."""
    cached = choice.num_cached_tokens
    return {"input_tokens": choice.num_prompt_tokens - cached, "output_tokens": choice.num_output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use_block(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + (call.id.removeprefix("call_") or uuid.uuid4().hex[:24]),
            "name": call.name, "input": arguments if isinstance(arguments, dict) else {}}


def _blocks(parsed: ChatDelta) -> list[dict]:
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    blocks += [_tool_use_block(call) for call in parsed.tool_calls]
    return blocks


def _message(message_id: str, model: str, content: list[dict], stop_reason: str | None,
             stop_sequence: str | None, usage: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


async def _complete(http: Request, serving: ServingFront, plan: RequestPlan, arrival: float,
                    budget: int | None) -> Response:
    group = await start_with_budget(serving, http, plan, arrival, budget)
    choices = await collect_choices(http, group)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choice = choices[0]
    parsing = plan.header.parsing
    truncated = choice.finish_reason == "length"
    parsed = parsing.parser().parse(choice.text, truncated) if parsing is not None and parsing.enabled \
        else ChatDelta(content=choice.text)
    stop = _stop_reason(choice.finish_reason, choice.stop_sequence, bool(parsed.tool_calls))
    message = _message(f"msg_{uuid.uuid4().hex[:24]}", serving.model_id, _blocks(parsed), stop,
                       choice.stop_sequence if stop == "stop_sequence" else None, _usage(choice))
    return JSONResponse(message)


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class _BlockWriter:
    """Opens, feeds and closes content blocks in order: one open block at a time, indexed from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.pinged = False

    def _start(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        if not self.pinged:  # Anthropic's stream pings after the first block opens
            self.pinged = True
            events.append(_event("ping", {}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return events + [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, parsed: ChatDelta) -> list[str]:
        events: list[str] = []
        if parsed.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in parsed.tool_calls:  # calls are parsed whole: one block each
            block = _tool_use_block(call)
            events += self._start("tool_use", {**block, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
            events += self.close()
        return events


async def _stream(serving: ServingFront, group, plan: RequestPlan) -> AsyncIterator[str]:
    message_id, writer, called_tools = f"msg_{uuid.uuid4().hex[:24]}", _BlockWriter(), False
    started = False
    try:
        async for parsed, out in parsed_deltas(group, plan.header.parsing):
            if not started:  # after the first delta: its usage has the prefix cache's hit
                started = True
                start_usage = {**_usage(out), "output_tokens": 0}
                yield _event("message_start", {"message": _message(message_id, serving.model_id, [], None, None,
                                                                   start_usage)})
            if out.finish_reason == "error":
                error = errors.generation_failed(out.error or "generation failed")
                yield _event("error", {"error": {"type": "api_error", "message": error.message}})
                return
            for event in writer.feed(parsed):
                yield event
            called_tools = called_tools or bool(parsed.tool_calls)
            if out.finished:
                for event in writer.close():
                    yield event
                if not writer.pinged:
                    yield _event("ping", {})
                stop = _stop_reason(out.finish_reason, out.stop_sequence, called_tools)
                yield _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": out.stop_sequence
                                                         if stop == "stop_sequence" else None},
                                               "usage": _usage(out)})
                yield _event("message_stop", {})
    finally:
        group.close()


# -- routes ---------------------------------------------------------------------------------------
def add_routes(router: APIRouter, serving: ServingFront, limits: RequestLimits, config: ServerConfig) -> None:
    """`anthropic-version` / `anthropic-beta` headers and `?beta=true` are accepted (nothing here depends
    on them); every error under /v1/messages is answered in Anthropic's shape (errors.APIError.body)."""
    ignore_hosted = config.hosted_tools == "ignore"

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        arrival = time.monotonic()
        serving.metrics.api_requests.labels("messages").inc()
        body = await _parse(request, MessagesRequest, limits, ignore_hosted)
        check_header_priority(request, limits)
        plan = await serving.plan_chat(to_chat(body, limits))
        budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
        if not body.stream:
            return await _complete(request, serving, plan, arrival, budget)
        group = await start_with_budget(serving, request, plan, arrival, budget)
        return SSEResponse(_stream(serving, group, plan))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = await _parse(request, CountTokensRequest, limits, ignore_hosted)
        plan = await serving.plan_chat(to_chat(body, limits))
        return JSONResponse({"input_tokens": await serving.count_prompt_tokens(plan, request)})
