"""Request fields -> what the engine enforces (a GrammarSpec) and how the reply is parsed (ChatParsing).

One constraint per request: response_format (json_object / json_schema), a vLLM-style
guided_* field, or a forced tool choice (tool_choice "required" or a named function).
"""

from __future__ import annotations

from dataclasses import dataclass

from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from conveyor.loading import Tokenizer
from conveyor.server import errors
from conveyor.server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from conveyor.structured.grammar import GrammarSpec
from conveyor.structured.harmony import harmony_messages, harmony_tool_grammar, harmony_tools, template_is_harmony
from conveyor.structured.output import ChatParsing
from conveyor.structured.reasoning import prompt_opens_thinking, template_thinks
from conveyor.structured.tools import messages_for_template, template_renders_tools, tool_grammar


def grammar_from_fields(body: SamplingFields) -> tuple[GrammarSpec | None, str | None]:
    """The constraint the body asks for and the field that asked (for error messages)."""
    found: list[tuple[GrammarSpec, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((GrammarSpec.json_object(), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        found.append((GrammarSpec.json_schema(fmt.json_schema.schema_), "response_format"))  # type: ignore[union-attr]
    if body.guided_json is not None:
        schema = body.guided_json
        found.append((GrammarSpec("json_schema", schema) if isinstance(schema, str) else GrammarSpec.json_schema(schema),
                      "guided_json"))
    if body.guided_regex is not None:
        found.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_grammar is not None:
        try:
            lark = any_to_lark(body.guided_grammar)  # GBNF (`root ::= ...`) is converted, Lark passes through
        except (GbnfToLarkError, Exception) as exc:  # the converter raises bare Exceptions too
            raise errors.invalid(f"invalid grammar: {exc}", "guided_grammar") from None
        found.append((GrammarSpec("lark", lark), "guided_grammar"))
    if body.guided_choice is not None:
        found.append((GrammarSpec.choice(body.guided_choice), "guided_choice"))
    if len(found) > 1:
        raise errors.invalid("give at most one of response_format (json), guided_json, guided_regex, "
                             "guided_grammar, guided_choice", found[1][1])
    return found[0] if found else (None, None)


@dataclass
class ChatPlan:
    messages: list[dict]
    tools: list[dict] | None  # for a template that renders tools itself
    grammar: GrammarSpec | None
    grammar_param: str | None
    parsing: ChatParsing


def plan_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, reasoning_parser: str,
              image_text: str | None = None) -> ChatPlan:
    """Messages for the template, the tools prompt, the constraint and the reply parsing of one chat request.
    `image_text`: write each image part as this text in the message's string content (for a template that does
    not render image parts: the model's image marker), else as {"type": "image"}."""
    grammar, param = grammar_from_fields(body)
    messages = [_message(m, image_text) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise errors.invalid("tool_choice needs a non-empty tools list", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise errors.invalid("tool function names must be unique", "tools")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise errors.invalid(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                             "tool_choice")
    if forced and grammar is not None:
        raise errors.invalid(f"a forced tool_choice cannot be combined with {param}", param)
    offered = tools if choice != "none" else []
    if template_is_harmony(tokenizer.chat_template):  # GPT-OSS: its template renders tools, its replies have channels
        if forced:  # a call in harmony's own shape (the other templates' grammar writes <tool_call> markers)
            named = choice.function.name if isinstance(choice, NamedToolChoice) else None
            grammar, param = harmony_tool_grammar(offered, named), "tools"
        parsing = ChatParsing(frozenset(names) if offered else None, harmony=True)
        return ChatPlan(harmony_messages(messages), harmony_tools(offered) or None, grammar, param, parsing)
    native = template_renders_tools(tokenizer.chat_template)
    messages = messages_for_template(messages, offered, native)
    if forced:
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        grammar, param = tool_grammar(offered, named, body.parallel_tool_calls is not False), "tools"
    thinking = _thinking(reasoning_parser, tokenizer)
    parsing = ChatParsing(frozenset(names) if offered else None, thinking)
    return ChatPlan(messages, offered if native and offered else None, grammar, param, parsing)


def reply_starts_thinking(parsing: ChatParsing, prompt: str) -> ChatParsing:
    """The reasoning parser starts inside <think> when the rendered prompt opened one."""
    if parsing.thinking is None:
        return parsing
    return ChatParsing(parsing.tool_names, prompt_opens_thinking(prompt))


def _thinking(mode: str, tokenizer: Tokenizer) -> bool | None:
    if mode == "think" or (mode == "auto" and template_thinks(tokenizer.chat_template)):
        return False
    return None


def _message(message, image_text: str | None = None) -> dict:
    if message.image_parts() and image_text is not None:
        content = "".join(image_text if part.type == "image_url" else part.text for part in message.content)
    else:
        content = _template_content(message) if message.image_parts() else message.text()
    out: dict = {"role": message.role, "content": content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
        if not message.content:
            out["content"] = None if message.role == "assistant" else ""
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_content(message) -> list[dict]:
    """Text and image parts in place, as HF templates of vision models take them: an image is {"type": "image"}
    (the template writes the family's marker; the pixels travel beside the prompt, RequestPlan.images)."""
    return [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
            for part in message.content]
