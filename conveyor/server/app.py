"""create_app(engine, config): the routes and their wiring. No module-level state.

The app owns the engine's thread: its lifespan starts the engine on the server's event loop
and shuts it down on exit.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conveyor.config import ServerConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.multimodal.image_fetch import ImagePolicy
from conveyor.server import dashboard, errors, observability, slot_actions
from conveyor.server.apis import add_agent_routes, add_pooling_routes, chat_completions
from conveyor.server.apis.body import parse_body
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.errors import APIError
from conveyor.server.lifecycle import Lifecycle
from conveyor.server.limits import RequestLimits
from conveyor.server.metrics import CONTENT_TYPE, ServerMetrics
from conveyor.server.middleware import BodySizeLimit, CatchAll
from conveyor.server.openai_serving import OpenAIServing
from conveyor.server.protocol import DetokenizeRequest, TokenizeRequest
from conveyor.server.reply import SSEResponse
from conveyor.server.responses import TokenText
from conveyor.server.webui import add_webui_routes

def api_key_check(api_key: str | None):
    """--api-key: `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    async def check(request: Request) -> None:
        if api_key is not None and not api_key_matches(request.headers, api_key):
            raise invalid_api_key()
    return check


def api_key_matches(headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get("x-api-key", "")
    return secrets.compare_digest(token.strip().encode(), api_key.encode())


def invalid_api_key() -> APIError:
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def create_app(engine: AsyncEngine, server_config: ServerConfig | None = None,
               response_store: ResponseStore | None = None) -> FastAPI:
    """response_store: the Responses API's store when several models share one (server/multimodel/)."""
    config = server_config or ServerConfig()
    model_id = config.served_model_name or engine.core.model_name
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, model_id, metrics, config.reasoning_parser, config.template_kwargs,
                            config.strict_model_name, ImagePolicy.from_config(config))
    lifecycle = Lifecycle(engine, serving, config.shutdown_grace_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="conveyor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.serving, app.state.metrics, app.state.lifecycle = engine, serving, metrics, lifecycle
    errors.install_handlers(app)
    limits = RequestLimits.from_config(config)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_middleware(CatchAll)  # added last = outermost, so it also catches the size layer's errors

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = observability.health(engine, serving.draining)
        return JSONResponse(body, status_code=status)

    if config.metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE)

    if config.webui:
        add_webui_routes(app)
    api = _api_router(engine, serving, model_id, limits)
    add_agent_routes(api, serving, limits, config, response_store)
    add_pooling_routes(api, serving, limits)
    add_dashboard_routes(api, lambda _model: dashboard.engine_snapshot(engine, metrics, model_id),
                          lambda: serving.draining or not engine.is_alive)
    app.include_router(api, dependencies=[Depends(api_key_check(config.api_key))])
    return app


def add_dashboard_routes(router: APIRouter, snapshot: Callable[[str | None], dict], stop: Callable[[], bool]) -> None:
    """The page's live view (a node's or the cluster router's `snapshot`, given the `?model=` asked for, if
    any): one JSON snapshot, or a stream of them (SSE, a few per second, ending when `stop()`: draining or
    dead)."""

    @router.get("/v1/dashboard")
    async def dashboard_once(model: str | None = None) -> dict:
        return snapshot(model)

    @router.get("/v1/dashboard/stream")
    async def dashboard_stream(model: str | None = None) -> Response:
        snapshot(model)  # an unknown ?model= is answered now (404), not inside the stream
        return SSEResponse(dashboard.snapshot_stream(lambda: snapshot(model), stop))


def add_tokenizer_routes(router: APIRouter, token_text: TokenText, vocab_size: int, limits: RequestLimits) -> None:
    """/tokenize and /detokenize: a node's, and the router's (which has the tokenizer but not the model)."""
    tokenizer = token_text.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeRequest, limits)
        ids = tokenizer.encode(body.text, add_special_tokens=body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": token_text(i)[0]} for i in ids]}
        return {"tokens": ids}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest, limits)
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise errors.invalid(f"token ids must be in [0, {vocab_size})", "tokens")
        return {"content": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _api_router(engine: AsyncEngine, serving: OpenAIServing, model_id: str, limits: RequestLimits) -> APIRouter:
    router = APIRouter()
    core = engine.core

    def model_card() -> dict:
        cfg = core.model_config
        # `meta` as llama-server reports it; `conveyor bench` reads n_params for its roofline.
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "conveyor",
                "root": core.model_name, "max_model_len": core.max_model_len,
                "meta": {"n_params": core.num_params, "n_vocab": cfg.vocab_size, "n_embd": cfg.hidden_size,
                         "n_ctx_train": cfg.max_position_embeddings, "architecture": cfg.architecture,
                         **core.layers_report()}}

    chat_completions.add_routes(router, serving, limits, model_card)
    add_tokenizer_routes(router, serving.token_text, core.model_config.vocab_size, limits)

    @router.get("/slots")
    async def slots(fail_on_no_slot: bool = False) -> Response:
        body = observability.slots(engine)
        if fail_on_no_slot and all(s["is_processing"] for s in body):
            return errors.APIError(503, "no slot available", "unavailable").response()
        return JSONResponse(body)

    @router.post("/slots/{id_slot}")
    async def slot_action(id_slot: int, request: Request, action: str = "") -> Response:
        return await slot_actions.handle(engine, id_slot, action, await request.body(), limits)

    @router.get("/props")
    async def props() -> dict:
        return observability.props(engine, model_id)

    @router.get("/v1/cache/stats")
    async def cache_stats() -> dict:
        return observability.cache_stats(engine)

    @router.get("/v1/internal/spec-policy")
    @router.get("/v1/internal/mtp-policy")  # the seeds' name
    async def spec_policy() -> dict:
        return core.speculation_report()

    @router.get("/v1/loads")
    async def loads() -> dict:
        return observability.loads(engine)

    return router
