"""Router role: a model-free OpenAI-compatible HTTP front over a prefill pool and a decode pool.

It loads only the tokenizer and chat template, tokenizes each request, dispatches it
(remote.py) and merges the prefill node's first token with the relayed continuation into
one response, shaped exactly as a single node shapes it (server/responses.py): SSE or JSON,
usage from the workers' own token counts, finish_reason as the engine reports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conveyor.cluster.dashboard import router_snapshot
from conveyor.cluster.health import HealthMonitor
from conveyor.cluster.registry import Registry
from conveyor.cluster.remote import DispatchError, RemoteRequest, cancel_quietly, no_decode, no_prefill, overloaded
from conveyor.cluster.wire import SamplingWire
from conveyor.config import ClusterConfig, ServerConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.loading import Tokenizer
from conveyor.server import errors
from conveyor.server.app import _api_key_check, add_dashboard_routes, add_openai_routes
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits
from conveyor.server.middleware import BodySizeLimit, CatchAll
from conveyor.server.metrics import CONTENT_TYPE
from conveyor.server.openai_serving import CLIENT_CLOSED_REQUEST, SSEResponse, _logit_bias, _priority
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from conveyor.server.responses import ChoiceState, ResponseHeader, TokenText, chunk, full_response, sse, usage_chunk
from conveyor.server.streams import wait_for_disconnect
from conveyor.server.structured_output import plan_chat, reply_starts_thinking
from conveyor.server.webui import add_webui_routes

logger = logging.getLogger(__name__)

_WIRE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "stop_token_ids", "seed")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: Registry) -> None:
        self.prometheus = CollectorRegistry()
        self.prometheus.register(_RegistryCollector(registry))
        self.ttft = Histogram("conveyor_router_time_to_first_token_seconds", "Arrival at the router to the first "
                              "token", buckets=_LATENCY_BUCKETS, registry=self.prometheus)
        self.e2e = Histogram("conveyor_router_e2e_request_latency_seconds", "Arrival at the router to the last delta",
                             buckets=_LATENCY_BUCKETS, registry=self.prometheus)
        self.finished = Counter("conveyor_router_requests_finished", "Routed requests by finish_reason",
                                ["finish_reason"], registry=self.prometheus)

    def render(self) -> bytes:
        return generate_latest(self.prometheus)


class _RegistryCollector:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self):
        up = GaugeMetricFamily("conveyor_router_node_up", "1 while the node is online", labels=["role", "address"])
        dispatched = CounterMetricFamily("conveyor_router_dispatched", "Attempts sent to (or naming) the node",
                                         labels=["role", "address"])
        in_flight = GaugeMetricFamily("conveyor_router_node_in_flight", "Requests in flight on the prefill node",
                                      labels=["role", "address"])
        for pool in self.registry.pools():
            for node in pool.nodes:
                up.add_metric([node.role, node.address], 1 if node.online else 0)
                dispatched.add_metric([node.role, node.address], node.num_dispatched)
                in_flight.add_metric([node.role, node.address], node.num_in_flight)
        yield up
        yield dispatched
        yield in_flight
        for name, value in self.registry.stats.view().items():
            yield CounterMetricFamily(f"conveyor_router_{name}", f"Router routing count: {name}", value=value)


class RouterServing:
    def __init__(self, registry: Registry, tokenizer: Tokenizer, model_id: str, model_name: str,
                 max_queue_depth: int, metrics: RouterMetrics, reasoning_parser: str = "auto") -> None:
        self.registry = registry
        self.reasoning_parser = reasoning_parser
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_names = {model_id, model_name}
        self.max_queue_depth = max_queue_depth
        self.metrics = metrics
        self.token_text = TokenText(tokenizer)
        self.num_awaiting_first_token = 0

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           "invalid_request_error", "model", "model_not_found")

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, http: Request, body: ChatCompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        _check_supported(body, logprobs=body.logprobs)
        # The node's own planning: the same history (earlier tool_calls, tool results), the same 400s
        # (tool_choice without tools) and the same reply parsing (<think> -> reasoning_content).
        plan = plan_chat(body, self.tokenizer, self.reasoning_parser)
        try:
            text = self.tokenizer.apply_chat_template(plan.messages, add_generation_prompt=True, tools=plan.tools)
        except ValueError as exc:
            raise errors.invalid(str(exc), "messages") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_id, chat=True,
                                want_logprobs=False, parsing=reply_starts_thinking(plan.parsing, text))
        return await self._run(http, body, header, prompt, max_tokens, arrival, {"prompt": "messages"})

    async def completion(self, http: Request, body: CompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        _check_supported(body, logprobs=body.logprobs is not None)
        if body.best_of is not None and body.best_of != body.n:
            raise errors.invalid("best_of is not supported (omit it or set it equal to n)", "best_of")
        prompts = body.prompts()
        if len(prompts) != 1:
            raise errors.invalid("the router serves one prompt per request (send a batch as separate requests)",
                                 "prompt")
        prompt = self.tokenizer.encode(prompts[0]) if isinstance(prompts[0], str) else list(prompts[0])
        header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_id, chat=False,
                                want_logprobs=False)
        return await self._run(http, body, header, prompt, body.max_tokens, arrival, {"messages": "prompt"})

    # -- running ---------------------------------------------------------------------------
    def _admit(self) -> None:
        """Before any dispatch: a pool with no node online, or a router queue at its bound, is a 503."""
        stats = self.registry.stats
        num_prefill = len(self.registry.prefill.online())
        if not num_prefill:
            stats.num_rejected_no_prefill += 1
            raise _api_error(no_prefill())
        if not self.registry.decode.online():
            stats.num_rejected_no_decode += 1
            raise _api_error(no_decode())
        if self.num_awaiting_first_token >= self.max_queue_depth * num_prefill:
            stats.num_rejected_overloaded += 1
            raise _api_error(overloaded())

    async def _run(self, http: Request, body: SamplingFields, header: ResponseHeader, prompt: list[int],
                   max_tokens: int | None, arrival: float, params: dict[str, str]) -> Response:
        if not prompt:
            raise errors.invalid("the prompt is empty", params.get("prompt", "prompt"))
        self._admit()
        self.registry.stats.num_requests += 1
        remote = RemoteRequest(self.registry, uuid.uuid4().hex[:16], prompt, _sampling(body, max_tokens),
                               priority=_priority(body, http), cache_prompt=body.cache_prompt)
        deltas = remote.stream()
        first = await self._first(deltas, arrival, params)  # 4xx/5xx here, before any response byte
        if body.stream:
            return SSEResponse(self._stream(deltas, first, header, body.include_usage, arrival))
        return await self._complete(http, deltas, first, header, arrival)

    async def _first(self, deltas: AsyncIterator[RequestOutput], arrival: float, params: dict[str, str]):
        self.num_awaiting_first_token += 1
        try:
            first = await deltas.__anext__()
        except DispatchError as exc:
            self.registry.stats.num_failed += 1
            if exc.code == "invalid_request" and exc.param in params:
                exc.param = params[exc.param]
            raise _api_error(exc) from None
        finally:
            self.num_awaiting_first_token -= 1
        self.metrics.ttft.observe(time.monotonic() - arrival)
        return first

    def _finish(self, out: RequestOutput, arrival: float) -> None:
        self.metrics.e2e.observe(time.monotonic() - arrival)
        self.metrics.finished.labels(out.finish_reason or "unknown").inc()
        stats = self.registry.stats
        if out.finish_reason == "error":
            stats.num_failed += 1
        else:
            stats.num_completed += 1

    async def _complete(self, http: Request, deltas, first: RequestOutput, header: ResponseHeader,
                        arrival: float) -> Response:
        choice = ChoiceState(0)

        async def collect() -> None:
            out = first
            choice.add(out)
            while not out.finished:
                out = await deltas.__anext__()
                choice.add(out)
            self._finish(out, arrival)

        task = asyncio.create_task(collect())
        gone = asyncio.create_task(wait_for_disconnect(http.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            client_left = not task.done()
            if client_left:
                await cancel_quietly(task)
            await deltas.aclose()  # closes the prefill connection: the nodes cancel and free their blocks
        if client_left:
            self.registry.stats.num_cancelled += 1
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        task.result()
        if choice.finish_reason == "error":
            raise errors.generation_failed(choice.error or "generation failed")
        return JSONResponse(full_response(header, [choice], self.token_text, 1))

    async def _stream(self, deltas, first: RequestOutput, header: ResponseHeader, include_usage: bool,
                      arrival: float) -> AsyncIterator[str]:
        choice = ChoiceState(0)
        finished = False
        parser = header.parsing.parser() if header.parses else None  # type: ignore[union-attr]
        try:
            if header.chat:
                yield sse(chunk(header, 0, "", [], self.token_text, role=True, with_usage=include_usage))
            out = first
            while True:
                choice.add(out, keep=False)
                parsed = None
                if parser is not None:  # as a node streams it (openai_serving.py): text held until decided
                    parsed = parser.feed(out.new_text)
                    if out.finished:
                        parsed += parser.finish(truncated=out.finish_reason == "length")
                if (out.new_text and (parsed is None or not parsed.is_empty)) or out.finished:
                    payload = chunk(header, 0, out.new_text, [], self.token_text,
                                    finish_reason=out.finish_reason if out.finished else None,
                                    with_usage=include_usage, parsed=parsed)
                    if out.finish_reason == "error":
                        payload["error"] = errors.generation_failed(out.error or "generation failed").body()["error"]
                    yield sse(payload)
                if out.finished:
                    finished = True
                    self._finish(out, arrival)
                    break
                out = await deltas.__anext__()
            if include_usage:
                yield sse(usage_chunk(header, [choice], 1))
            yield sse("[DONE]")
        finally:
            if not finished:
                self.registry.stats.num_cancelled += 1
            await deltas.aclose()


def _check_supported(body: SamplingFields, logprobs: bool) -> None:
    """What the wire does not carry is refused, not silently dropped."""
    if body.n != 1:
        raise errors.invalid("the router serves n=1 only (send separate requests)", "n")
    if logprobs:
        raise errors.invalid("logprobs are not supported through the router", "logprobs")
    # Grammars and tools are compiled by a single node's engine; the handoff does not carry a matcher.
    constrained = [name for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "tools")
                   if getattr(body, name, None) is not None]
    if body.response_format is not None and body.response_format.type != "text":
        constrained.append("response_format")
    if constrained:
        raise errors.invalid(f"{constrained[0]} is not supported through the router (structured output and tools "
                             "run on a single node: docs/distributed.md)", constrained[0])


def _sampling(body: SamplingFields, max_tokens: int | None) -> SamplingWire:
    fields = {name: value for name in _WIRE_FIELDS if (value := getattr(body, name)) is not None}
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingWire(max_tokens=max_tokens, logit_bias=_logit_bias(body.logit_bias), stop=stop,
                        ignore_eos=body.ignore_eos, **fields)


def _api_error(exc: DispatchError) -> APIError:
    headers = {"Retry-After": str(errors.RETRY_AFTER_SECONDS)} if exc.retry_after else None
    return APIError(exc.status, exc.message, exc.type, exc.param, exc.code, headers=headers)


def create_router_app(tokenizer: Tokenizer, model_name: str, cluster: ClusterConfig,
                      server: ServerConfig | None = None, max_queue_depth: int = 32) -> FastAPI:
    server = server or ServerConfig()
    registry = Registry(cluster.prefill_peer_list, cluster.decode_peer_list)
    monitor = HealthMonitor(registry, cluster.health_check_interval)
    metrics = RouterMetrics(registry)
    model_id = server.served_model_name or model_name
    serving = RouterServing(registry, tokenizer, model_id, model_name, max_queue_depth, metrics,
                            server.reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await monitor.probe_all()  # know the pools before the first request
        monitor.start()
        try:
            yield
        finally:
            await monitor.stop()

    app = FastAPI(title="conveyor router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry, app.state.monitor, app.state.serving = registry, monitor, serving
    errors.install_handlers(app)
    limits = RequestLimits.from_config(server)  # the same request limits as a single node
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_middleware(CatchAll)

    @app.get("/health")
    async def health() -> JSONResponse:
        num_prefill, num_decode = len(registry.prefill.online()), len(registry.decode.online())
        ok = num_prefill > 0 and num_decode > 0
        body = {"status": "ok" if ok else "unavailable", "role": "router",
                "prefill_online": num_prefill, "decode_online": num_decode}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/router/stats")
    async def router_stats() -> dict:
        return {**registry.view(), "health_check_rounds": monitor.num_rounds,
                "awaiting_first_token": serving.num_awaiting_first_token}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "conveyor", "root": model_name}

    if server.webui:
        add_webui_routes(app)
    api = APIRouter()
    add_openai_routes(api, serving, limits, model_card)
    add_dashboard_routes(api, lambda: router_snapshot(registry, metrics, serving, model_id), lambda: False)
    app.include_router(api, dependencies=[Depends(_api_key_check(server.api_key))])
    return app


