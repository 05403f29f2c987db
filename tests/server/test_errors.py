"""Every refusal is OpenAI-shaped, has the right status, and happens before the engine sees anything."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from conveyor.config import EngineConfig, ServerConfig
from conveyor.server import create_app

MSG = [{"role": "user", "content": "hi"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _chat(served, **fields) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **fields})


def test_malformed_json(served):
    r = httpx.post(f"{served.url}/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert _error(r, 400)["type"] == "invalid_request_error"
    assert _error(httpx.post(f"{served.url}/v1/completions", content=b"[1, 2]"), 400)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"10": 500}}, "logit_bias"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_fields_are_400_with_param(served, fields, param):
    assert _error(_chat(served, **fields), 400)["param"] == param


def test_bad_messages(served):
    assert _error(_chat(served, messages=[]), 400)["param"] == "messages"
    assert _error(_chat(served, messages=[{"role": "wizard", "content": "x"}]), 400)["param"].startswith("messages")
    assert _error(_chat(served, messages=[{"role": "user", "content": 3}]), 400)["param"].startswith("messages")
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"max_tokens": 2})
    assert _error(r, 400)["param"] == "messages"


def test_bad_completion_prompts(served):
    url = f"{served.url}/v1/completions"
    assert _error(httpx.post(url, json={"prompt": ""}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={"prompt": []}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={"prompt": [1, "a"]}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={"prompt": [10 ** 9]}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={"prompt": "x", "echo": True}), 400)["param"] == "echo"
    assert _error(httpx.post(url, json={"prompt": "x", "best_of": 3}), 400)["param"] == "best_of"


def test_prompt_over_context_window(served):
    too_long = list(range(100, 100 + served.core.max_model_len))
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": too_long, "max_tokens": 1})
    error = _error(r, 400)
    assert error["param"] == "prompt" and "context" in error["message"]
    r = _chat(served, messages=[{"role": "user", "content": "word " * served.core.max_model_len}])
    assert _error(r, 400)["param"] == "messages"


def test_bad_priority_header(served):
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG}, headers={"X-Priority": "high"})
    assert _error(r, 400)["param"] == "X-Priority"


def test_any_model_name_is_answered_unless_strict(served, serve_tiny):
    # One model served: any name is answered by it (llama-server's behaviour), and the reply names the model.
    r = _chat(served, model="gpt-17")
    assert r.status_code == 200 and r.json()["model"] == served.model
    assert _error(httpx.get(f"{served.url}/v1/models/gpt-17"), 404)  # a lookup is exact
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(strict_model_name=True)) as strict:
        error = _error(_chat(strict, model="gpt-17"), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        # Both the served name and the checkpoint's own name are accepted.
        assert _chat(strict, model=strict.core.model_name).status_code == 200


def test_unknown_route_is_404_json(served):
    assert _error(httpx.get(f"{served.url}/v1/nope"), 404)["code"] == "not_found"
    assert _error(httpx.get(f"{served.url}/v1/chat/completions"), 405)


def test_validation_never_reaches_the_engine(served):
    before = served.core.scheduler.stats.num_completed
    for fields in ({"temperature": -1}, {"max_tokens": 0}, {"top_p": 7}):  # (any model name is served here)
        assert _chat(served, **fields).status_code in (400, 404)
    assert served.core.scheduler.stats.num_completed == before


def test_detokenize_out_of_vocab(served):
    assert _error(httpx.post(f"{served.url}/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"
    assert _error(httpx.post(f"{served.url}/tokenize", json={}), 400)


# -- API key and optional routes: in-process, no engine thread needed --------------------------
def test_api_key_required_on_api_routes(served):
    app = create_app(served.engine, ServerConfig(api_key="s3cret"))
    client = TestClient(app)  # no `with`: the lifespan (engine start) does not run
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/cache/stats"), ("GET", "/v1/loads"), ("GET", "/slots"), ("POST", "/tokenize")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.request(method, path, headers=headers, json={})
            error = _error(r, 401)
            assert error["code"] == "invalid_api_key", (method, path)
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = client.post("/v1/chat/completions", headers={"Authorization": "Bearer s3cret"}, json={"messages": []})
    assert r.status_code == 400  # authenticated, then validated
    assert client.get("/health").status_code != 401  # probes need no key


def test_metrics_route_only_when_enabled(served):
    assert TestClient(create_app(served.engine, ServerConfig(metrics=False))).get("/metrics").status_code == 404
    assert httpx.get(f"{served.url}/metrics").status_code == 200
