"""Structured output and tools over HTTP with the official client, on a tiny random model: whatever
the weights, a grammar-forced reply parses; auto replies are parsed from whatever was written."""

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from conveyor.config import EngineConfig, ServerConfig

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}}},
]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=6)
    vaccinated: bool


def _chat(served, **kw) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 60, **kw},
                      timeout=60)


def test_parse_with_a_pydantic_model(served):
    completion = served.client().chat.completions.parse(model=served.model, messages=MESSAGES, temperature=0,
                                                        max_tokens=80, response_format=Pet)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)


def test_json_object_and_guided_fields_on_completions(served):
    url = f"{served.url}/v1/completions"
    r = httpx.post(url, json={"prompt": "Answer:", "max_tokens": 10, "temperature": 0, "guided_choice": ["yes", "no"]})
    assert r.json()["choices"][0]["text"] in ("yes", "no") and r.json()["choices"][0]["finish_reason"] == "stop"
    gbnf = 'root ::= "id-" [0-9] [0-9]'  # llama-server's GBNF is accepted in guided_grammar
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 10, "temperature": 0, "guided_grammar": gbnf})
    assert r.json()["choices"][0]["text"][:3] == "id-" and len(r.json()["choices"][0]["text"]) == 5
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 20, "temperature": 0, "guided_json": schema})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_logprobs_of_grammar_masked_tokens_are_finite(served):
    """A grammar masks most tokens (log 0 = -inf): reported as OpenAI does (-9999.0), never a 500 over JSON."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    chat = _chat(served, temperature=0, logprobs=True, top_logprobs=20,
                 response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert chat.status_code == 200, chat.text
    tops = [top["logprob"] for entry in chat.json()["choices"][0]["logprobs"]["content"] for top in entry["top_logprobs"]]
    assert min(tops) == -9999.0 and all(t <= 0 for t in tops)
    text = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": 0,
                                                             "logprobs": 5, "guided_choice": ["yes", "no"]})
    assert text.status_code == 200, text.text
    assert all(v >= -9999.0 for top in text.json()["choices"][0]["logprobs"]["top_logprobs"] for v in top.values())


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_always_parse(served, tool_choice):
    client = served.client()
    r = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                       parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    if isinstance(tool_choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    # The same request streamed: the official client assembles the deltas into the same call.
    with client.chat.completions.stream(model=served.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                        parallel_tool_calls=False, temperature=0, max_tokens=80) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    [streamed] = final.message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)


def test_auto_parses_what_the_model_writes(served):
    # A grammar stands in for a model that chose to call a tool after a sentence.
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    body = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0, "guided_choice": [text]}
    message = _chat(served, **body).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Checking."
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    chunks = _stream_chunks(served, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking."
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Without tools the same text is just content.
    plain = _chat(served, temperature=0, guided_choice=[text]).json()["choices"][0]
    assert plain["message"]["content"] == text and plain["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_neither_text_nor_a_half_call(served, stream):
    forced = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 8}
    # A grammar stands in for a model that wrote a sentence, then began a call (auto).
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    auto = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 10, "guided_choice": [text]}
    for body, content in ((forced, ""), (auto, "Checking.")):
        if stream:
            chunks = _stream_chunks(served, body)
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            got = "".join(d.get("content") or "" for d in deltas).strip()
            calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = _chat(served, **body).json()["choices"][0]
            got, calls, finish = choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]
        assert (finish, got, calls or []) == ("length", content, [])


def test_tool_results_in_later_turns(served):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = served.client().chat.completions.create(model=served.model, messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tool list and the earlier call are in the prompt


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "nonsense"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "forced"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
])
def test_bad_structured_requests_are_400(served, body, param, words):
    r = _chat(served, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"]


def test_reasoning_content(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(reasoning_parser="think")) as served:
        body = {"temperature": 0, "guided_regex": "<think>\n[a-z]{3}\n</think>\n\nok"}
        message = _chat(served, **body).json()["choices"][0]["message"]
        assert message["content"] == "ok" and len(message["reasoning_content"]) == 3
        deltas = [c["choices"][0]["delta"] for c in _stream_chunks(served, body) if c["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == message["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == "ok"


def _stream_chunks(served, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 60, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks
