"""Anthropic Messages over a real socket, driven by the official `anthropic` SDK (and raw SSE where the SDK
hides the wire: event order, pings)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import anthropic
import httpx
import pytest

from conveyor.config import EngineConfig, ServerConfig
from tests.server.apis.conftest import fuzzed_statuses, named_events

TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"]}}]  # a short city: the forced call fits max_tokens whatever is sampled
CHAT = [{"role": "user", "content": "Tell me about continuous batching."}]


def _client(served, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, **kwargs)


def _chat_text(served, messages: list[dict], max_tokens: int = 12, **extra) -> str:
    r = served.client().chat.completions.create(model=served.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, **extra)
    return r.choices[0].message.content


def _events(served, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE stream as (event name, data) pairs, sent with the headers and query Anthropic's SDK adds."""
    return named_events(f"{served.url}/v1/messages?beta=true", body,
                        {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"})


def test_greedy_message_equals_chat_completions(served):
    message = _client(served).messages.create(model=served.model, max_tokens=12, messages=CHAT,
                                              extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.model == served.model
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == _chat_text(served, CHAT)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 10


def test_system_blocks_and_string_are_one_prompt(served):
    client = _client(served)
    as_string = client.messages.create(model=served.model, max_tokens=6, system="You are terse.", messages=CHAT,
                                       extra_body={"temperature": 0})
    as_blocks = client.messages.create(model=served.model, max_tokens=6, messages=CHAT, extra_body={"temperature": 0},
                                       system=[{"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
                                               {"type": "text", "text": "terse."}])
    assert as_string.content[0].text == as_blocks.content[0].text == \
        _chat_text(served, [{"role": "system", "content": "You are terse."}, *CHAT], max_tokens=6)


def test_stream_event_sequence_and_sdk_stream(served):
    body = {"model": served.model, "max_tokens": 8, "messages": CHAT, "temperature": 0}
    events = _events(served, body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    assert text == _chat_text(served, CHAT, max_tokens=8)
    with _client(served).messages.stream(model=served.model, max_tokens=8, messages=CHAT,
                                         extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == text and final.stop_reason == "max_tokens"


def test_stop_sequence_is_reported(served):
    full = _chat_text(served, CHAT, max_tokens=16)
    stop = full[4:7]
    assert stop.strip(), full
    message = _client(served).messages.create(model=served.model, max_tokens=16, messages=CHAT, stop_sequences=[stop],
                                              extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[:full.index(stop)]
    events = _events(served, {"model": served.model, "max_tokens": 16, "messages": CHAT, "temperature": 0,
                              "stop_sequences": [stop]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_forced_tool_call_then_tool_result_turn(served):
    client = _client(served)
    first = client.messages.create(model=served.model, max_tokens=60, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and isinstance(calls[0].input, dict)
    assert calls[0].id.startswith("toolu_") and "city" in calls[0].input
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"},
                                         {"type": "text", "text": "Thanks. Summarize."}]}]
    second = client.messages.create(model=served.model, max_tokens=6, tools=TOOLS, messages=turn,
                                    extra_body={"temperature": 0})
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The same turn through chat/completions: the tool result is the same tool message.
    chat_turn = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps(calls[0].input)}}]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"},
                 {"role": "user", "content": "Thanks. Summarize."}]
    chat = served.client().chat.completions.create(
        model=served.model, max_tokens=6, temperature=0, messages=chat_turn,
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in TOOLS])
    text = "".join(b.text for b in second.content if b.type == "text")
    assert text == (chat.choices[0].message.content or "")


def test_streamed_tool_use_has_input_json_delta(served):
    events = _events(served, {"model": served.model, "max_tokens": 60, "tools": TOOLS, "temperature": 0,
                              "tool_choice": {"type": "any"},
                              "messages": [{"role": "user", "content": "Weather in Oslo?"}]})
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    tool = next(b for b in starts if b["type"] == "tool_use")
    assert tool["name"] == "get_weather" and tool["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert "city" in json.loads(partial)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with _client(served).messages.stream(model=served.model, max_tokens=60, tools=TOOLS, tool_choice={"type": "any"},
                                         messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                         extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert any(b.type == "tool_use" and "city" in b.input for b in final.content)


def test_count_tokens_is_the_prompt_that_runs(served):
    client = _client(served)
    counted = client.messages.count_tokens(model=served.model, messages=CHAT, system="Be brief.")
    ran = client.messages.create(model=served.model, max_tokens=1, messages=CHAT, system="Be brief.")
    assert counted.input_tokens == ran.usage.input_tokens + ran.usage.cache_read_input_tokens > 0


def test_shared_system_prompt_reads_the_prefix_cache(served):
    system = "You are a coding agent. " + " ".join(f"Rule {i}: keep tool calls small and exact." for i in range(60))
    client = _client(served)
    first = client.messages.create(model=served.model, max_tokens=2, system=system, messages=CHAT)

    async def many() -> list:
        async with anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0) as aclient:
            return list(await asyncio.gather(*(aclient.messages.create(
                model=served.model, max_tokens=2, system=system,
                messages=[{"role": "user", "content": f"Task {i}"}]) for i in range(8))))
    later = asyncio.run(many())
    assert first.usage.input_tokens > 300
    for reply in later:
        assert reply.usage.cache_read_input_tokens > 300  # the system prompt's full blocks


def test_sixteen_concurrent_greedy_equal_one_at_a_time(serve_tiny):
    with serve_tiny(EngineConfig(parallel=16, max_queue_depth=64)) as served:
        conversations = [[{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5)}] for i in range(16)]
        alone = [_chat_text(served, c, max_tokens=10) for c in conversations]

        async def together() -> list[str]:
            async with anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0) as client:
                replies = await asyncio.gather(*(client.messages.create(
                    model=served.model, max_tokens=10, messages=c, extra_body={"temperature": 0})
                    for c in conversations))
            return [r.content[0].text for r in replies]
        assert asyncio.run(together()) == alone


@pytest.mark.parametrize("body, where", [
    ({"messages": CHAT}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "does not accept images"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}]}, "source type 'file'"),
    ({"max_tokens": 4, "messages": [  # tool_result images are taken (tests/server/test_images_api.py): a text model's 400
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "look", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]}, "does not accept images"),
    ({"max_tokens": 4, "messages": CHAT, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "web_search"),
    ({"max_tokens": 4, "messages": CHAT, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "nonsense"}]}]}, "nonsense"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"max_tokens": "4", "messages": CHAT}, "max_tokens"),
    ({"max_tokens": 4, "messages": CHAT, "surprise": 1}, "surprise"),
    ({"max_tokens": 4, "messages": CHAT, "tool_choice": {"type": "tool", "name": "absent"}, "tools": TOOLS}, "absent"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                 "citations": [{"type": "char_location"}]}]}]},
     "citations"),
])
def test_bad_input_is_a_400_in_anthropic_shape(served, body, where):
    r = httpx.post(f"{served.url}/v1/messages", json={"model": served.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert where in error["error"]["message"] or where in json.dumps(error), error


def test_sdk_errors_and_unknown_model(served):
    client = _client(served)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=served.model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}])
    assert "toolu_x" in bad.value.message
    # An agent's own default model name is answered by the one model served, unless --strict-model-name.
    assert client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=CHAT).model == served.model


def test_strict_model_name_is_a_404_in_anthropic_shape(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(strict_model_name=True)) as served:
        with pytest.raises(anthropic.NotFoundError) as missing:
            _client(served).messages.create(model="no-such-model", max_tokens=4, messages=CHAT)
        assert missing.value.body["error"]["type"] == "not_found_error"


def test_fuzzed_bodies_never_5xx(served):
    rng = random.Random(7)
    base = {"model": served.model, "max_tokens": 3, "messages": CHAT, "tools": TOOLS, "system": "s",
            "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 2}}
    paths = [["max_tokens"], ["messages"], ["messages", 0], ["messages", 0, "content"], ["tools", 0],
             ["tools", 0, "input_schema"], ["tool_choice"], ["thinking"], ["system"], ["model"]]
    answers = fuzzed_statuses(f"{served.url}/v1/messages", base, paths, rng)
    assert all(body["type"] == "error" for status, body in answers if status >= 400)
    assert 400 in {status for status, _ in answers}
    assert _client(served).messages.create(model=served.model, max_tokens=2, messages=CHAT).usage.output_tokens == 2


def test_x_priority_header_is_bounded(served):
    r = httpx.post(f"{served.url}/v1/messages", json={"model": served.model, "max_tokens": 2, "messages": CHAT},
                   headers={"X-Priority": str(10**6)}, timeout=60)
    assert r.status_code == 400 and "X-Priority" in r.json()["error"]["message"], r.text


def test_x_api_key_and_metrics(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(api_key="sekret", metrics=True)) as served:
        ok = anthropic.Anthropic(base_url=served.url, api_key="sekret", max_retries=0)
        assert ok.messages.create(model=served.model, max_tokens=2, messages=CHAT).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as denied:
            anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(
                model=served.model, max_tokens=2, messages=CHAT)
        assert denied.value.body["error"]["type"] == "authentication_error"
        metrics = httpx.get(f"{served.url}/metrics").text
        assert 'conveyor_api_requests_total{api="messages"} 1.0' in metrics
        assert 'conveyor_api_requests_total{api="chat_completions"} 0.0' in metrics


def test_hosted_tools_ignored_when_the_server_says_so(serve_tiny):
    body = {"max_tokens": 4, "temperature": 0, "messages": CHAT,
            "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}]}
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(hosted_tools="ignore")) as served:
        r = httpx.post(f"{served.url}/v1/messages", json={"model": served.model, **body}, timeout=60)
        assert r.status_code == 200, r.text
        plain = httpx.post(f"{served.url}/v1/messages", json={"model": served.model, **body, "tools": TOOLS},
                           timeout=60)
        assert r.json()["content"] == plain.json()["content"]  # the same prompt: the hosted tool is not shown


def test_system_messages_in_the_conversation(served):
    """The API's system role inside `messages` (Claude Code sends one, empty, with an output_config) is a
    system turn; runs of system text merge with the top-level system, as chat's one system message."""
    client = _client(served)
    reply = client.messages.create(model=served.model, max_tokens=6, system="You are terse.", messages=[
        {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]}, *CHAT,
        {"role": "system", "content": [], "output_config": {"effort": "medium"}}], extra_body={"temperature": 0})
    assert reply.content[0].text == _chat_text(
        served, [{"role": "system", "content": "You are terse.\n\nAnswer in English."}, *CHAT], max_tokens=6)
    r = httpx.post(f"{served.url}/v1/messages", json={"model": served.model, "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "?"}]}, *CHAT]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def thinking(tiny):
    """A template that opens <think> when the last message ends in /think (the reasoning parser turns on)."""
    from tests.cluster.parity_battery import THINK_TEMPLATE
    from tests.server.conftest import serve
    checkpoint = dataclasses.replace(tiny, tokenizer=dataclasses.replace(tiny.tokenizer, chat_template=THINK_TEMPLATE))
    with serve(checkpoint, EngineConfig(parallel=4)) as served:
        yield served


THINK = [{"role": "user", "content": "Plan a trip. /think"}]


def _tokens(served, text: str) -> int:
    return len(httpx.post(f"{served.url}/tokenize", json={"content": text}).json()["tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_budget_closes_the_thinking_and_the_answer_follows(thinking, stream):
    client = _client(thinking)
    body = dict(model=thinking.model, max_tokens=24, messages=THINK, extra_body={"temperature": 0},
                thinking={"type": "enabled", "budget_tokens": 5})
    if stream:
        with client.messages.stream(**body) as s:
            reply = s.get_final_message()
    else:
        reply = client.messages.create(**body)
    kinds = [b.type for b in reply.content]
    assert kinds[0] == "thinking" and "text" in kinds, reply
    assert _tokens(thinking, reply.content[0].thinking) <= 5 + 1  # the budget (a token may re-split on decode)
    assert reply.usage.output_tokens == 24 and reply.stop_reason == "max_tokens"
    # Without a budget the same model thinks until max_tokens: the budget is what ended the thinking.
    free = client.messages.create(model=thinking.model, max_tokens=24, messages=THINK, extra_body={"temperature": 0})
    assert [b.type for b in free.content] == ["thinking"]
    assert free.content[0].thinking.startswith(reply.content[0].thinking.rstrip())


def test_thinking_budget_past_max_tokens_changes_nothing(thinking):
    client = _client(thinking)
    free = client.messages.create(model=thinking.model, max_tokens=12, messages=THINK, extra_body={"temperature": 0})
    budgeted = client.messages.create(model=thinking.model, max_tokens=12, messages=THINK,
                                      thinking={"type": "enabled", "budget_tokens": 50}, extra_body={"temperature": 0})
    assert budgeted.content == free.content and budgeted.usage == free.usage
