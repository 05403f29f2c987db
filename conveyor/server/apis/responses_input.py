"""A Responses API body, and the chat request it becomes.

`input` items are checked one by one (a 400 names the item and its type: files and built-in tool
calls are refused by name), then turned into chat messages: a message item is a message, a run of
function_call items is one assistant turn's tool_calls, a function_call_output is a tool message, a
reasoning item is dropped (templates drop past thinking too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from conveyor.server import errors
from conveyor.server.apis.turns import merged_turns
from conveyor.server.limits import RequestLimits, check_request
from conveyor.server.protocol import ChatCompletionRequest

# OpenAI's function-name rule (chat's, without its dot: "namespace.name" is how a namespaced function is shown
# to the model), checked here so a 400 names tools.[i].name
_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_STATUS = Literal["in_progress", "completed", "incomplete"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- input items -----------------------------------------------------------------------------------
class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # output_text echoed back
    logprobs: list | None = None
    prompt_cache_breakpoint: dict | None = None  # the prefix cache is automatic: accepted, nothing to do


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Body):
    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)] | None = None  # a URL or a data: URL, as chat's image_url
    file_id: str | None = None  # OpenAI's Files API: refused (below), there are no files here
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted; the model's processor decides

    @model_validator(mode="after")
    def _url_given(self) -> ImagePart:
        if self.file_id is not None:
            raise ValueError("input_image file_id is not supported (no Files API here): give image_url")
        if self.image_url is None:
            raise ValueError("input_image needs an image_url (a data: URL, or a URL the server may fetch)")
        return self

    def chat_part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


Part = Annotated[TextPart | RefusalPart | ImagePart, Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[Part] | str  # (a list first: a bad part's 400 names the part)
    id: str | None = None
    status: _STATUS | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return _text(self.content)

    def chat_content(self) -> str | list[dict]:
        """Its text, or (with images) chat's parts in order: text and image_url."""
        return _chat_content(self.content)


def _text(content: list[TextPart | RefusalPart | ImagePart] | str) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content if not isinstance(p, ImagePart))


def _chat_content(content: list[TextPart | RefusalPart | ImagePart] | str) -> str | list[dict]:
    if isinstance(content, str) or not any(isinstance(p, ImagePart) for p in content):
        return _text(content)
    return [p.chat_part() if isinstance(p, ImagePart) else
            {"type": "text", "text": p.text if isinstance(p, TextPart) else p.refusal} for p in content]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None
    status: _STATUS | None = None
    namespace: str | None = None
    caller: dict | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: list[Part] | str  # a tool may return images (a screenshot): they reach the model in the tool message
    id: str | None = None
    status: _STATUS | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict | None = None

    def chat_content(self) -> str | list[dict]:
        """The tool message's content: its text, or (with images) chat's parts in order, as a message item's."""
        return _chat_content(self.output)


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = Field(default_factory=list)
    content: list[dict] | None = None
    encrypted_content: str | None = None
    status: _STATUS | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_PARTS = frozenset({"input_text", "output_text", "refusal", "input_image"})
_REFUSED_PARTS = {"input_file": "files are not supported", "input_audio": "audio is not supported"}


# -- tools and settings ----------------------------------------------------------------------------
class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


NAMESPACE_SEP = "."  # tool names allow dots; a namespaced function is "namespace.name" to the model


class NamespaceTool(_Body):
    type: Literal["namespace"]
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    tools: list[dict]


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # (BaseModel owns `schema`)
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format of type json_schema needs a name and a schema")
        return self


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, ignored


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's former name
    context: Literal["auto", "current_turn", "all_turns"] | None = None  # accepted, ignored
    mode: str | None = None  # accepted, ignored

    @property
    def wants_summary(self) -> bool:
        return (self.summary or self.generate_summary) is not None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Any] | None = None  # items are checked one by one (parse_items)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[dict], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None  # None = true, as OpenAI stores by default
    metadata: dict[str, str] | None = None  # echoed back
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extensions, as chat's fields (SGLang's gateway, SMG, adds them to every Responses body it forwards)
    priority: int | None = None  # higher runs first
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # Accepted and ignored: they change nothing about generation here.
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    stream_options: dict | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, which never run here
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    client_metadata: dict | None = None  # Codex's turn and window ids
    top_logprobs: Literal[0] | None = None
    # Refused by name when set (refused_fields): OpenAI-hosted features.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None

    @property
    def stores(self) -> bool:
        return self.store is not False


_HOSTED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
           "prompt": "stored prompt templates", "context_management": "context management (compaction)",
           "moderation": "moderation", "image": "image settings", "access_programs": "access programs",
           "background_options": "background responses"}


def refused_fields(body: ResponsesRequest) -> None:
    for name, what in _HOSTED.items():
        if getattr(body, name):
            raise errors.invalid(f"{name} is not supported by this server: {what} are an OpenAI-hosted feature", name)
    if body.truncation == "auto":
        raise errors.invalid("truncation 'auto' is not supported: a conversation longer than the context window is "
                             "a 400 (use 'disabled')", "truncation")


# -- parsing ---------------------------------------------------------------------------------------
def validated_at(model: type[BaseModel], data: Any, where: str) -> Any:
    """`model` from `data`; a 400 whose param is `where` plus the failing field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        inner = errors.from_validation(exc)
        param = ".".join(p for p in (where, inner.param) if p)
        message = exc.errors()[0].get("msg", "invalid value").removeprefix("Value error, ")
        raise errors.invalid(f"{message} (at '{param}')" if param else message, param or None) from None


def parse_items(raw: str | list[Any] | None, where: str = "input") -> list[InputItem]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items = []
    for i, data in enumerate(raw):
        param = f"{where}.[{i}]"
        if not isinstance(data, dict):
            raise errors.invalid(f"input items must be objects (at '{param}')", param)
        kind = data.get("type", "message")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise errors.invalid(_item_refusal(kind), f"{param}.type")
        _check_parts(data, param)
        items.append(validated_at(model, data, param))
    return items


def _item_refusal(kind: Any) -> str:
    if kind == "item_reference":
        return "item_reference items are not supported: send the items themselves, or previous_response_id"
    hosted = isinstance(kind, str) and (kind.endswith(("_call", "_call_output")) or kind.startswith("mcp_"))
    if hosted:
        return f"input item type {kind!r} is not supported: built-in tools do not run here (only function tools)"
    return f"unknown input item type {kind!r} (expected one of {', '.join(sorted(_ITEMS))})"


def _check_parts(data: dict, where: str) -> None:
    field = "content" if data.get("type", "message") == "message" else "output"
    parts = data.get(field)
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        param = f"{where}.{field}.[{j}].type"
        if kind in _REFUSED_PARTS:
            raise errors.invalid(f"content part type {kind!r} is not supported: {_REFUSED_PARTS[kind]}", param)
        if kind not in _PARTS:
            raise errors.invalid(f"unknown content part type {kind!r} (expected input_text, input_image, output_text or refusal)",
                                 param)


def parse_tools(raw: list[dict] | None, ignore_hosted: bool = False) -> list[FunctionTool]:
    """Function tools; a namespace's functions join them as `namespace.name` (NAMESPACE_SEP), the name the
    model sees and calls (output items split it back: responses_output.function_call_item). Hosted tools
    are a 400, or left out with --hosted-tools ignore."""
    tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            tools += _namespace_tools(tool, i, ignore_hosted)
            continue
        if kind != "function" and ignore_hosted and isinstance(kind, str):
            continue
        if kind != "function":
            raise errors.invalid(f"tool type {kind!r} is not supported: only function tools run here (built-in "
                                 "tools such as web_search, file_search, code_interpreter, computer_use, mcp and "
                                 "image_generation are OpenAI-hosted; --hosted-tools ignore leaves them out)",
                                 f"tools.[{i}].type")
        tools.append(validated_at(FunctionTool, tool, f"tools.[{i}]"))
    return tools


def _namespace_tools(tool: dict, index: int, ignore_hosted: bool) -> list[FunctionTool]:
    group = validated_at(NamespaceTool, tool, f"tools.[{index}]")
    inner = parse_tools(group.tools, ignore_hosted)
    return [t.model_copy(update={"name": qualified_name(group.name, t.name)}) for t in inner]


def qualified_name(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise errors.invalid(f"tool_choice of type {choice.get('type')!r} is not supported: give 'auto', 'none', "
                             "'required' or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    named = validated_at(FunctionChoice, choice, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


# -- items -> chat ---------------------------------------------------------------------------------
def chat_messages(items: list[InputItem], first_input: int = 0) -> list[dict]:
    """The conversation as chat messages; items[first_input:] are this request's input (named in 400s)."""
    messages: list[dict] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {"id": item.call_id, "type": "function", "function": {
                "name": qualified_name(item.namespace, item.name), "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the text and the calls of one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise errors.invalid(f"function_call_output names call_id {item.call_id!r}, which no earlier "
                                     "function_call item has", f"input.[{i - first_input}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.chat_content()})
    return messages


def to_chat(body: ResponsesRequest, items: list[InputItem], first_input: int, tools: list[FunctionTool],
            limits: RequestLimits) -> ChatCompletionRequest:
    """The same conversation as a chat/completions body: what the server plans and runs."""
    messages = chat_messages(items, first_input)
    if not messages:
        raise errors.invalid("input is empty: give a string or a list of items (or previous_response_id)", "input")
    if body.instructions:  # the request's own; earlier responses' instructions are not carried over
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages = merged_turns(messages)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    for name, field in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                        ("parallel_tool_calls", "parallel_tool_calls"), ("priority", "priority"),
                        ("top_k", "top_k"), ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty")):
        if getattr(body, name) is not None:
            chat[field] = getattr(body, name)
    if tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            chat["response_format"]["json_schema"] = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    chat.update(_reasoning(body.reasoning))
    request = validated_at(ChatCompletionRequest, chat, "input")
    check_request(request, limits)
    return request


def _reasoning(reasoning: ReasoningConfig | None) -> dict:
    """effort 'none' turns the template's thinking off (Qwen3, SmolLM3...); the others reach it as
    reasoning_effort, as chat's field does (xhigh and max as high)."""
    effort = reasoning.effort if reasoning is not None else None
    if effort is None:
        return {}
    if effort == "none":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {"reasoning_effort": "high" if effort in ("xhigh", "max") else effort}
