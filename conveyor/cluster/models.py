"""Which model a request through the router is for, and which nodes serve it.

The router fronts one or more models (`RoutedModel`: a tokenizer and chat template, and the id
the nodes serving it list in their GET /v1/models). Each has its own app: the OpenAI, Messages,
Responses and tokenizer routes over a RouterServing that dispatches only to the nodes serving
that model (router.py). `ModelDispatch` sends every request to the app of the model its body
names:

    (the body's `model`, else a GET's `?model=`)
    no `model`, or the default model's id / checkpoint name    -> the default model (as before)
    another routed model's id or checkpoint name                -> that model
    a model only nodes serve (the router holds no tokenizer)    -> 404 model_not_found, saying so
    anything else: one routed model and no --strict-model-name  -> the default model (as a single
                                                                   node answers any name)
                   otherwise                                    -> 404 model_not_found

Embeddings, rerank and score skip the apps: forward.py sends them to a node's own HTTP API by the same
table, except that a model only nodes serve is theirs (a pooling request needs no tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi import APIRouter
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor.cluster.registry import Registry
from conveyor.loading import Tokenizer
from conveyor.server.app import api_key_matches, invalid_api_key
from conveyor.server.asgi_body import read_body, replay
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits, parse_json


@dataclass(frozen=True)
class RoutedModel:
    """A model the router fronts: its tokenizer, its checkpoint name (a node's `root`) and the id clients
    and nodes name it by (--served-model-name, else the checkpoint name)."""

    tokenizer: Tokenizer
    name: str
    served_name: str | None = None

    @property
    def model_id(self) -> str:
        return self.served_name or self.name


def model_card(model: RoutedModel, registry: Registry) -> dict:
    """The router's /v1/models entry: OpenAI's fields, plus the online nodes serving the model, by role."""
    nodes = registry.models().get(model.model_id, {"prefill": [], "decode": []})
    return {"id": model.model_id, "object": "model", "created": 0, "owned_by": "conveyor", "root": model.name,
            "nodes": nodes}


def node_model_card(model_id: str, nodes: dict) -> dict:
    """The /v1/models entry of a model only nodes serve (an embedder, a reranker): the router forwards its
    pooling requests (forward.py) but holds no tokenizer for it, so its chats are 404s."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "conveyor", "root": model_id,
            "nodes": nodes, "routed": "pooling only"}


def _query_model(scope: Scope) -> str | None:
    """`?model=NAME`: how a GET (the page's /props, a tokenizer route) names its model."""
    return parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]


def model_not_found(message: str) -> APIError:
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


class ModelDispatch:
    """The ASGI app behind every route but the router's own: the app of the model the request names.
    `apps` maps each routed model's id to its app; the first model is the default."""

    def __init__(self, models: list[RoutedModel], apps: dict[str, ASGIApp], registry: Registry,
                 limits: RequestLimits, api_key: str | None, strict_model_name: bool) -> None:
        self.models = {m.model_id: m for m in models}
        self.apps = apps
        self.registry = registry
        self.limits = limits
        self.api_key = api_key
        self.default = models[0].model_id
        self.lenient = len(models) == 1 and not strict_model_name
        self._ids = {name: m.model_id for m in reversed(models) for name in (m.name, m.model_id)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.apps[self.default](scope, receive, send)
            return
        try:
            if self.api_key is not None and not api_key_matches(_headers(scope), self.api_key):
                raise invalid_api_key()  # before saying which models exist
            body = await read_body(scope, receive)
            app = self.apps[self.resolve(self._named(body) or _query_model(scope))]
        except APIError as exc:  # a 413 from the body-size cap included
            await exc.response(scope["path"])(scope, receive, send)
            return
        await app(scope, replay(body, receive), send)

    def find(self, name: str) -> RoutedModel | None:
        """The routed model with this id or checkpoint name."""
        model_id = self._ids.get(name)
        return self.models[model_id] if model_id is not None else None

    def resolve(self, name: str | None) -> str:
        """The id of the routed model `name` names (see the module's table); model_not_found otherwise."""
        if name is None:
            return self.default
        found = self.find(name)
        if found is not None:
            return found.model_id
        served = self.registry.models().get(name)
        if served is not None:
            nodes = ", ".join(served["prefill"] + served["decode"])
            raise model_not_found(f"The model '{name}' is served by {nodes}, but this router holds no tokenizer "
                                  f"for it; it routes: {', '.join(self.models)}")
        if self.lenient:
            return self.default
        raise self.unknown(name)

    def unknown(self, name: str) -> APIError:
        return model_not_found(f"The model '{name}' does not exist; this router serves: {', '.join(self.models)}")

    def _named(self, body: bytes) -> str | None:
        """The body's `model`; None when it names none (or is not JSON: its model's app answers that 400)."""
        if not body.strip():
            return None
        try:
            parsed = parse_json(body, self.limits)
        except APIError:
            return None
        named = parsed.get("model") if isinstance(parsed, dict) else None
        return named if isinstance(named, str) else None


def add_model_routes(router: APIRouter, dispatch: ModelDispatch) -> None:
    """GET /v1/models (each routed model once, with the online nodes serving it; then the models only nodes
    serve, whose pooling requests the router forwards) and /v1/models/{id}."""

    @router.get("/v1/models")
    async def list_models() -> dict:
        cards = [model_card(m, dispatch.registry) for m in dispatch.models.values()]
        cards += [node_model_card(model_id, nodes) for model_id, nodes in _node_only(dispatch).items()]
        return {"object": "list", "data": cards}

    @router.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        found = dispatch.find(name)
        if found is not None:
            return model_card(found, dispatch.registry)
        nodes = _node_only(dispatch).get(name)
        if nodes is None:
            raise dispatch.unknown(name)
        return node_model_card(name, nodes)


def _node_only(dispatch: ModelDispatch) -> dict[str, dict]:
    """Models the online nodes serve that the router routes no chats for, with their nodes by role."""
    return {model_id: nodes for model_id, nodes in sorted(dispatch.registry.models().items())
            if dispatch.find(model_id) is None}


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
