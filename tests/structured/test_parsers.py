"""Tool-call and <think> parsing, fed whole and in every chunking (streaming must equal non-streaming)."""

import json

import pytest

from conveyor.structured.output import ChatOutputParser, ChatParsing
from conveyor.structured.reasoning import ReasoningStream, prompt_opens_thinking
from conveyor.structured.tools import ToolCallStream, messages_for_template, tool_grammar

NAMES = {"get_weather", "add"}
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def _feed(parser, text: str, step: int):
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    return pieces


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_tool_calls_split_from_content_in_any_chunking(step):
    pieces = _feed(ToolCallStream(NAMES), CALLS, step)
    content = "".join(c for c, _ in pieces)
    calls = [call for _, cs in pieces for call in cs]
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    '{"name": "add", "arguments": {"a": 1}}',  # a bare call object
    '```json\n{"name": "add", "parameters": {"a": 1}}\n```',  # fenced, llama-style "parameters"
    '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}',  # arguments as a string; cut before the close
])
def test_other_call_shapes(text):
    parsed = ChatOutputParser(ChatParsing(frozenset(NAMES))).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1})]
    assert parsed.content == ""


@pytest.mark.parametrize("text", [
    'plain text with <tool_ and < b >',
    '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',  # not an offered tool: stays text
    '{"not": "a call"}',
    '<tool_call>\n{broken json\n</tool_call>',
])
def test_text_that_is_not_a_call_stays_content(text):
    for step in (1, 3, 1000):
        pieces = _feed(ToolCallStream(NAMES), text, step)
        assert "".join(c for c, _ in pieces) == text
        assert not [c for _, cs in pieces for c in cs]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_think_goes_to_reasoning(step):
    pieces = _feed(ReasoningStream(), "<think>\nLet me think.\n</think>\n\nThe answer is 4.", step)
    assert "".join(r for r, _ in pieces).strip() == "Let me think."
    assert "".join(c for _, c in pieces) == "The answer is 4."
    # The template opened <think> itself: the reply starts inside it.
    pieces = _feed(ReasoningStream(thinking=True), "hmm</think>ok", step)
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("hmm", "ok")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_reasoning_and_tools_together():
    parser = ChatOutputParser(ChatParsing(frozenset(NAMES), thinking=False))
    parsed = parser.parse("<think>need weather</think>\n" + CALLS)
    assert parsed.reasoning == "need weather" and parsed.content == "Let me check."
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "add"]


def test_messages_for_a_template_without_tools():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out = messages_for_template(messages, tools, native=False)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert messages_for_template(messages, tools, native=True) is messages


def test_tool_grammar_names_only_the_chosen_function():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("a", "b")]
    assert '"const": "b"' in tool_grammar(tools, "b", parallel=False).source
    assert '"const": "a"' not in tool_grammar(tools, "b", parallel=False).source
    both = tool_grammar(tools, None, parallel=True).source
    assert '"anyOf"' in both and '("\\n" tool_call)*' in both


def _parse_streamed(text: str, step: int, truncated: bool):
    parser = ChatOutputParser(ChatParsing(frozenset(NAMES)))
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish(truncated)]
    return "".join(p.content for p in pieces), [c for p in pieces for c in p.tool_calls]


@pytest.mark.parametrize("cut", range(len(CALLS) + 1))
def test_a_cut_call_is_never_text_nor_half_a_call(cut):
    """max_tokens may stop the reply at any character: content is only the text before the markup,
    tool_calls only whole calls, streamed or not."""
    text = CALLS[:cut]
    parsed = ChatOutputParser(ChatParsing(frozenset(NAMES))).parse(text, truncated=True)
    assert "Let me check.".startswith(parsed.content.strip())
    assert not set(parsed.content) & set("<{}>")
    whole = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    assert calls == whole[:len(calls)]
    for step in (1, 3):
        content, streamed = _parse_streamed(text, step, truncated=True)
        assert content.strip() == parsed.content.strip() and [c.name for c in streamed] == [c.name for c in parsed.tool_calls]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # forced call cut inside its arguments
    '<tool_call>\n{"name": "add", "argu',
    '<tool_call>\n',
    '<tool_c',  # the marker itself cut (held back, then dropped)
    '{"name": "add", "arguments": {"a": ',  # a bare call object cut
    '```json\n[{"name": "get_weather", "arguments": {"city": "Pa',
])
def test_cut_call_shapes_leave_nothing(text):
    for step in (1, 1000):
        assert _parse_streamed(text, step, truncated=True) == ("", [])


def test_an_unclosed_call_is_dropped_whatever_ended_it_but_plain_text_is_kept():
    # A stop string or EOS inside a call is a cut call too; only the half marker needs max_tokens to say so.
    assert _parse_streamed('Sure. <tool_call>\n{"name": "add"', 2, truncated=False) == ("Sure. ", [])
    assert _parse_streamed("a < b, so x <", 2, truncated=False)[0] == "a < b, so x <"
    assert _parse_streamed("a < b, so x <", 2, truncated=True)[0] == "a < b, so x "
    # JSON content that is not a call of an offered tool stays content even when cut.
    assert _parse_streamed('{"answer": [1, 2', 1000, truncated=True)[0] == '{"answer": [1, 2'
    assert _parse_streamed('{"name": "unknown", "x', 1000, truncated=True)[0] == '{"name": "unknown", "x'
