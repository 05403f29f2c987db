"""chat_template_kwargs, reasoning_effort and --chat-template-kwargs reach the chat template."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from conveyor.config import ConfigError, ServerConfig
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.request_plan import plan_chat_request

TEMPLATE = ("{% for m in messages %}{{ m.content }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
            "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
            "[flag={{ flag | default('unset') }}]")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return dataclasses.replace(tiny.tokenizer, chat_template=TEMPLATE)


def _prompt(tokenizer, defaults=None, **fields) -> str:
    body = ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                                  **fields}))
    plan = plan_chat_request(body, tokenizer, "none", "m", defaults)
    return tokenizer.decode(plan.prompts[0])


def test_request_kwargs_and_reasoning_effort_reach_the_template(tokenizer):
    assert _prompt(tokenizer).endswith("[flag=unset]")
    text = _prompt(tokenizer, chat_template_kwargs={"enable_thinking": False, "flag": "r"}, reasoning_effort="low")
    assert "[no-think]" in text and "[effort=low]" in text and text.endswith("[flag=r]")


def test_request_kwargs_override_the_servers(tokenizer):
    assert _prompt(tokenizer, {"flag": "server"}).endswith("[flag=server]")
    assert _prompt(tokenizer, {"flag": "server"}, chat_template_kwargs={"flag": "request"}).endswith("[flag=request]")


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt"])
def test_the_templates_own_inputs_cannot_be_replaced(tokenizer, name):
    with pytest.raises(APIError) as err:
        _prompt(tokenizer, chat_template_kwargs={name: []})
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"


def test_server_flag_is_a_json_object_checked_at_startup():
    assert ServerConfig(chat_template_kwargs='{"enable_thinking": false}').template_kwargs == {"enable_thinking": False}
    assert ServerConfig().template_kwargs == {}
    for bad in ("[1]", "{not json", '{"messages": 1}'):
        with pytest.raises(ConfigError):
            ServerConfig(chat_template_kwargs=bad)


def test_the_fields_over_http(served):
    url = f"{served.url}/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    ok = httpx.post(url, json={**base, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(url, json={**base, "chat_template_kwargs": {"messages": []}}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    assert httpx.post(url, json={**base, "reasoning_effort": "extreme"}, timeout=120).status_code == 400
