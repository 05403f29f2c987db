"""The parity battery (issue #19): the same requests to a single node and through the router, whole
responses compared except ids and timestamps.

Every request sets cache_prompt false: a prefix-cache hit count (usage.prompt_tokens_details.cached_tokens)
describes the history of the node that served it, not the request, so both sides report 0.
"""

from __future__ import annotations

import json
import re

import httpx

# A chat template that thinks: the SmolLM2 template, plus an opened <think> after the generation
# prompt when the last message ends in "/think" (as Qwen3's soft switch does). Its "<think>" turns
# the reasoning parser on (--reasoning-parser auto) for every chat request, on the node and the router.
THINK_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if messages[-1]['content'] and messages[-1]['content'].endswith('/think') %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}}},
]
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["kind", "n", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
# A grammar stands in for a model that calls a tool after a sentence (tool_choice auto).
CALL_AFTER_TEXT = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                   '\n</tool_call>')


def _chat(messages: list[dict], **body) -> tuple[str, dict]:
    return CHAT, {"messages": messages, "max_tokens": 12, "temperature": 0, **body}


def battery() -> dict[str, tuple[str, dict]]:
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    items = {
        "plain": _chat(ASK),
        "plain-streamed": _chat(ASK, **usage),
        "stop-strings": _chat(ASK, stop=[" a", "e"], max_tokens=30),
        "n2-seeded": _chat(ASK, n=2, temperature=0.9, seed=7),
        "n2-seeded-streamed": _chat(ASK, n=2, temperature=0.9, seed=7, **usage),
        "logprobs": _chat(ASK, logprobs=True, top_logprobs=3),
        "logprobs-streamed": _chat(ASK, logprobs=True, top_logprobs=2, **usage),
        "json-schema": _chat(ASK, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}),
        "json-schema-streamed-seeded": _chat(ASK, max_tokens=60, temperature=1.0, seed=3, **usage, response_format={
            "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}),
        "tools-auto": _chat(ASK, tools=TOOLS),
        "tools-auto-call": _chat(ASK, tools=TOOLS, max_tokens=60, guided_choice=[CALL_AFTER_TEXT]),
        "tools-required": _chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80),
        "tools-required-streamed": _chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80, **usage),
        "tools-named": _chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                             parallel_tool_calls=False, max_tokens=60),
        "tools-cut": _chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=8, **usage),
        "tool-result-turn": _chat(HISTORY, tools=TOOLS),
        "think": _chat([{"role": "user", "content": "Plan a trip. /think"}]),
        "think-grammar-streamed": _chat([{"role": "user", "content": "Plan a trip. /think"}], max_tokens=30, **usage,
                                        guided_regex="[a-z]{3,6}\n</think>\n\nok"),
        "text-logprobs-streamed": (TEXT, {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
                                          "logprobs": 2, **usage}),
        "text-batch-n2": (TEXT, {"prompt": ["The sea", "A robot"], "n": 2, "max_tokens": 8, "temperature": 0.8,
                                 "seed": 1}),
        "text-choice": (TEXT, {"prompt": "Answer:", "max_tokens": 10, "temperature": 0,
                               "guided_choice": ["yes", "no", "maybe"]}),
    }
    for _, body in items.values():
        body["cache_prompt"] = False
    return items


def fetch(base: str, path: str, body: dict) -> dict:
    """The whole answer as bytes (text), ids and timestamps replaced: a JSON body (parsed beside it for
    the tests' own checks), or each SSE event's data grouped per choice index (choices of one stream
    interleave in arrival order, which is timing)."""
    with httpx.Client(base_url=base, timeout=120) as client:
        if not body.get("stream"):
            r = client.post(path, json=body)
            raw = _normalized(r.text)
            return {"status": r.status_code, "raw": raw, "body": json.loads(raw)}
        events: dict[str, list[str]] = {}
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                data = _normalized(line[6:])
                choices = json.loads(data)["choices"] if data != "[DONE]" else []
                events.setdefault(str(choices[0]["index"]) if choices else "end", []).append(data)
        return events


# Ids and times differ by design: the response id, its creation second, each tool call's random id.
_IDS = [(re.compile(r'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}"'), '"id":"<id>"'),
        (re.compile(r'"created":\d+'), '"created":0'),
        (re.compile(r'"id":"call_[0-9a-f]{24}"'), '"id":"call_<random>"')]


def _normalized(text: str) -> str:
    for pattern, replacement in _IDS:
        text = pattern.sub(replacement, text)
    return text


def spliced(result: dict) -> dict:
    """What a stream moved to another prefill node keeps exactly: per choice its text, reasoning,
    tool calls, logprobs and finish_reason, and the usage (held-back text may arrive in another chunk).
    A JSON answer is kept whole."""
    if "body" in result:
        return result
    out: dict = {"end": result["end"]}
    for key, events in result.items():
        if key == "end":
            continue
        merged: dict = {"text": "", "reasoning": "", "tool_calls": [], "logprobs": [], "finish_reason": None}
        for event in map(json.loads, events):
            choice = event["choices"][0]
            delta = choice.get("delta", {})
            merged["text"] += delta.get("content") or choice.get("text") or ""
            merged["reasoning"] += delta.get("reasoning_content") or ""
            merged["tool_calls"] += delta.get("tool_calls") or []
            logprobs = choice.get("logprobs") or {}
            merged["logprobs"] += logprobs.get("content") or list(zip(*(logprobs.get(k, []) for k in (
                "tokens", "token_logprobs", "top_logprobs", "text_offset"))))
            merged["finish_reason"] = choice["finish_reason"] or merged["finish_reason"]
        out[key] = merged
    return out


# -- the agent APIs (Anthropic Messages, OpenAI Responses) ----------------------------------------------------
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]

RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                   for t in TOOLS]


def agent_battery(model: str) -> dict[str, tuple[str, dict]]:
    """Messages and Responses requests covering text, streaming, stop sequences, forced tools, a tool-result
    turn, structured output and a thinking prompt (the topology's template opens <think> on "/think")."""
    history = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"city": "Paris", "unit": "c"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": '{"temp": 21}'}]}]
    think = [{"role": "user", "content": "Plan a trip. /think"}]

    def _messages(messages: list[dict], **body) -> tuple[str, dict]:
        return MESSAGES, {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **body}

    def _responses(given: str | list[dict], **body) -> tuple[str, dict]:  # store=False: each app has its own store
        return RESPONSES, {"model": model, "input": given, "max_output_tokens": 12, "temperature": 0,
                           "store": False, **body}
    return {
        "messages-plain": _messages(ASK, system="Be brief."),
        "messages-streamed": _messages(ASK, stream=True),
        "messages-stop": _messages(ASK, stop_sequences=[" a", "e"], max_tokens=30),
        "messages-tool-forced": _messages(ASK, tools=ANTHROPIC_TOOLS, max_tokens=80,
                                          tool_choice={"type": "tool", "name": "get_weather"}),
        "messages-tool-any-streamed": _messages(ASK, tools=ANTHROPIC_TOOLS, max_tokens=80, stream=True,
                                                tool_choice={"type": "any"}),
        "messages-tool-result": _messages(history, tools=ANTHROPIC_TOOLS),
        "messages-think": _messages(think, max_tokens=20),
        "messages-think-streamed": _messages(think, max_tokens=20, stream=True),
        "messages-think-budget-streamed": _messages(think, max_tokens=20, stream=True,
                                                    thinking={"type": "enabled", "budget_tokens": 4}),
        "responses-plain": _responses("What is the weather in Paris?", instructions="Be brief."),
        "responses-streamed": _responses("What is the weather in Paris?", stream=True),
        "responses-tool-forced-streamed": _responses(
            "What is the weather in Paris?", stream=True, max_output_tokens=80, tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"}),
        "responses-tool-output": _responses([
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris", "unit": "c"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}], tools=RESPONSES_TOOLS),
        "responses-json": _responses("Describe a pet.", max_output_tokens=60, text={"format": {
            "type": "json_schema", "name": "pet", "schema": SCHEMA}}),
        "responses-think": _responses("Plan a trip. /think", max_output_tokens=20),
    }


# Random ids of the agent APIs' objects, and the prefix-cache split of a prompt (a node's history).
_AGENT_IDS = [(re.compile(r'"(msg|toolu|resp|fc|call|rs)_[0-9a-f]{20,32}"'), r'"\1_<id>"'),
              (re.compile(r'"(created_at|completed_at)": ?\d+'), r'"\1":0')]


def fetch_agent(base: str, path: str, body: dict) -> dict:
    """A Messages / Responses answer with ids and times replaced and each usage's cached share folded into
    its input count: a JSON body, or the SSE stream as its list of (event, data)."""
    with httpx.Client(base_url=base, timeout=120) as client:
        if not body.get("stream"):
            r = client.post(path, json=body)
            return {"status": r.status_code, "body": _agent_normalized(r.text)}
        events, name = [], None
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, _agent_normalized(line[6:])))
        return {"events": events}


def _agent_normalized(text: str) -> object:
    for pattern, replacement in _AGENT_IDS:
        text = pattern.sub(replacement, text)
    return _fold_cached(json.loads(text))


def _fold_cached(value: object) -> object:
    if isinstance(value, dict):
        value = {k: _fold_cached(v) for k, v in value.items()}
        if "cache_read_input_tokens" in value:  # Anthropic: input_tokens excludes the cache's share
            value["input_tokens"] += value.pop("cache_read_input_tokens")
        details = value.get("input_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:  # Responses
            details["cached_tokens"] = 0
    elif isinstance(value, list):
        value = [_fold_cached(v) for v in value]
    return value
