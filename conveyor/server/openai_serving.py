"""OpenAI request -> engine requests -> OpenAI response (JSON or SSE), on a node.

Everything a request can get wrong is checked before the engine sees it: the model name here,
the chat template and sampling parameters in its plan (request_plan.py, which the router shares),
the grammar and the context window here. Admission (503) is the last step before the response
starts; reply.py writes the response.
"""

from __future__ import annotations

import asyncio
import functools
import uuid

from fastapi import Request as HTTPRequest

from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from conveyor.engine.request import Request
from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_fetch import ImagePolicy
from conveyor.server import errors
from conveyor.server.metrics import ServerMetrics
from conveyor.server.front import ServingFront
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.request_plan import RequestPlan, priority
from conveyor.server.streams import RequestGroup


class OpenAIServing(ServingFront):
    def __init__(self, engine: AsyncEngine, model_id: str, metrics: ServerMetrics,
                 reasoning_parser: str = "auto", template_kwargs: dict | None = None,
                 strict_model_name: bool = False, image_policy: ImagePolicy | None = None) -> None:
        super().__init__(engine.core.tokenizer, model_id, engine.core.model_name, reasoning_parser, template_kwargs,
                         strict_model_name, image_policy)
        self.engine = engine
        self.core = engine.core
        self.metrics = metrics
        self.active: set[RequestGroup] = set()
        self.draining = False

    async def plan_chat(self, body: ChatCompletionRequest) -> RequestPlan:
        self._check_generates()
        return await super().plan_chat(body)

    def image_refusal(self) -> str | None:
        return None if self.core.vision is not None else super().image_refusal()

    def image_marker(self) -> str | None:
        return self.core.vision.processor.image_marker if self.core.vision is not None else None

    async def count_prompt_tokens(self, plan: RequestPlan, http: HTTPRequest | None = None) -> int:
        if not plan.images or self.core.vision is None:
            return await super().count_prompt_tokens(plan, http)
        try:
            expanded = await asyncio.to_thread(self.core.vision.processor.expand, plan.prompts[0], plan.images)
        except InvalidRequestError as exc:
            raise plan.error(exc) from None
        return len(expanded.token_ids)

    def plan_completion(self, body: CompletionRequest) -> RequestPlan:
        self._check_generates()
        return super().plan_completion(body)

    def _check_generates(self) -> None:
        """An embedding or reranking engine answers no completions: a 400 naming its routes, before any planning."""
        try:
            self.core.check_generates()
        except InvalidRequestError as exc:
            raise errors.invalid(str(exc), exc.param) from None

    async def start(self, http: HTTPRequest, plan: RequestPlan, arrival: float) -> RequestGroup:
        requests = await self._make_requests(plan, priority(plan.body, http))
        return self.admit(requests, arrival)

    # -- plan -> engine requests -----------------------------------------------------------
    async def _make_requests(self, plan: RequestPlan, priority: int) -> list[Request]:
        """n requests per prompt, all validated before any is submitted. Choice index = prompt * n + i.
        Sampling values first, then the grammar, then each request against the context window and pool:
        the order a routed request meets them (router, then the prefill node)."""
        core = self.core
        samplings = []
        for prompt in plan.prompts:
            # As many tokens as the context window leaves, unless the body says.
            max_tokens = plan.max_tokens if plan.max_tokens is not None else max(core.max_model_len - len(prompt), 1)
            for i in range(plan.n):
                try:
                    samplings.append(plan.sampling(i, max_tokens))
                except InvalidRequestError as exc:
                    raise plan.error(exc) from None
        if plan.grammar is not None:  # compiled (or found cached) off the event loop: a large schema stalls no one
            try:
                await asyncio.to_thread(core.grammars.compile, plan.grammar)
            except InvalidRequestError as exc:
                raise plan.invalid(str(exc), plan.grammar_param or exc.param) from None
        base_id = uuid.uuid4().hex[:12]
        requests = []
        for index, sampling in enumerate(samplings):
            make = functools.partial(core.make_request, plan.prompts[index // plan.n], sampling, f"{base_id}-{index}",
                                     priority=priority, cache_prompt=plan.body.cache_prompt, images=plan.images)
            try:  # images: the family's processor resizes and normalizes them, off the event loop
                requests.append(await asyncio.to_thread(make) if plan.images else make())
            except InvalidRequestError as exc:
                raise plan.error(exc) from None
        return requests

    # -- running ---------------------------------------------------------------------------
    def admit(self, requests: list[Request], arrival: float) -> RequestGroup:
        if self.draining:
            self.metrics.rejected.labels("shutting_down").inc()
            raise errors.shutting_down()
        try:
            group = RequestGroup(self.engine, requests, self.metrics, arrival, on_close=self.active.discard)
        except QueueFullError:
            self.metrics.rejected.labels("overloaded").inc()
            raise errors.overloaded() from None
        except EngineDeadError as exc:
            self.metrics.rejected.labels("engine_dead").inc()
            raise errors.engine_dead(str(exc)) from None
        self.active.add(group)
        return group

    def abort_all(self) -> int:
        """End every in-flight request (grace period over); returns how many groups were told."""
        groups = list(self.active)
        for group in groups:
            group.abort()
        return len(groups)
