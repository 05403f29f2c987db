"""The one request front every wire API goes through, on a node and on the cluster router.

An API adapter (chat/completions and completions in app.py; Anthropic Messages and OpenAI Responses in
server/apis/) turns its body into a RequestPlan here (`plan_chat`, `plan_completion`: the chat template,
tools, grammar, reasoning, limits and 400s of request_plan.py) and asks `start()` for the running
group of deltas, which it writes back in its own shapes. A node starts the group on its engine
(OpenAIServing), the router on its prefill and decode nodes (cluster/router.py's RouterServing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from conveyor.loading import Tokenizer
from conveyor.multimodal.image_fetch import ImagePolicy
from conveyor.server.chat_images import load_chat_images
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.reply import DeltaGroup, respond
from conveyor.server.request_plan import RequestPlan, plan_chat_request, plan_completion_request
from conveyor.server.responses import TokenText


class ServingFront(ABC):
    """Planning shared by a node and the router; subclasses say how a plan starts running."""

    metrics: Any  # the subclass's metrics; every route counts its request in metrics.api_requests (per API)

    def __init__(self, tokenizer: Tokenizer, model_id: str, model_name: str, reasoning_parser: str = "auto",
                 template_kwargs: dict | None = None, strict_model_name: bool = False,
                 image_policy: ImagePolicy | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_names = {model_id, model_name}
        self.strict_model_name = strict_model_name  # --strict-model-name
        self.reasoning_parser = reasoning_parser
        self.template_kwargs = template_kwargs or {}  # --chat-template-kwargs
        self.token_text = TokenText(tokenizer)
        self.image_policy = image_policy or ImagePolicy()  # the image flags (multimodal/image_fetch.py)

    def check_model(self, name: str | None, strict: bool | None = None) -> None:
        """A request may name any model (the one served answers) unless --strict-model-name; a lookup of
        /v1/models/{id} is always strict."""
        strict = self.strict_model_name if strict is None else strict
        if strict and name is not None and name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           "invalid_request_error", "model", "model_not_found")

    async def plan_chat(self, body: ChatCompletionRequest) -> RequestPlan:
        """Async for the images: fetched and decoded (off the event loop) before the template renders."""
        self.check_model(body.model)
        images = await load_chat_images(body, self.image_policy, self.image_refusal())
        return plan_chat_request(body, self.tokenizer, self.reasoning_parser, self.model_id, self.template_kwargs,
                                 images, self.image_marker())

    async def count_prompt_tokens(self, plan: RequestPlan, http: HTTPRequest | None = None) -> int:
        """The first prompt's length as the model sees it (a node counts each image's whole token run; the router
        asks a node, from the request `http`)."""
        return len(plan.prompts[0])

    def image_refusal(self) -> str | None:
        """Why this front's model takes no images (a 400 for any image part), or None when it sees."""
        return f"model {self.model_id} does not accept images (a text-only model)"

    def image_marker(self) -> str | None:
        """The text of the model's image marker (None: no vision model here; the router asks its prefill nodes)."""
        return None

    def plan_completion(self, body: CompletionRequest) -> RequestPlan:
        self.check_model(body.model)
        return plan_completion_request(body, self.tokenizer, self.model_id)

    @abstractmethod
    async def start(self, http: HTTPRequest, plan: RequestPlan, arrival: float) -> DeltaGroup:
        """Validate, admit (503 when full) and start the plan's requests; 4xx/5xx before any response byte."""

    # -- the OpenAI endpoints -------------------------------------------------------------------
    async def chat(self, http: HTTPRequest, body: ChatCompletionRequest, arrival: float) -> Response:
        return await self._respond(http, await self.plan_chat(body), arrival)

    async def completion(self, http: HTTPRequest, body: CompletionRequest, arrival: float) -> Response:
        return await self._respond(http, self.plan_completion(body), arrival)

    async def _respond(self, http: HTTPRequest, plan: RequestPlan, arrival: float) -> Response:
        group = await self.start(http, plan, arrival)
        body = plan.body
        return await respond(http, group, plan.header, self.token_text, body.stream, body.include_usage, plan.n)
