"""Hostile input: every request limit answers 413/400 in the OpenAI shape, nothing reaches a 5xx,
an unexpected exception is a clean 500, and the keep-alive connection survives all of it."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from starlette.routing import Route

from conveyor.config import EngineConfig, ServerConfig

MSG = [{"role": "user", "content": "hi"}]
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
SMALL = ServerConfig(metrics=True, api_key=KEY, max_request_bytes=8192, max_json_depth=8, max_messages=4,
                     max_prompt_chars=500, max_n=2, max_stop_strings=2, max_logit_bias=2)


def _error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


class Conn:
    """One raw keep-alive connection; `post` fails if the server closed it (no silent reconnect)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.conn.connect()
        self.local = self.conn.sock.getsockname()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        self.conn.request(method, path, body=body, headers=headers or {})
        response = self.conn.getresponse()
        data = response.read()
        assert self.conn.sock is not None and self.conn.sock.getsockname() == self.local, "connection was replaced"
        assert response.getheader("connection", "").lower() != "close", (response.status, data[:200])
        return response.status, data

    def chat(self, raw: bytes, headers: dict | None = None):
        return self.request("POST", "/v1/chat/completions", raw, headers or {"Content-Type": "application/json"})

    def valid_chat_works(self, headers: dict | None = None) -> None:
        status, data = self.chat(json.dumps({"messages": MSG, "max_tokens": 2}).encode(), headers)
        assert status == 200, data[:300]
        assert json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length")

    def close(self) -> None:
        self.conn.close()


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [  # (raw body, param or None); each must be a 400 on the default limits
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (json.dumps({"messages": MSG, "metadata": {"a": _nested(70)}}).encode(), None),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages.[0].content"),
    (b'{"messages": [{"role": "user", "content": "ok"}], "stop": ["\\udfff"]}', "stop.[0]"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe bad utf-8"}]}', None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (json.dumps({"messages": MSG, "seed": 2 ** 64}).encode(), "seed"),
    (json.dumps({"messages": MSG, "n": 17}).encode(), "n"),
    (json.dumps({"messages": MSG, "stop": [str(i) for i in range(17)]}).encode(), "stop"),
    (json.dumps({"messages": MSG, "logit_bias": {str(i): 1 for i in range(301)}}).encode(), "logit_bias"),
    (b"\xef\xbb\xbf\x00\x00", None),
    (b"", None),
]


@pytest.mark.parametrize("raw, param", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_are_400_and_the_connection_survives(served, raw, param):
    conn = Conn(served.url)
    try:
        error = _error(*conn.chat(raw), 400)
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
        conn.valid_chat_works()  # the very next request on the same pooled connection
    finally:
        conn.close()
    served.core.pool.check_integrity()


def test_extreme_but_valid_numbers_are_served(served):
    for fields in ({"top_k": 2 ** 70}, {"temperature": 1e300}, {"priority": -ServerConfig.max_priority}, {"seed": -(2 ** 63)},
                   {"repetition_penalty": 1e300, "temperature": 0.5}):
        r = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, **fields})
        assert r.status_code == 200, (fields, r.text)


def test_priority_beyond_the_bound_is_a_400_in_body_and_header(served):
    """Aging bounds a queued request's wait at (priority gap) x --priority-aging-s only for a bounded range."""
    url, limit = f"{served.url}/v1/chat/completions", ServerConfig.max_priority
    for priority in (limit + 1, -(2 ** 80)):
        r = httpx.post(url, json={"messages": MSG, "max_tokens": 1, "priority": priority}, headers=AUTH)
        assert _error(r.status_code, r.content, 400)["param"] == "priority"
    r = httpx.post(url, json={"messages": MSG, "max_tokens": 1}, headers={**AUTH, "X-Priority": str(-limit - 1)})
    assert _error(r.status_code, r.content, 400)["param"] == "X-Priority"
    r = httpx.post(url, json={"messages": MSG, "max_tokens": 1}, headers={**AUTH, "X-Priority": str(limit)})
    assert r.status_code == 200, r.text


def test_unexpected_exception_is_a_clean_500_on_a_connection_that_stays_open(served, monkeypatch):
    serving = served.app.state.serving

    async def broken(*args, **kwargs):
        raise RuntimeError("forced internal error")

    conn = Conn(served.url)
    try:
        monkeypatch.setattr(serving, "chat", broken)
        error = _error(*conn.chat(json.dumps({"messages": MSG}).encode()), 500)
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "forced internal error" not in error["message"]  # the traceback goes to the log, not the client
        monkeypatch.undo()
        conn.valid_chat_works()
        # The tokenizer raising (what a lone surrogate used to do) is the same clean 500.
        monkeypatch.setattr(served.core.tokenizer, "encode", lambda *a, **k: (_ for _ in ()).throw(TypeError("x")))
        _error(*conn.request("POST", "/tokenize", b'{"content": "x"}', {"Content-Type": "application/json"}), 500)
        monkeypatch.undo()
        conn.valid_chat_works()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def small(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), SMALL) as s:
        yield s


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "x" * 9000}]}, 413, None),
    ({"messages": MSG * 5}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 501}]}, 400, "messages"),
    ({"messages": MSG, "n": 3}, 400, "n"),
    ({"messages": MSG, "stop": ["a", "b", "c"]}, 400, "stop"),
    ({"messages": MSG, "stop_token_ids": [1, 2, 3]}, 400, "stop_token_ids"),
    ({"messages": MSG, "logit_bias": {"1": 1, "2": 1, "3": 1}}, 400, "logit_bias"),
    ({"messages": MSG, "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": 1}}}}}}}}}, 400, None),
])
def test_each_limit_is_a_flag(small, body, status, param):
    r = httpx.post(f"{small.url}/v1/chat/completions", headers=AUTH, json={"max_tokens": 2, **body})
    error = _error(r.status_code, r.content, status)
    assert error["param"] == param
    if status == 413:
        assert error["code"] == "request_too_large"


def test_limits_on_completions_and_tokenize(small):
    r = httpx.post(f"{small.url}/v1/completions", headers=AUTH, json={"prompt": "y" * 501, "max_tokens": 2})
    assert _error(r.status_code, r.content, 400)["param"] == "prompt"
    r = httpx.post(f"{small.url}/v1/completions", headers=AUTH, json={"prompt": [[1] * 300, [2] * 300]})
    assert _error(r.status_code, r.content, 400)["param"] == "prompt"
    r = httpx.post(f"{small.url}/tokenize", headers=AUTH, json={"content": "z" * 501})
    assert _error(r.status_code, r.content, 400)["param"] == "content"


def test_body_over_the_limit_without_content_length_is_413(small):
    def chunks():  # chunked transfer encoding: no Content-Length to refuse up front
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(f"{small.url}/v1/chat/completions", headers=AUTH, content=chunks())
    assert _error(r.status_code, r.content, 413)["code"] == "request_too_large"
    assert httpx.get(f"{small.url}/health").status_code == 200


def _walk(routes):
    """Every endpoint, through included routers (FastAPI >= 0.165 keeps them as `_IncludedRouter`)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _walk(route.original_router.routes)
        elif isinstance(route, Route):
            yield route


def test_api_key_is_enforced_on_every_route_but_health_and_metrics(small):
    """Walks the app's own routes, so a route added later is covered too."""
    routes = list(_walk(small.app.routes))
    exempt = {"/health", "/metrics", "/", "/webui/webui.js"}  # the page is static; it sends the key itself
    deep = b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"  # under the 8 KiB body limit
    checked = 0
    for route in routes:
        path = route.path.replace("{name:path}", "x").replace("/webui/{name}", "/webui/webui.js")
        for method in route.methods - {"HEAD"}:
            for body in (b"{}", deep, b'{"content": "\\ud800"}'):
                r = httpx.request(method, f"{small.url}{path}", content=body if method == "POST" else None,
                                  headers={"Content-Type": "application/json"})
                if path in exempt:
                    assert r.status_code == 200, (method, path)
                elif path.startswith("/v1/messages"):  # Anthropic's clients read Anthropic's error shape
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
                else:
                    assert _error(r.status_code, r.content, 401)["code"] == "invalid_api_key", (method, path)
            checked += 1
    assert checked >= 12
    ok = httpx.get(f"{small.url}/v1/models", headers=AUTH)
    assert ok.status_code == 200
