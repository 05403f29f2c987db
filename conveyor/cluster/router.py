"""Router role: a model-free OpenAI-compatible HTTP front over a prefill pool and a decode pool.

It loads only the tokenizer and chat template of each model it fronts and plans each request as a
node does (server/request_plan.py: the same prompt, per-choice sampling, grammar and 400s),
dispatches each choice to nodes serving the request's model (remote.py: grammar, logprobs, stops
and seed travel in the frames) and answers through the node's own reply code (server/reply.py)
over a RemoteGroup of the relayed deltas: the same SSE or JSON, reply parsing, logprobs, usage
from the workers' token counts, and finish_reason as the engine reports it. Which model a request
is for, and the app per model, are models.py's; embeddings, rerank and score go to a node's own HTTP
API (forward.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conveyor.cluster.dashboard import router_snapshot
from conveyor.cluster.forward import PoolingForwarder, add_pooling_routes
from conveyor.cluster.health import HealthMonitor
from conveyor.cluster.images import images_to_wire
from conveyor.cluster.models import ModelDispatch, RoutedModel, add_model_routes, model_card
from conveyor.cluster.node import to_wire
from conveyor.cluster.registry import Registry
from conveyor.cluster.remote import DispatchError, RemoteRequest, no_decode, no_prefill, overloaded
from conveyor.cluster.wire import ImageWire
from conveyor.config import ClusterConfig, ServerConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError
from conveyor.loading import Tokenizer
from conveyor.multimodal.image_fetch import ImagePolicy
from conveyor.server import errors
from conveyor.server.apis import add_agent_routes, chat_completions
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.app import api_key_check, add_dashboard_routes, add_tokenizer_routes
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits
from conveyor.server.metrics import CONTENT_TYPE, api_requests_counter
from conveyor.server.middleware import BodySizeLimit, CatchAll
from conveyor.server.front import ServingFront
from conveyor.server.request_plan import RequestPlan, priority
from conveyor.server.webui import add_webui_routes

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: Registry) -> None:
        self.prometheus = CollectorRegistry()
        self.prometheus.register(_RegistryCollector(registry))
        # Per model (its id, as clients name it), as a multi-model node labels its series.
        self.ttft = Histogram("conveyor_router_time_to_first_token_seconds", "Arrival at the router to the first "
                              "token", ["model"], buckets=_LATENCY_BUCKETS, registry=self.prometheus)
        self.e2e = Histogram("conveyor_router_e2e_request_latency_seconds", "Arrival at the router to the last delta",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=self.prometheus)
        self.finished = Counter("conveyor_router_requests_finished", "Routed requests by model and finish_reason",
                                ["model", "finish_reason"], registry=self.prometheus)
        self.api_requests = api_requests_counter(self.prometheus)
        self.forwarded = Counter("conveyor_router_forwarded_requests", "Embeddings, rerank and score requests "
                                 "forwarded to a node, by model, endpoint and the status answered",
                                 ["model", "endpoint", "status"],
                                 registry=self.prometheus)

    def render(self) -> bytes:
        return generate_latest(self.prometheus)


class _RegistryCollector:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self):
        up = GaugeMetricFamily("conveyor_router_node_up", "1 while the node is online", labels=["role", "address"])
        dispatched = CounterMetricFamily("conveyor_router_dispatched", "Attempts sent to (or naming) the node",
                                         labels=["role", "address"])
        in_flight = GaugeMetricFamily("conveyor_router_node_in_flight", "Requests in flight on the node (routed to "
                                      "a prefill node, or forwarded to its HTTP API)", labels=["role", "address"])
        for pool in self.registry.pools():
            for node in pool.nodes:
                up.add_metric([node.role, node.address], 1 if node.online else 0)
                dispatched.add_metric([node.role, node.address], node.num_dispatched)
                in_flight.add_metric([node.role, node.address], node.num_in_flight)
        yield up
        yield dispatched
        yield in_flight
        online = GaugeMetricFamily("conveyor_router_model_nodes_online", "Online nodes serving the model, by role",
                                   labels=["model", "role"])
        for model, by_role in sorted(self.registry.models().items()):
            for role in ("prefill", "decode"):
                online.add_metric([model, role], len(by_role[role]))
        yield online
        for name, value in self.registry.stats.view().items():
            yield CounterMetricFamily(f"conveyor_router_{name}", f"Router routing count: {name}", value=value)


class RouterServing(ServingFront):
    """Plans exactly as a node plans (server/front.py, request_plan.py); starts on the cluster's nodes that
    serve its model (`model_id`)."""

    def __init__(self, registry: Registry, tokenizer: Tokenizer, model_id: str, model_name: str,
                 max_queue_depth: int, metrics: RouterMetrics, reasoning_parser: str = "auto",
                 template_kwargs: dict | None = None, strict_model_name: bool = False,
                 image_policy: ImagePolicy | None = None) -> None:
        super().__init__(tokenizer, model_id, model_name, reasoning_parser, template_kwargs, strict_model_name,
                         image_policy)
        self.registry = registry
        self.max_queue_depth = max_queue_depth
        self.metrics = metrics
        self.num_awaiting_first_token = 0
        # How a count with images is asked of a node (forward.py; set once the router's forwarder exists): the
        # router has no image processor, and an image's token run depends on its size and the processor's settings.
        self.count_on_node: Callable[[Request, str], Awaitable[int]] | None = None

    # Images: decoded and checked here with a node's code and limits (the same 400s), rendered with the marker the
    # model's prefill nodes say (their NodeInfoFrame), sent to the prefill node as RGB (cluster/images.py).
    def image_refusal(self) -> str | None:
        """A node's 400 when the model's online prefill nodes have no tower (none online: the 503 comes later)."""
        nodes = self.registry.prefill.online(self.model_id)
        return super().image_refusal() if nodes and self.image_marker() is None else None

    def image_marker(self) -> str | None:
        nodes = self.registry.prefill.online(self.model_id)
        return next((n.image_marker for n in nodes if n.image_marker is not None), None)

    async def count_prompt_tokens(self, plan: RequestPlan, http: Request | None = None) -> int:
        if plan.images and http is not None and self.count_on_node is not None:
            return await self.count_on_node(http, self.model_id)
        return await super().count_prompt_tokens(plan, http)

    # -- running ---------------------------------------------------------------------------
    def _admit(self, num_requests: int = 1) -> None:
        """Before any dispatch: a pool with no node online serving the model, or a router queue at its bound
        (per model), is a 503."""
        stats, model = self.registry.stats, self.model_id
        num_prefill = len(self.registry.prefill.online(model))
        if not num_prefill:
            stats.num_rejected_no_prefill += 1
            raise _api_error(no_prefill(model))
        if not self.registry.decode.online(model):
            stats.num_rejected_no_decode += 1
            raise _api_error(no_decode(model))
        if self.num_awaiting_first_token + num_requests > self.max_queue_depth * num_prefill:
            stats.num_rejected_overloaded += 1
            raise _api_error(overloaded())

    def _remotes(self, http: Request, plan: RequestPlan, images: list[ImageWire]) -> list[RemoteRequest]:
        """n requests per prompt with the node's per-choice sampling (validated here, with a node's 400s);
        max_tokens stays unset when the body leaves it, for the prefill node's context window to fill."""
        body = plan.body
        rank = priority(body, http)
        try:  # (the value only stands in for validation: the wire carries the body's max_tokens)
            choices = [plan.sampling(i, plan.max_tokens if plan.max_tokens is not None else 1) for i in range(plan.n)]
        except InvalidRequestError as exc:
            raise plan.error(exc) from None
        if not all(plan.prompts):
            raise plan.invalid("the prompt is empty", "prompt")
        base_id = uuid.uuid4().hex[:12]
        remotes = []
        for p, prompt in enumerate(plan.prompts):
            for i, params in enumerate(choices):
                wire = msgspec.structs.replace(to_wire(params), max_tokens=plan.max_tokens)
                remotes.append(RemoteRequest(self.registry, f"{base_id}-{p * plan.n + i}", prompt, wire,
                                             priority=rank, cache_prompt=body.cache_prompt, model=self.model_id,
                                             images=images))
        return remotes

    async def start(self, http: Request, plan: RequestPlan, arrival: float) -> RemoteGroup:
        images = await asyncio.to_thread(images_to_wire, plan.images) if plan.images else []
        remotes = self._remotes(http, plan, images)
        self._admit(len(remotes))
        self.registry.stats.num_requests += len(remotes)
        group = RemoteGroup(self, remotes, arrival)
        await group.start(plan)  # 4xx/5xx here, before any response byte
        return group


class RemoteGroup:
    """The routed requests of one HTTP response, as the node's RequestGroup (server/streams.py) is for
    engine requests: one pump per member relays its deltas into one queue; close() ends them all."""

    def __init__(self, serving: RouterServing, remotes: list[RemoteRequest], arrival: float) -> None:
        self.serving = serving
        self.arrival = arrival
        self.request_ids = [r.request_id for r in remotes]
        self._unfinished = set(range(len(remotes)))
        self._merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._firsts: list[asyncio.Future[RequestOutput]] = [loop.create_future() for _ in remotes]
        self._pumps = [asyncio.create_task(self._pump(i, r.stream())) for i, r in enumerate(remotes)]
        self._started = False

    @property
    def done(self) -> bool:
        return not self._unfinished

    async def start(self, plan: RequestPlan) -> None:
        """Wait for every member's first delta: a refusal (DispatchError) becomes this response's error."""
        serving = self.serving
        serving.num_awaiting_first_token += len(self._firsts)
        try:
            results = await asyncio.gather(*self._firsts, return_exceptions=True)
        except BaseException:
            self.close()
            raise
        finally:
            serving.num_awaiting_first_token -= len(self._firsts)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            self.close()
            serving.registry.stats.num_failed += 1
            if isinstance(failed, DispatchError):
                if failed.status == 400 and failed.code == "invalid_request":  # a node's 400, named as a node names it
                    raise plan.invalid(failed.message, failed.param) from None
                raise _api_error(failed) from None
            raise failed
        self._started = True

    async def _pump(self, index: int, deltas: AsyncIterator[RequestOutput]) -> None:
        first = self._firsts[index]
        try:
            try:
                out = await deltas.__anext__()
            except Exception as exc:  # noqa: BLE001 - the refusal is start()'s to raise
                first.set_exception(exc)
                return
            first.set_result(out)
            self.serving.metrics.ttft.labels(self.serving.model_id).observe(time.monotonic() - self.arrival)
            self._merged.put_nowait((index, out))
            while not out.finished:
                try:
                    out = await deltas.__anext__()
                except Exception as exc:  # noqa: BLE001 - a bug costs this member, never a hung response
                    logger.exception("router: relay failed")
                    out = RequestOutput(self.request_ids[index], finished=True, finish_reason="error",
                                        error=f"router relay failed: {exc}")
                self._merged.put_nowait((index, out))
        finally:
            if not first.done():
                first.cancel()
            await deltas.aclose()  # closes the prefill connection: the nodes cancel and free their blocks

    async def next(self) -> tuple[int, RequestOutput]:
        index, out = await self._merged.get()
        if out.finished:
            self._unfinished.discard(index)
            self._finish(out)
            if self.done:
                self.close()
        return index, out

    def _finish(self, out: RequestOutput) -> None:
        metrics, stats = self.serving.metrics, self.serving.registry.stats
        metrics.e2e.labels(self.serving.model_id).observe(time.monotonic() - self.arrival)
        metrics.finished.labels(self.serving.model_id, out.finish_reason or "unknown").inc()
        if out.finish_reason == "error":
            stats.num_failed += 1
        else:
            stats.num_completed += 1

    def close(self) -> None:
        if self._started and self._unfinished:
            self.serving.registry.stats.num_cancelled += 1
        self._unfinished.clear()
        for pump in self._pumps:
            pump.cancel()


def _api_error(exc: DispatchError) -> APIError:
    headers = {"Retry-After": str(errors.RETRY_AFTER_SECONDS)} if exc.retry_after else None
    return APIError(exc.status, exc.message, exc.type, exc.param, exc.code, headers=headers)


def create_router_app(tokenizer: Tokenizer, model_name: str, cluster: ClusterConfig,
                      server: ServerConfig | None = None, max_queue_depth: int = 32,
                      more_models: Sequence[RoutedModel] = ()) -> FastAPI:
    """The router for the model of `tokenizer` (named `model_name`, or --served-model-name), the default,
    and for `more_models`: each routed to the nodes that serve it."""
    server = server or ServerConfig()
    models = [RoutedModel(tokenizer, model_name, server.served_model_name), *more_models]
    registry = Registry(cluster.prefill_peer_list, cluster.decode_peer_list, default_model=models[0].model_id)
    monitor = HealthMonitor(registry, cluster.health_check_interval)
    metrics = RouterMetrics(registry)
    servings = [RouterServing(registry, m.tokenizer, m.model_id, m.name, max_queue_depth, metrics,
                              server.reasoning_parser, server.template_kwargs, server.strict_model_name,
                              ImagePolicy.from_config(server))
                for m in models]
    limits = RequestLimits.from_config(server)  # the same request limits as a single node
    store = ResponseStore(server.responses_store_max, server.responses_store_max_bytes)  # shared: GET finds any
    apps = {m.model_id: _model_app(m, serving, registry, limits, server, store) for m, serving in zip(models, servings)}
    dispatch = ModelDispatch(models, apps, registry, limits, server.api_key, server.strict_model_name)
    forwarder = PoolingForwarder(dispatch, limits, metrics)
    for serving in servings:
        serving.count_on_node = forwarder.count_tokens

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await monitor.probe_all()  # know the pools (and what each node serves) before the first request
        monitor.start()
        try:
            yield
        finally:
            await forwarder.stop()
            await monitor.stop()

    app = FastAPI(title="conveyor router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry, app.state.monitor, app.state.serving = registry, monitor, servings[0]
    errors.install_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_middleware(CatchAll)

    def num_awaiting() -> int:
        return sum(s.num_awaiting_first_token for s in servings)

    @app.get("/health")
    async def health() -> JSONResponse:
        num_prefill, num_decode = len(registry.prefill.online()), len(registry.decode.online())
        ok = num_prefill > 0 and num_decode > 0
        body = {"status": "ok" if ok else "unavailable", "role": "router",
                "prefill_online": num_prefill, "decode_online": num_decode,
                "models": {model: {"prefill_online": len(registry.prefill.online(model)),
                                   "decode_online": len(registry.decode.online(model))} for model in apps}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/router/stats")
    async def router_stats() -> dict:
        return {**registry.view(), "health_check_rounds": monitor.num_rounds, "awaiting_first_token": num_awaiting()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if server.webui:
        add_webui_routes(app)
    api = APIRouter()
    add_model_routes(api, dispatch)
    add_pooling_routes(api, forwarder)  # embeddings, rerank, score: to a node of the model, over HTTP
    def snapshot(model: str | None) -> dict:  # ?model=: one routed model's TTFT and awaiting count
        chosen = dispatch.default if model is None else dispatch.resolve(model)
        awaiting = sum(s.num_awaiting_first_token for s in servings if s.model_id == chosen)
        return router_snapshot(registry, metrics, awaiting, chosen)

    add_dashboard_routes(api, snapshot, lambda: False)
    app.include_router(api, dependencies=[Depends(api_key_check(server.api_key))])
    # Every other route: the app of the model the request names (mounted last, so the routes above win).
    app.mount("/", dispatch)
    return app


def _model_app(model: RoutedModel, serving: RouterServing, registry: Registry, limits: RequestLimits,
               server: ServerConfig, store: ResponseStore) -> FastAPI:
    """One model's routes: the OpenAI, Messages, Responses and tokenizer APIs over its RouterServing."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    errors.install_handlers(app)
    app.add_middleware(CatchAll)  # inside this app's own last-resort handler, which would answer in plain text
    api = APIRouter()
    chat_completions.add_routes(api, serving, limits, lambda: model_card(model, registry))
    add_agent_routes(api, serving, limits, server, store)
    # The model's vocabulary is not loaded here: ids are checked against the tokenizer's (the same for our models).
    add_tokenizer_routes(api, serving.token_text, model.tokenizer.vocab_size, limits)
    app.include_router(api, dependencies=[Depends(api_key_check(server.api_key))])
    return app
