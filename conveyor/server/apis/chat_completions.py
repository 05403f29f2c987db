"""OpenAI chat/completions and completions, the server's native shapes, and /v1/models: the routes a
node and the cluster router share (`serving` is the ServingFront of either, server/front.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from conveyor.server.apis.body import parse_body
from conveyor.server.limits import RequestLimits
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest


def add_routes(router: APIRouter, serving, limits: RequestLimits, model_card: Callable[[], dict]) -> None:
    """`model_card()`: the served model's /v1/models entry (a node's has its metadata, the router's less)."""

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        serving.metrics.api_requests.labels("chat_completions").inc()
        return await serving.chat(request, await parse_body(request, ChatCompletionRequest, limits), arrival)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        serving.metrics.api_requests.labels("completions").inc()
        return await serving.completion(request, await parse_body(request, CompletionRequest, limits), arrival)

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        serving.check_model(name, strict=True)
        return model_card()
