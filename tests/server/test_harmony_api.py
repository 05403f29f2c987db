"""GPT-OSS's harmony replies over HTTP, streamed and not, on a tiny random GPT-OSS whose tokenizer carries the
gpt-oss chat template: the reply text is forced by a regex (whatever the weights), then parsed into
reasoning_content, content and tool_calls as a real harmony reply would be."""

import dataclasses
import json
import re
from pathlib import Path

import httpx
import pytest

from conveyor.config import EngineConfig, ServerConfig
from conveyor.testing import tiny_moe_checkpoint
from tests.server.conftest import serve

TEMPLATE = (Path(__file__).parent.parent / "data" / "gpt_oss_chat_template.jinja").read_text()
MESSAGES = [{"role": "user", "content": "What is 1 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
ANSWER = re.escape("<|channel|>analysis<|message|>") + "[a-z]{3}" + re.escape(
    "<|end|><|start|>assistant<|channel|>final<|message|>") + "ok"
CALL = re.escape("<|channel|>commentary to=functions.add <|constrain|>json<|message|>") + r'\{"a": [0-9]\}'


@pytest.fixture(scope="module")
def served():
    checkpoint = tiny_moe_checkpoint("gpt_oss")
    checkpoint = dataclasses.replace(checkpoint, tokenizer=dataclasses.replace(checkpoint.tokenizer,
                                                                               chat_template=TEMPLATE))
    with serve(checkpoint, EngineConfig(parallel=2), ServerConfig()) as s:
        yield s


def _post(served, body: dict) -> dict:
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(served, body: dict) -> list[dict]:
    deltas = []
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                deltas += [(c["delta"], c["finish_reason"]) for c in chunk["choices"]]
    return deltas


def test_analysis_and_final(served):
    choice = _post(served, {"guided_regex": ANSWER})
    assert choice["message"]["content"] == "ok" and len(choice["message"]["reasoning_content"]) == 3
    deltas = _stream(served, {"guided_regex": ANSWER})
    assert "".join(d.get("reasoning_content") or "" for d, _ in deltas) == choice["message"]["reasoning_content"]
    assert "".join(d.get("content") or "" for d, _ in deltas) == "ok"
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d, _ in deltas)


def test_tool_call(served):
    choice = _post(served, {"guided_regex": CALL, "tools": TOOLS})
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a"}
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    deltas = _stream(served, {"guided_regex": CALL, "tools": TOOLS})
    calls = [c for d, _ in deltas for c in d.get("tool_calls") or []]
    assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
    assert deltas[-1][1] == "tool_calls"


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_tool_choice_is_a_valid_harmony_call_streamed_and_not(served, tool_choice):
    """Whatever the (random) weights, a forced choice answers one call of an offered tool (the named one), its
    arguments valid under the tool's schema, as harmony writes a call; finish_reason tool_calls."""
    body = {"tools": TWO_TOOLS, "tool_choice": tool_choice}
    choice = _post(served, body)
    (call,) = choice["message"]["tool_calls"]
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    if isinstance(tool_choice, dict):
        assert name == "weather"
    schema = next(t["function"]["parameters"] for t in TWO_TOOLS if t["function"]["name"] == name)
    assert set(arguments) == set(schema["required"])  # nothing but the declared arguments
    assert all(isinstance(v, int if schema["properties"][k]["type"] == "integer" else str) for k, v in arguments.items())
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    deltas = _stream(served, body)
    calls = [c for d, _ in deltas for c in d.get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(name, call["function"]["arguments"])]
    assert deltas[-1][1] == "tool_calls"
