"""GPT-OSS's harmony format: literal replies split into reasoning_content / content / tool_calls, fed whole and in
every chunking (streaming must equal non-streaming); the checkpoint's template (tests/data, the gpt-oss-120b
template as llama.cpp ships it) renders through our chat-template path; the server plan picks it by template."""

import json
from pathlib import Path

import pytest

from conveyor.loading.chat_template import render_chat
from conveyor.structured.harmony import HarmonyStream, harmony_messages, template_is_harmony
from conveyor.structured.output import ChatOutputParser, ChatParsing

TEMPLATE = (Path(__file__).parent.parent / "data" / "gpt_oss_chat_template.jinja").read_text()
NAMES = frozenset({"get_weather", "add"})
# what the model writes after the generation prompt `<|start|>assistant` (stop tokens <|return|> / <|call|> are
# not part of the detokenized text; <|end|> and the headers are)
ANSWER = ("<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')
CALL_RECIPIENT_FIRST = ('<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant to=functions.add'
                        '<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>'
                        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                        '{"city": "Oslo"}<|call|>')


def _chunked(text: str, step: int, parsing: ChatParsing):
    parser = ChatOutputParser(parsing)
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [c for d in deltas for c in d.tool_calls])


@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_analysis_to_reasoning_final_to_content(step):
    reasoning, content, calls = _chunked(ANSWER, step, ChatParsing(harmony=True))
    assert (reasoning, content, calls) == ("The user greets. Reply briefly.", "Hello! How can I help?", [])
    whole = ChatOutputParser(ChatParsing(harmony=True)).parse(ANSWER)
    assert (whole.reasoning, whole.content) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 4, 10_000])
@pytest.mark.parametrize("text,want", [
    (CALL, [("get_weather", {"city": "Paris"})]),
    (CALL_RECIPIENT_FIRST, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
])
def test_commentary_to_functions_is_a_tool_call(step, text, want):
    reasoning, content, calls = _chunked(text, step, ChatParsing(NAMES, harmony=True))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert content == "" and reasoning in ("Need the weather tool.", "Two calls.")
    assert all(c.id.startswith("call_") for c in calls)


def test_a_call_is_released_whole_when_its_body_ends():
    stream = HarmonyStream(set(NAMES))
    head, body = CALL.split("<|message|>{")
    assert stream.feed(head + "<|message|>{")[2] == []
    assert stream.feed('"city": "Pa')[2] == []
    assert stream.feed('ris"}<|call|>')[2][0].name == "get_weather"


def test_streamed_text_never_shows_a_partial_marker():
    stream = HarmonyStream()
    assert stream.feed("<|channel|>final<|message|>Hi there<|") == ("", "Hi there", [])
    assert stream.feed("end|>") == ("", "", [])
    assert stream.finish() == ("", "", [])


def test_preambles_and_unknown_recipients():
    text = ("<|channel|>commentary<|message|>Checking the weather now.<|end|>"  # a preamble the user sees
            '<|start|>assistant to=functions.unknown<|channel|>commentary json<|message|>{"x": 1}<|call|>'
            '<|start|>assistant to=browser.search<|channel|>analysis<|message|>{"query": "q"}<|end|>')
    parsed = ChatOutputParser(ChatParsing(NAMES, harmony=True)).parse(text)
    assert parsed.content == "Checking the weather now." and parsed.tool_calls == []
    assert '{"x": 1}' in parsed.reasoning and '"query"' in parsed.reasoning  # not offered: the model's own business


def test_cut_replies():
    cut = ChatOutputParser(ChatParsing(NAMES, harmony=True))
    parsed = cut.parse(CALL[:-4], truncated=True)  # max_tokens inside the call's JSON: no half call, no text
    assert parsed.tool_calls == [] and parsed.content == "" and cut.cut_tool_call
    parsed = ChatOutputParser(ChatParsing(harmony=True)).parse(ANSWER[:40], truncated=True)  # inside the analysis
    assert (parsed.reasoning, parsed.content) == ("The user g", "")
    # a reply that ignored the format is plain content
    assert ChatOutputParser(ChatParsing(harmony=True)).parse("Just text.").content == "Just text."


def test_template_renders_through_our_jinja_path():
    assert template_is_harmony(TEMPLATE) and not template_is_harmony("{{ messages }}<tool_call>")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = harmony_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    text = render_chat(TEMPLATE, messages, add_generation_prompt=True, tools=tools)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "type get_weather = (_: {\ncity?: string,\n}) => any;" in text
    # the call as harmony writes it, its arguments as an object (not JSON text quoted again)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' in text


def test_chat_plan_picks_harmony_by_template():
    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.request_plan import plan_chat_request

    class _Tokenizer:  # what plan_chat_request reads
        chat_template = TEMPLATE

        def apply_chat_template(self, messages, add_generation_prompt, tools):
            return render_chat(TEMPLATE, messages, add_generation_prompt=add_generation_prompt, tools=tools)

        def encode(self, text, add_special_tokens=True):
            return [1, 2, 3]

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                 tools=[{"type": "function", "function": {"name": "add"}}])
    plan = plan_chat_request(body, _Tokenizer(), "auto", "m")
    assert plan.header.parsing == ChatParsing(frozenset({"add"}), harmony=True) and plan.header.parses
    assert plan.sampling(0, 16).skip_special_tokens is False  # the markers reach the parser


def test_a_harmony_reply_ends_at_return_or_call_never_at_end():
    """<|end|> closes the analysis message inside a reply: stopping there would cut every answer after its reasoning."""
    import tokenizers

    from conveyor.loading.tokenizer import build_tokenizer

    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "a"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    harmony = build_tokenizer(backend, {"eos_token": "<|end|>"}, TEMPLATE, extra_eos_ids=[0])
    assert sorted(harmony.eos_token_ids) == [0, 3, 4]  # <|endoftext|>, <|return|>, <|call|>
    phi3 = build_tokenizer(backend, {}, "{{ '<|end|>' }}")  # elsewhere <|end|> still ends a turn (Phi-3)
    assert phi3.eos_token_ids == [2]


@pytest.mark.parametrize("step", [1, 2, 10_000])
def test_whitespace_around_bodies_is_the_same_streamed_or_whole(step):
    text = "<|channel|>analysis<|message|>\n think \n<|end|><|start|>assistant<|channel|>final<|message|> Hi \n"
    reasoning, content, _ = _chunked(text, step, ChatParsing(harmony=True))
    assert (reasoning, content) == ("think \n", "Hi \n")
