"""A multi-model server's ASGI app: its own routes (models, health, metrics, the page) and the dispatch of
every other request to the app of the model it names.

The model is the body's `model` field (POST), else the `?model=` query parameter; a POST that names
none goes to the first model listed, any other request to the most recently used loaded model. Under
`/model/<name>/` each model also has a base URL of its own, answering as a single-model server would
(its /health, its /v1/models, every route of its app): a gateway that learns one model per worker URL
(SGLang's SMG) then routes by model over replicas that serve different sets. A POST
then holds its model (registry.lease, loading it first) until its response, streamed or not, has been
sent, and runs through that model's own app (server/app.py: every route a single-model server has). A
GET reads a loaded model's state (/props, /slots, /v1/dashboard...) and neither loads nor holds it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from conveyor.config import ServerConfig
from conveyor.server import errors
from conveyor.server.apis.body import parse_body
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.apis.responses_api import add_store_routes
from conveyor.server.app import api_key_check, api_key_matches, invalid_api_key
from conveyor.server.errors import APIError
from conveyor.server.metrics import CONTENT_TYPE
from conveyor.server.asgi_body import read_body, replay
from conveyor.server.limits import RequestLimits, parse_json
from conveyor.server.multimodel.metrics import MultiModelMetrics
from conveyor.server.multimodel.prefetch import start_tokenizer_prefetch, stop_tokenizer_cache
from conveyor.server.multimodel.registry import ModelEntry, ModelRegistry, ModelState, ModelUnavailable
from conveyor.server.protocol import ModelActionRequest
from conveyor.server.webui import add_webui_routes

logger = logging.getLogger(__name__)



class MultiModelApp:
    def __init__(self, registry: ModelRegistry, config: ServerConfig, response_store: ResponseStore) -> None:
        self.registry = registry
        self.config = config
        self.limits = RequestLimits.from_config(config)
        self.draining = False
        self.front = _front_app(self, response_store)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(MODEL_PREFIX):
            await self._one_model(scope, receive, send)
        elif scope["type"] == "http" and not _is_front_route(scope):
            await self._dispatch(scope, receive, send)
        else:
            await self.front(scope, receive, send)

    async def _one_model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/model/<name>/<route>: the model's own base URL. Its model list comes from the registry, and its
        health too until it is loaded (a model not loaded yet is healthy: its first request loads it); the rest,
        as its loaded /health, is its app's."""
        found = self._split_model_path(scope["path"])
        if found is None:
            served = ", ".join(self.registry.entries)
            await _model_not_found(f"{scope['path']} names no served model (served: {served}); "
                                   f"a model's own base URL is {MODEL_PREFIX}<name>").response(scope["path"])(
                scope, receive, send)
            return
        name, route = found
        entry = self.registry.entry(name)
        loaded = entry.state is ModelState.LOADED and entry.app is not None
        if scope["method"] == "GET" and route in ("/health", "/v1/models", "/models", f"/v1/models/{name}") \
                and not (route == "/health" and loaded and not self.draining):  # a loaded one's own /health
            if route != "/health" and not self._key_ok(scope):
                await invalid_api_key().response(scope["path"])(scope, receive, send)
                return
            await self._registry_answer(entry, route)(scope, receive, send)
            return
        prefix = MODEL_PREFIX + name
        inner = dict(scope, path=route, raw_path=route.encode("latin-1"),
                     root_path=scope.get("root_path", "") + prefix)
        await self._dispatch(inner, receive, send, pinned=name)

    def _registry_answer(self, entry: ModelEntry, route: str) -> JSONResponse:
        """A model's own /health, /v1/models or /v1/models/<name>, from the registry (loaded or not)."""
        if route == "/health":
            body = {"status": "shutting_down" if self.draining else "ok", "model": entry.name,
                    "state": entry.state.value}
            return JSONResponse(body, status_code=503 if self.draining else 200)
        card = model_card(entry)
        return JSONResponse(card if route.startswith("/v1/models/") else {"object": "list", "data": [card]})

    def _key_ok(self, scope: Scope) -> bool:
        """The request carries the API key (or none is set)."""
        if self.config.api_key is None:
            return True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return api_key_matches(headers, self.config.api_key)

    def _split_model_path(self, path: str) -> tuple[str, str] | None:
        """(model name, the route after it) of a /model/<name>/... path; names may hold slashes (Hub names):
        the longest served name that fits wins."""
        rest = path[len(MODEL_PREFIX):]
        for name in sorted(self.registry.entries, key=len, reverse=True):
            if rest == name or rest.startswith(name + "/"):
                return name, rest[len(name):] or "/"
        return None

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send, pinned: str | None = None) -> None:
        """Runs the request on its model's app; `pinned`: the model its path names (its own base URL)."""
        path = scope["path"]
        if not self._key_ok(scope):
            await invalid_api_key().response(path)(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.config.max_request_bytes)
            name = self._model_named(scope, body, pinned)
            if self.draining:
                raise errors.overloaded()
            if scope["method"] in ("GET", "HEAD"):
                await self._observe(self._loaded(name).app, scope, receive, send)
                return
            entry = await self._acquire_unless_gone(name, receive)
        except APIError as exc:  # ModelUnavailable included
            await exc.response(path)(scope, receive, send)
            return
        if entry is None:
            return  # the client left while its model loaded
        try:
            await entry.app(scope, replay(body, receive), send)
        finally:
            self.registry.release(entry)

    def _loaded(self, name: str) -> ModelEntry:
        entry = self.registry.entry(name)
        if entry.state is not ModelState.LOADED:
            raise ModelUnavailable(400, f"the model '{name}' is {entry.state.value}: a GET of its state (/props, "
                                        "/slots, /v1/dashboard...) never loads a model; send it a request or POST "
                                        "/models/load", "model_not_loaded")
        return entry

    @staticmethod
    async def _observe(app, scope: Scope, receive: Receive, send: Send) -> None:
        """A GET of a loaded model's state: answered by its app without holding the model, so a dashboard
        watching it never keeps it from unloading (its stream ends when the model's engine stops)."""
        await app(scope, receive, send)

    def _model_named(self, scope: Scope, body: bytes, pinned: str | None = None) -> str:
        """The model a request is for. A body that is not a JSON object (or names its model with anything but
        a string) is answered here, with the 400 its model's app would give, without loading a model for it.
        Under a model's own base URL (`pinned`) the path decides (SMG sends a rerank as model "unknown"); a body
        naming another served model is a 400."""
        named = None
        if body.strip():  # (an empty POST, as a slot erase may send, names no model)
            parsed = parse_json(body, self.limits)
            if not isinstance(parsed, dict):
                raise errors.invalid("The request body must be a JSON object")
            named = parsed.get("model")
            if named is not None and not isinstance(named, str):
                raise errors.invalid("model must be a string: the name of a served model", "model")
        if named is None:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            named = query.get("model", [None])[0]
        if pinned is not None:  # another served model is a mistake; any other name, as a single-model server
            if named is not None and named != pinned and named in self.registry.entries:
                raise errors.invalid(f"this URL ({MODEL_PREFIX}{pinned}/...) serves the model '{pinned}', and the "
                                     f"request names '{named}': send it to {MODEL_PREFIX}{named}/... or leave the "
                                     "model out", "model")
            return pinned
        if named is not None:
            return named
        if scope["method"] == "POST":
            return self.registry.default_name
        recent = self.registry.most_recent()
        if recent is None:
            raise errors.invalid(f"no model is loaded: name one with ?model= (served: {', '.join(self.registry.entries)})",
                                 "model")
        return recent.name

    async def _acquire_unless_gone(self, name: str, receive: Receive) -> ModelEntry | None:
        """The model, held; None when the client disconnected while waiting for it (nothing is held then)."""
        if self.registry.entry(name).state is ModelState.LOADED:
            return await self.registry.acquire(name)
        acquire = asyncio.ensure_future(self.registry.acquire(name))
        gone = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait((acquire, gone), return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()
            return None
        left = gone.done()
        gone.cancel()
        entry = acquire.result()  # ModelUnavailable raises here
        if left:
            self.registry.release(entry)  # the client left just as its model came
            return None
        return entry


MODEL_PREFIX = "/model/"  # /model/<name>/...: one model's own base URL


def _model_not_found(message: str) -> APIError:
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


def _is_front_route(scope: Scope) -> bool:
    path, method = scope["path"], scope["method"]
    if path in ("/health", "/metrics", "/v1/models", "/models", "/models/load", "/models/unload", "/"):
        return True
    if path.startswith("/webui/"):
        return True
    # one model's card; the shared Responses store
    return (path.startswith("/v1/models/") and method == "GET") or \
        (path.startswith("/v1/responses/") and method in ("GET", "DELETE"))


async def _disconnected(receive: Receive) -> bool:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True


def model_card(entry: ModelEntry) -> dict:
    """/v1/models' entry: OpenAI's fields, llama-server's router `status`, and what the model holds."""
    card = {"id": entry.name, "object": "model", "created": 0, "owned_by": "conveyor", "source": entry.spec.source,
            "status": {"value": entry.state.value, "pinned": entry.spec.pinned},
            "memory_bytes": dict(entry.memory) or None, "estimated_bytes": entry.estimate_bytes,
            "requests_in_flight": entry.num_active, "loads": entry.num_loads,
            "unloads": dict(entry.unloads)}
    if entry.state is ModelState.LOADING and entry.progress is not None:
        card["status"]["progress"] = entry.progress.view()
    if entry.error is not None:
        card["status"]["error"] = entry.error
    if entry.state is ModelState.LOADED and entry.app is not None:
        core = entry.app.state.engine.core
        card.update(root=core.model_name, max_model_len=core.max_model_len)
        card["status"]["load_seconds"] = round(entry.load_seconds or 0.0, 3)
    return card


def _front_app(multi: MultiModelApp, response_store: ResponseStore) -> FastAPI:
    registry, config = multi.registry, multi.config
    metrics = MultiModelMetrics(registry)
    limits = RequestLimits.from_config(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # NOTE: a full gc.collect() holds the GIL ~0.17 s here, scanning the ~420k objects the imports made, and
        # loads and unloads collect (a GGUF reader's metadata, an unloaded engine's cycles) while other models
        # stream. Frozen, those objects are left out of every later collection: it then takes microseconds.
        gc.collect()  # (what is garbage now is freed, not frozen)
        gc.freeze()
        app.state.tokenizer_prefetch = start_tokenizer_prefetch([e.spec for e in registry.entries.values()])
        registry.start()
        try:
            yield
        finally:
            await registry.close()
            stop_tokenizer_cache()

    app = FastAPI(title="conveyor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry, app.state.multi = registry, multi
    errors.install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while requests are taken; each model's state (and a loading one's progress)."""
        body = {"status": "shutting_down" if multi.draining else "ok",
                "models": {e.name: {"status": e.state.value, **({"progress": e.progress.view()}
                                                                  if e.state is ModelState.LOADING and e.progress else {})}
                           for e in registry.entries.values()},
                "memory": {"used_bytes": registry.used_bytes, "budget_bytes": registry.memory_budget,
                           "models_max": registry.max_loaded}}
        return JSONResponse(body, status_code=503 if multi.draining else 200)

    if config.metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE)

    if config.webui:
        add_webui_routes(app)

    api = APIRouter()

    @api.get("/v1/models")
    @api.get("/models")  # llama-server's router
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(e) for e in registry.entries.values()]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        return model_card(registry.entry(model_id))

    @api.post("/models/load")
    async def load(request: Request) -> dict:
        body = await parse_body(request, ModelActionRequest, limits)
        started = time.monotonic()
        entry = await registry.load(body.model)
        return {"success": True, "model": entry.name, "status": entry.state.value,
                "seconds": round(time.monotonic() - started, 3)}

    @api.post("/models/unload")
    async def unload(request: Request) -> dict:
        body = await parse_body(request, ModelActionRequest, limits)
        await registry.unload(body.model)
        return {"success": True, "model": body.model, "status": registry.entry(body.model).state.value}

    add_store_routes(api, response_store)
    app.include_router(api, dependencies=[Depends(api_key_check(config.api_key))])
    return app
