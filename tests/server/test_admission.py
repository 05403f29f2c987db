"""Admission control (503 when the queue is full) and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from conveyor.config import EngineConfig, ServerConfig

LONG = {"prompt": "Count forever:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _aborted(served) -> int:
    return served.core.scheduler.stats.finished_by_reason.get("abort", 0)


def _metric(served, name: str) -> float:
    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def _all_blocks_free(served) -> bool:
    return served.core.pool.stats().num_used == 0 and served.engine.num_in_flight == 0


def test_streaming_disconnect_aborts_and_frees_blocks(served):
    before = _aborted(served)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{served.url}/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # NOTE: keep a reference; a dropped line iterator closes the connection
            received = 0
            while received < 2:
                received += next(lines).startswith("data: ")
            assert served.core.pool.stats().num_used > 0
    # Closing the connection is the only signal the server gets.
    served.wait_until(lambda: _all_blocks_free(served), timeout=120, what="KV blocks to be freed")
    assert _aborted(served) == before + 1
    assert _metric(served, 'conveyor_requests_finished_total{finish_reason="abort"}') == before + 1
    served.core.pool.check_integrity()


def test_non_streaming_disconnect_aborts(served, caplog):
    before = _aborted(served)
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{served.url}/v1/completions", json=LONG)
    served.wait_until(lambda: _all_blocks_free(served) and _aborted(served) == before + 1, timeout=120,
                      what="the abandoned request to be aborted")
    time.sleep(0.1)  # the handler returns after the abort
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "the server logged an error"


@pytest.fixture(scope="module")
def tight(serve_tiny):
    """One slot and a queue of two: the fourth concurrent request has nowhere to go."""
    with serve_tiny(EngineConfig(parallel=1, max_queue_depth=2), ServerConfig(metrics=True)) as s:
        yield s


def test_queue_full_is_503_and_admitted_requests_complete(tight):
    num_requests, max_tokens = 10, 40

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        return await client.post(f"{tight.url}/v1/completions", json=body)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(num_requests))))

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == num_requests, [r.status_code for r in responses]
    assert ok and busy
    assert len(ok) <= 1 + 2 + 2  # slot + queue, plus a little slack for requests finishing mid-burst
    for r in busy:
        assert r.json() == {"error": {"message": "Server is busy. Retry later.", "type": "overloaded",
                                      "param": None, "code": None}}
        assert int(r.headers["Retry-After"]) >= 1
    for r in ok:  # nothing admitted was lost or cut short
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens
    assert _metric(tight, 'conveyor_requests_rejected_total{reason="overloaded"}') == len(busy)
    tight.wait_until(lambda: _all_blocks_free(tight), what="idle engine")


def test_streaming_503_comes_before_the_stream(tight):
    async def burst() -> list[httpx.Response]:
        body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(client.post(f"{tight.url}/v1/completions", json=body)
                                               for _ in range(8))))

    responses = asyncio.run(burst())
    assert {r.status_code for r in responses} == {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert r.headers["content-type"].startswith("application/json")
        else:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
