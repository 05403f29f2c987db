"""OpenAI Responses over a real socket, driven by the official `openai` SDK (and raw SSE where the SDK hides
the wire: event names, order, sequence numbers). Every reply is also checked against the SDK's own types."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from conveyor.config import EngineConfig, ServerConfig
from conveyor.server.apis.response_store import ResponseStore
from conveyor.testing import tiny_checkpoint
from tests.cluster.parity_battery import THINK_TEMPLATE
from tests.server.apis.conftest import fuzzed_statuses, named_events
from tests.server.conftest import serve

ASK = "Tell me about continuous batching."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"], "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
          "maximum": 30}}, "required": ["kind", "age"], "additionalProperties": False}
EVENTS = TypeAdapter(ResponseStreamEvent)


class Pet(BaseModel):
    kind: str = Field(pattern="^(cat|dog)$")
    age: int = Field(ge=0, le=30)


def _chat(served, messages: list[dict], max_tokens: int = 12, **extra):
    r = served.client().chat.completions.create(model=served.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, **extra)
    return r.choices[0].message


def _post(served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/responses", json={"model": served.model, **body}, timeout=60)


def _events(served, body: dict) -> list[dict]:
    """The raw SSE stream's events; each data's type is its event name, sequence numbers count from 0."""
    events = [data for _, data in named_events(f"{served.url}/v1/responses", {"model": served.model, **body})]
    for i, data in enumerate(events):
        assert data["sequence_number"] == i
        EVENTS.validate_python(data)
    return events


def _names(events: list[dict]) -> list[str]:
    """Event types, runs of deltas collapsed to one name (their number depends on the tokens)."""
    names: list[str] = []
    for e in events:
        if not (e["type"].endswith(".delta") and names and names[-1] == e["type"]):
            names.append(e["type"])
    return names


def test_greedy_response_equals_chat_completions(served):
    client = served.client()
    r = client.responses.create(model=served.model, input=ASK, max_output_tokens=12, temperature=0,
                                metadata={"run": "7"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == served.model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and message.content[0].annotations == []
    assert r.output_text == _chat(served, [{"role": "user", "content": ASK}]).content
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"run": "7"} and r.store is True and r.parallel_tool_calls is True
    assert r.tool_choice == "auto" and r.tools == [] and r.text.format.type == "text"
    # instructions are a system message first; message items with parts are the same messages
    raw = _post(served, {"instructions": "Be terse.", "max_output_tokens": 6, "temperature": 0, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about "},
                                                         {"type": "input_text", "text": "continuous batching."}]}]})
    assert raw.status_code == 200, raw.text
    parsed = Response.model_validate(raw.json())
    assert parsed.output_text == _chat(served, [{"role": "system", "content": "Be terse."},
                                                {"role": "user", "content": ASK}], max_tokens=6).content


def test_stream_event_sequence_and_sdk_streams(served):
    body = {"input": ASK, "max_output_tokens": 8, "temperature": 0}
    events = _events(served, body)
    assert _names(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done", "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == _chat(served, [{"role": "user", "content": ASK}], max_tokens=8).content
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 8
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    stream = served.client().responses.create(model=served.model, stream=True, **body)
    sdk_events = list(stream)
    assert [e.type for e in sdk_events] == [e["type"] for e in events]
    assert sdk_events[-1].response.output_text == text


def test_forced_function_call_then_tool_output_turn(served):
    client = served.client()
    ask = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=served.model, input=[ask], tools=TOOLS, temperature=0, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    # The streamed twin: the exact events, and the SDK's helper assembles the same call.
    events = _events(served, {"input": [ask], "tools": TOOLS, "tool_choice": "required", "temperature": 0,
                              "max_output_tokens": 60})
    assert _names(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.function_call_arguments.delta", "response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
    with client.responses.stream(model=served.model, input=[ask], tools=TOOLS, tool_choice="required",
                                 temperature=0, max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    [twin] = streamed.output
    assert (twin.name, twin.arguments) == (call.name, call.arguments)
    # The tool result continues the conversation, as chat's tool message does.
    turn = [ask, *first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
            {"role": "user", "content": "Thanks. Summarize."}]
    second = client.responses.create(model=served.model, input=turn, tools=TOOLS, temperature=0, max_output_tokens=6)
    chat = _chat(served, [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        {"role": "user", "content": "Thanks. Summarize."}], max_tokens=6, tools=CHAT_TOOLS)
    assert second.output_text == (chat.content or "")
    # The same turn continuing the stored first response: its function_call is the earlier item the output answers.
    third = client.responses.create(model=served.model, previous_response_id=first.id, input=turn[2:], tools=TOOLS,
                                    temperature=0, max_output_tokens=6)
    assert third.output_text == second.output_text


def test_json_schema_and_json_object_formats(served):
    client = served.client()
    r = client.responses.create(model=served.model, input="A pet, as JSON.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA,
                                                 "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    parsed = client.responses.parse(model=served.model, input="A pet.", temperature=0, max_output_tokens=60,
                                    text_format=Pet)
    assert isinstance(parsed.output_parsed, Pet)
    obj = client.responses.create(model=served.model, input="JSON please.", temperature=0, max_output_tokens=20,
                                  text={"format": {"type": "json_object"}})
    # any object is allowed, so a random model's may outrun max_output_tokens; it is one all the same
    assert obj.output_text.startswith("{") and obj.text.format.type == "json_object"
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_store_previous_response_get_and_delete(served):
    client = served.client()
    first = client.responses.create(model=served.model, input="My name is Ada.", max_output_tokens=5, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(model=served.model, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.output_text == _chat(served, history, max_tokens=5).content
    deleted = httpx.delete(f"{served.url}/v1/responses/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    for miss in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            miss()
        assert missing.value.body["code"] == "not_found" and first.id in missing.value.body["message"]
    r = _post(served, {"previous_response_id": first.id, "input": "Again?"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    # the second holds the whole conversation: it continues after the first is gone
    third = client.responses.create(model=served.model, previous_response_id=second.id, input="And again?",
                                    max_output_tokens=3, temperature=0)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And again?"}]
    assert third.output_text == _chat(served, history, max_tokens=3).content
    unstored = client.responses.create(model=served.model, input="x", max_output_tokens=2, store=False)
    assert unstored.store is False
    assert httpx.get(f"{served.url}/v1/responses/{unstored.id}").status_code == 404


def test_store_bounds_by_bytes_too():
    store = ResponseStore(max_entries=10, max_bytes=400)
    for i in range(3):
        assert store.put({"id": f"r{i}", "output": ["x" * 100]}, [{"text": "y" * 40}])
    assert store.get("r0") is None and store.get("r1") and store.get("r2")  # ~170 bytes each: two fit
    assert store.num_bytes == sum(store.get(i).num_bytes for i in ("r1", "r2")) <= 400
    assert not store.put({"id": "big", "output": ["x" * 500]}, []) and store.get("big") is None and len(store) == 2
    assert store.delete("r1") and not store.delete("r1") and store.num_bytes == store.get("r2").num_bytes


@pytest.fixture(scope="module")
def thinking_server():
    """16 slots, a store of 3, and a template that opens <think> when the last message ends in /think."""
    checkpoint = tiny_checkpoint()
    checkpoint = dataclasses.replace(checkpoint, tokenizer=dataclasses.replace(checkpoint.tokenizer,
                                                                               chat_template=THINK_TEMPLATE))
    with serve(checkpoint, EngineConfig(parallel=16, max_queue_depth=64),
               ServerConfig(metrics=True, responses_store_max=3)) as served:
        yield served


def test_store_drops_the_oldest(thinking_server):
    client = thinking_server.client()
    ids = [client.responses.create(model=thinking_server.model, input=f"n{i}", max_output_tokens=1).id
           for i in range(4)]
    statuses = [httpx.get(f"{thinking_server.url}/v1/responses/{i}").status_code for i in ids]
    assert statuses == [404, 200, 200, 200]


def test_sixteen_concurrent_greedy_equal_one_at_a_time(thinking_server):
    served = thinking_server
    conversations = [[{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5)}] for i in range(16)]
    alone = [_chat(served, c, max_tokens=10).content for c in conversations]

    async def together() -> list[str]:
        async with served.async_client() as client:
            replies = await asyncio.gather(*(client.responses.create(
                model=served.model, input=c, max_output_tokens=10, temperature=0, store=False)
                for c in conversations))
        return [r.output_text for r in replies]
    assert asyncio.run(together()) == alone


def test_thinking_is_a_reasoning_item(thinking_server):
    served = thinking_server
    ask = [{"role": "user", "content": "Plan a trip. /think"}]
    r = served.client().responses.create(model=served.model, input=ask, max_output_tokens=10, temperature=0,
                                         reasoning={"effort": "low", "summary": "auto"})
    reasoning, message = r.output
    chat = _chat(served, ask, max_tokens=10, reasoning_effort="low")
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.reasoning_content
    assert reasoning.summary[0].text == chat.reasoning_content and r.reasoning.effort == "low"
    assert message.type == "message" and r.output_text == (chat.content or "")
    events = _events(served, {"input": ask, "max_output_tokens": 10, "temperature": 0,
                              "reasoning": {"summary": "auto"}})
    assert _names(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed.strip() == chat.reasoning_content


def test_engine_failure_is_a_500_or_an_error_event_then_failed(thinking_server, monkeypatch):
    served = thinking_server
    runner, fail = served.core.runner, threading.Event()
    real_execute = runner.execute

    def execute(plan):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected fault")
        return real_execute(plan)
    monkeypatch.setattr(runner, "execute", execute)
    fail.set()
    r = _post(served, {"input": ASK, "max_output_tokens": 4})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    events = []
    with httpx.stream("POST", f"{served.url}/v1/responses", timeout=60, json={
            "model": served.model, "input": ASK, "max_output_tokens": 400, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if events[-1]["type"] == "response.output_text.delta":
                    fail.set()
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]
    assert failed["output"] == [] and EVENTS.validate_python(events[-1])  # the open message never finished


@pytest.mark.parametrize("body, where", [
    ({"input": 5}, "input"),
    ({"input": [5]}, "input.[0]"),
    ({"input": ASK, "max_output_tokens": "10"}, "max_output_tokens"),
    ({"input": ASK, "temperature": "hot"}, "temperature"),
    ({"input": ASK, "surprise": 1}, "surprise"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "does not accept images"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "file_id"),
    ({"input": [{"role": "user", "content": [{"type": "nonsense"}]}]}, "nonsense"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "web_search_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"type": "mystery"}]}, "mystery"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "call_nope"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "arguments"),
    ({"input": ASK, "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": ASK, "tools": [{"type": "mcp", "server_label": "x"}]}, "mcp"),
    ({"input": ASK, "tools": [{"type": "function", "parameters": {}}]}, "tools.[0].name"),
    ({"input": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "name": "absent"}}, "absent"),
    ({"input": ASK, "tool_choice": {"type": "file_search"}}, "file_search"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": ASK, "truncation": "auto"}, "truncation"),
    ({"input": ASK, "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": "x" * 1_000_001}, "--max-prompt-chars"),
])
def test_bad_input_is_a_400_in_openai_shape(served, body, where):
    r = _post(served, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert where in error["message"] or where in (error["param"] or ""), error


def test_sdk_errors(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=served.model, input=[
            {"type": "function_call_output", "call_id": "call_x", "output": "?"}])
    assert bad.value.body["param"] == "input.[0].call_id" and "call_x" in bad.value.message
    # Any model name is answered by the one model served (--strict-model-name makes it a 404, as chat's).
    assert client.responses.create(model="gpt-5", input="x", max_output_tokens=2).model == served.model


def test_fuzzed_bodies_never_5xx(served):
    rng = random.Random(11)
    base = {"model": served.model, "max_output_tokens": 3, "tools": TOOLS, "instructions": "s",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
            "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"}, "tool_choice": "auto"}
    paths = [["max_output_tokens"], ["input"], ["input", 0], ["input", 0, "content"], ["input", 0, "content", 0],
             ["input", 1], ["input", 1, "arguments"], ["input", 2, "output"], ["tools", 0], ["tools", 0, "parameters"],
             ["text"], ["text", "format"], ["reasoning"], ["tool_choice"], ["instructions"], ["model"]]
    answers = fuzzed_statuses(f"{served.url}/v1/responses", base, paths, rng)
    assert all(set(body["error"]) == {"message", "type", "param", "code"} for status, body in answers if status >= 400)
    assert {400, 200} <= {status for status, _ in answers}


def test_requests_are_counted(served):
    def count() -> float:
        for line in httpx.get(f"{served.url}/metrics").text.splitlines():
            if line.startswith('conveyor_api_requests_total{api="responses"}'):
                return float(line.split()[-1])
        raise AssertionError("no responses counter")
    before = count()
    served.client().responses.create(model=served.model, input="x", max_output_tokens=1, store=False)
    assert count() == before + 1


def test_namespace_tools_are_called_by_namespace(served):
    """A namespace's functions (as Codex sends its sub-agent tools) are offered as "namespace.name" and a
    call comes back as its name with its namespace; sent back, it is the same turn."""
    group = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": TOOLS}
    client = served.client()
    first = client.responses.create(model=served.model, input=ASK, tools=[group], temperature=0,
                                    max_output_tokens=60, tool_choice="required")
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    reply = client.responses.create(model=served.model, tools=[group], temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": ASK}, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    chat = _chat(served, [{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "weather.get_weather",
                                                              "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}], max_tokens=6,
        tools=[{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "name": "weather.get_weather"}}])
    assert reply.output_text == (chat.content or "")


def test_hosted_tools_ignored_when_the_server_says_so():
    """Codex offers web_search on every request: refused by default (a 400 naming it), left out of the prompt
    with --hosted-tools ignore."""
    body = {"input": ASK, "temperature": 0, "max_output_tokens": 4, "store": False}
    with serve(tiny_checkpoint(), EngineConfig(parallel=2), ServerConfig(hosted_tools="ignore")) as served:
        hosted = [*TOOLS, {"type": "web_search", "external_web_access": False}]
        r = httpx.post(f"{served.url}/v1/responses", json={**body, "tools": hosted}, timeout=60)
        assert r.status_code == 200, r.text
        plain = httpx.post(f"{served.url}/v1/responses", json={**body, "tools": TOOLS}, timeout=60).json()
        assert r.json()["output"] == [{**item, "id": r.json()["output"][0]["id"]} for item in plain["output"]]
