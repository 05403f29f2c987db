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


def test_forced_tool_choice_is_refused(served):
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
