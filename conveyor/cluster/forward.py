"""Embeddings, rerank and score through the router: forwarded over HTTP to a node serving the model.

A pooling request is prefill only and its answer is one JSON body, so the router needs neither the
model's tokenizer nor the wire: it reads the body's `model`, picks a node serving it that said where
its own HTTP API listens (NodeInfoFrame.http_address) - a prefill node, else a decode node, the one
with the fewest requests in flight - and posts the same bytes to the same path there. The node answers
with its own code (server/apis/embeddings.py, rerank.py), so its vectors, scores, 400s and 503s reach
the client unchanged, byte for byte.

    the body's model          models.py's table, except that a name only nodes serve is forwarded
                              (no tokenizer is needed here); unknown under the table: 404 model_not_found
    no node online serving it 503 no_node (Retry-After), nothing sent
    the node fails            (cannot be reached, or the connection drops) marked unreachable, and the
                              request goes once more to another node; none answers: 502 node_failed
    the node answers 503      once more to another node; its 503 when none has room
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from conveyor.cluster.models import ModelDispatch, model_not_found
from conveyor.cluster.registry import Node
from conveyor.cluster.transport import CONNECT_TIMEOUT_S
from conveyor.server import errors
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits, parse_json

# Each path a node serves pooling on -> its wire API (the `api` label of conveyor_api_requests, as a node counts).
POOLING_ROUTES = {
    "/v1/embeddings": "embeddings", "/embedding": "embeddings", "/embeddings": "embeddings",
    "/v1/rerank": "rerank", "/rerank": "rerank", "/v1/reranking": "rerank", "/reranking": "rerank",
    "/v1/score": "score", "/score": "score",
}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"  # a node counts images with its own processor (count_tokens)
MAX_ATTEMPTS = 2  # the first node, then one other after a failure or a 503
_REQUEST_HEADERS = ("content-type", "authorization", "x-api-key", "x-priority")  # a node with --api-key checks too
_REPLY_HEADERS = ("content-type", "retry-after")


class PoolingForwarder:
    """`metrics`: RouterMetrics (router.py): api_requests per wire API, forwarded per endpoint and status."""

    def __init__(self, dispatch: ModelDispatch, limits: RequestLimits, metrics) -> None:
        self.dispatch = dispatch
        self.registry = dispatch.registry
        self.limits = limits
        self.metrics = metrics
        self._client: httpx.AsyncClient | None = None  # opened on first use, in the serving event loop

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def forward(self, http: Request, api: str) -> Response:
        self.metrics.api_requests.labels(api).inc()  # before validation, as a node counts
        body = await http.body()
        model = self.resolve(self._named(body))
        stats = self.registry.stats
        if self.pick(model) is None:
            stats.num_rejected_no_prefill += 1
            raise _no_node(model)
        stats.num_requests += 1
        stats.num_forwarded += 1
        try:
            answer = await self._attempts(http, body, model)
        except APIError as exc:
            stats.num_failed += 1
            self.metrics.forwarded.labels(model, http.url.path, str(exc.status)).inc()
            raise
        if answer.status_code < 400:
            stats.num_completed += 1
        else:
            stats.num_failed += 1
        self.metrics.forwarded.labels(model, http.url.path, str(answer.status_code)).inc()
        return answer

    async def count_tokens(self, http: Request, model: str) -> int:
        """A Messages count_tokens body with images, counted by a node of `model` (its processor expands each image
        to its whole token run, as its usage counts it); the node's 4xx is this request's."""
        if self.pick(model) is None:
            raise _no_node(model)
        answer = await self._attempts(http, await http.body(), model, path=COUNT_TOKENS_PATH)
        if answer.status_code != 200:
            raise _node_error(answer)
        return json.loads(answer.body)["input_tokens"]

    def resolve(self, name: str | None) -> str:
        """The id of the model a pooling request is for (see the module's table)."""
        dispatch = self.dispatch
        if name is None:
            return dispatch.default
        routed = dispatch.find(name)
        if routed is not None:
            return routed.model_id
        known = self._known_models()
        if name in known:
            return name
        if dispatch.lenient:  # as a chat naming an unknown model: the router's one model answers
            return dispatch.default
        raise model_not_found(f"The model '{name}' does not exist; this router serves: {', '.join(known)}")

    def pick(self, model: str, exclude: Sequence[Node] = ()) -> Node | None:
        """The online node of `model` with the fewest requests in flight (then the fewest sent): a prefill
        node, else a decode node; None when none said where its HTTP API listens."""
        skip = {id(n) for n in exclude}
        for pool in self.registry.pools():
            nodes = [n for n in pool.online(model) if n.http_address is not None and id(n) not in skip]
            if nodes:
                return min(nodes, key=lambda n: (n.num_in_flight, n.num_dispatched))
        return None

    async def _attempts(self, http: Request, body: bytes, model: str, path: str | None = None) -> Response:
        """The last node answer: the first node's, or another's after a failure or a 503; posted to `path` (by
        default the request's own)."""
        tried: list[Node] = []
        answer: httpx.Response | None = None
        failure = ""
        for attempt in range(MAX_ATTEMPTS):
            node = self.pick(model, exclude=tried)
            if node is None:
                break
            if attempt:
                self.registry.stats.num_retries += 1
            tried.append(node)
            try:
                answer = await self._post(node, http, body, path)
            except httpx.TransportError as exc:
                failure = self._failed(node, exc)
                continue
            if answer.status_code != 503:
                break
        if answer is None:
            raise APIError(502, f"{failure}; no other node serving '{model}' answered", "server_error",
                           code="node_failed")
        headers = {k: v for k in _REPLY_HEADERS if (v := answer.headers.get(k)) is not None}
        return Response(answer.content, status_code=answer.status_code, headers=headers)

    async def _post(self, node: Node, http: Request, body: bytes, path: str | None = None) -> httpx.Response:
        if self._client is None:
            # No read timeout: a thousand inputs take what they take (a chat stream has none either).
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                             limits=httpx.Limits(max_connections=None))
        url = f"http://{node.http_address}{path or http.url.path}"
        if path is None and http.url.query:
            url += f"?{http.url.query}"
        headers = {k: v for k in _REQUEST_HEADERS if (v := http.headers.get(k)) is not None}
        node.num_dispatched += 1
        node.num_in_flight += 1
        try:
            return await self._client.post(url, content=body, headers=headers)
        finally:
            node.num_in_flight -= 1

    def _failed(self, node: Node, exc: httpx.TransportError) -> str:
        reason = f"the {node.role} node at {node.http_address} failed: {exc or type(exc).__name__}"
        node.num_failures += 1
        pool = self.registry.prefill if node.role == "prefill" else self.registry.decode
        pool.mark_unreachable(node, f"forward: {reason}")  # the health probe brings it back when it answers
        return reason

    def _named(self, body: bytes) -> str | None:
        """The body's `model` (None when it names none); the node's own 400 for a body that is not a JSON object."""
        parsed = parse_json(body, self.limits)
        if not isinstance(parsed, dict):
            raise errors.invalid("The request body must be a JSON object")
        named = parsed.get("model")
        return named if isinstance(named, str) else None

    def _known_models(self) -> list[str]:
        """The routed models, and every model a node said it serves (online or not)."""
        names = dict.fromkeys(self.dispatch.models)
        for pool in self.registry.pools():
            for node in pool.nodes:
                names.update(dict.fromkeys(node.models if node.models is not None else (pool.default_model,)))
        return [name for name in names if name]


def _node_error(answer: Response) -> APIError:
    """A node's error answer (OpenAI's or Anthropic's shape) as this request's, status and message kept."""
    try:
        parsed = json.loads(answer.body)
        error = parsed["error"]
        return APIError(answer.status_code, error["message"], error.get("type", "invalid_request_error"),
                        error.get("param"), error.get("code"))
    except (ValueError, KeyError, TypeError):
        return APIError(answer.status_code, answer.body.decode(errors="replace")[:500] or "the node failed",
                        "server_error")


def _no_node(model: str) -> APIError:
    return APIError(503, f"No node serving '{model}' is available. Retry later.", "unavailable", code="no_node",
                    headers={"Retry-After": str(errors.RETRY_AFTER_SECONDS)})


def add_pooling_routes(router: APIRouter, forwarder: PoolingForwarder) -> None:
    """POST on each pooling path (llama-server's aliases included), forwarded to a node."""
    for path, api in POOLING_ROUTES.items():
        router.add_api_route(path, _route(forwarder, api), methods=["POST"], include_in_schema=False)


def _route(forwarder: PoolingForwarder, api: str):
    async def forward(request: Request) -> Response:
        return await forwarder.forward(request, api)
    return forward
