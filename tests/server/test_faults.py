"""A failing model step ends only the requests in it; repeated failures trip the engine's guard."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conveyor.config import EngineConfig, ServerConfig

BODY = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}


@pytest.fixture
def faulty(serve_tiny, monkeypatch):
    """A dedicated server whose runner raises while `fail` is set (or `fail_once` is armed)."""
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(metrics=True)) as served:
        runner = served.core.runner
        real_execute = runner.execute
        served.fail = threading.Event()
        served.fail_once = threading.Event()

        def execute(plan):
            if served.fail.is_set() or served.fail_once.is_set():
                served.fail_once.clear()
                raise RuntimeError("injected fault")
            return real_execute(plan)

        monkeypatch.setattr(runner, "execute", execute)
        yield served


def test_one_failed_step_fails_only_its_requests(faulty):
    url = f"{faulty.url}/v1/completions"
    assert httpx.post(url, json=BODY).status_code == 200

    faulty.fail_once.set()
    r = httpx.post(url, json=BODY)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]

    # The engine carries on: the next request is served and /health is still ok.
    r = httpx.post(url, json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert httpx.get(f"{faulty.url}/health").json()["status"] == "ok"

    # Streaming: the fault hits mid-stream and the stream ends with an error chunk, then [DONE].
    with httpx.stream("POST", url, json={**BODY, "max_tokens": 500, "ignore_eos": True, "stream": True},
                      timeout=30) as stream:
        events = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    faulty.fail_once.set()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"]["type"] == "server_error" and "injected fault" in last["error"]["message"]
    assert httpx.post(url, json=BODY).status_code == 200
    faulty.wait_until(lambda: faulty.core.pool.stats().num_used == 0, what="blocks freed")
    metrics = httpx.get(f"{faulty.url}/metrics").text
    assert 'conveyor_requests_finished_total{finish_reason="error"} 2.0' in metrics
    assert "conveyor_engine_failed_steps_total 2.0" in metrics


def test_repeated_failures_trip_the_guard(faulty):
    url = f"{faulty.url}/v1/completions"
    faulty.fail.set()
    statuses = [httpx.post(url, json=BODY).status_code for _ in range(faulty.engine.max_consecutive_failures)]
    assert statuses == [500] * faulty.engine.max_consecutive_failures
    faulty.wait_until(lambda: not faulty.engine.is_alive, what="the engine guard to trip")

    health = httpx.get(f"{faulty.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    r = httpx.post(url, json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert "conveyor_engine_healthy 0.0" in httpx.get(f"{faulty.url}/metrics").text
