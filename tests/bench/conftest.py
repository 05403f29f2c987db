"""A fake OpenAI-compatible streaming server on a real socket, shared by the bench tests.

Each chunk carries `tokens_per_chunk` words after a small sleep; knobs on `FakeState` switch on
errors, batch-dependent (non-deterministic) output and prefill stalls.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    model: str = "fake-model"
    n_params: int | None = None  # sent as the card's meta.n_params when set
    chunk_delay_s: float = 0.002
    tokens_per_chunk: int = 1
    eos_after: int | None = None  # stop early unless the request sets ignore_eos
    fail_every: int = 0  # every k-th request answers 503
    midstream_error_every: int = 0  # every k-th request sends an SSE error event after one chunk
    nondeterministic: bool = False  # text changes when other requests are in flight
    send_usage: bool = True  # honour stream_options.include_usage
    long_prompt_words: int = 0  # prompts this long "prefill" for prefill_s ...
    prefill_s: float = 0.0  # ... and stall every other stream meanwhile
    # Observations.
    num_requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    stall_until: float = 0.0

    def reset(self) -> None:
        self.__dict__.update(FakeState().__dict__)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(endpoint: str, text: str, finish: str | None = None) -> dict[str, Any]:
    if endpoint == "chat":
        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": "x", "object": "chunk", "choices": [choice]}


async def _events(state: FakeState, body: dict[str, Any], endpoint: str, index: int) -> AsyncIterator[str]:
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        if state.long_prompt_words and len(prompt.split()) >= state.long_prompt_words:
            state.stall_until = time.perf_counter() + state.prefill_s
            await asyncio.sleep(state.prefill_s)
        num_tokens = body["max_tokens"]
        if state.eos_after is not None and not body.get("ignore_eos"):
            num_tokens = min(num_tokens, state.eos_after)
        if endpoint == "chat":
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for start in range(0, num_tokens, state.tokens_per_chunk):
            await asyncio.sleep(max(state.chunk_delay_s, state.stall_until - time.perf_counter()))
            if state.midstream_error_every and index % state.midstream_error_every == 0 and start:
                yield _sse({"error": {"message": "engine died", "code": 500}})
                return
            word = "x" if state.nondeterministic and state.in_flight > 1 else "w"
            count = min(state.tokens_per_chunk, num_tokens - start)
            yield _sse(_chunk(endpoint, "".join(f" {word}{i}" for i in range(start, start + count))))
        yield _sse(_chunk(endpoint, "", finish="length"))
        if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens,
                     "total_tokens": len(prompt.split()) + num_tokens}
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


def create_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {"id": state.model, "object": "model"}
        if state.n_params is not None:
            card["meta"] = {"n_params": state.n_params}
        return {"object": "list", "data": [card]}

    async def _complete(request: Request, endpoint: str):
        body = await request.json()
        state.num_requests += 1
        state.bodies.append(body)
        state.auth_headers.append(request.headers.get("authorization"))
        if state.fail_every and state.num_requests % state.fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return StreamingResponse(_events(state, body, endpoint, state.num_requests), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completions")

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="session")
def _fake_server_session() -> FakeServer:
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with other test runs
    server = uvicorn.Server(uvicorn.Config(create_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    yield FakeServer(f"http://127.0.0.1:{sock.getsockname()[1]}", state)
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake_server(_fake_server_session: FakeServer) -> FakeServer:
    _fake_server_session.state.reset()
    return _fake_server_session
