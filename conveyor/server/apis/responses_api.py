"""OpenAI Responses (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`): a thin adapter.

The body becomes the chat request the server already plans (responses_input.py: instructions and input
items as messages, function tools, tool_choice, text.format as response_format, reasoning.effort), so
templates, grammars, limits and metrics are chat's own. The reply goes back as Responses items
(responses_output.py), JSON or the SSE event sequence; a stored response (store, default true) can be
read back and continued with previous_response_id (response_store.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from conveyor.config import ServerConfig
from conveyor.server.apis.body import check_header_priority, json_object
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.apis.responses_input import (FunctionTool, ResponsesRequest, parse_items, parse_tools,
                                                  refused_fields, to_chat, validated_at)
from conveyor.server.apis.responses_output import (FINAL_EVENTS, EventWriter, Outcome, OutputWriter, ResponseDraft,
                                                   new_id, output_items, usage)
from conveyor.server.errors import APIError
from conveyor.server.front import ServingFront
from conveyor.server.limits import RequestLimits
from conveyor.server.reply import CLIENT_CLOSED_REQUEST, DeltaGroup, SSEResponse, collect_choices, parsed_deltas
from conveyor.server.request_plan import RequestPlan
from conveyor.server.responses import ChoiceState
from conveyor.structured.output import ChatDelta

# Chat's field names in planning and engine 400s -> the Responses field the client sent.
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


def _settings(body: ResponsesRequest, tools: list[FunctionTool]) -> dict:
    """What every Response object echoes of its request (the SDK's Response type requires several)."""
    fmt = body.text.format if body.text is not None else None
    reasoning = body.reasoning
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
            "service_tier": "default", "store": body.stores, "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in tools], "top_logprobs": 0, "top_p": body.top_p,
            "truncation": "disabled", "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key}


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"No response with id {response_id!r} is stored here (it was never stored, was created "
                         "with store=false, was dropped as the oldest (--responses-store-max), or was deleted)",
                    "invalid_request_error", param, "not_found")


def _renamed(exc: APIError) -> APIError:
    exc.param = _PARAMS.get(exc.param or "", exc.param)
    return exc


def _parsed(plan: RequestPlan, text: str, truncated: bool) -> ChatDelta:
    parsing = plan.header.parsing
    if parsing is None or not parsing.enabled:
        return ChatDelta(content=text)
    return parsing.parser().parse(text, truncated)


@dataclass
class _Turn:
    """One POST: its body, its plan, the conversation it ends, and where its finished response goes."""

    body: ResponsesRequest
    plan: RequestPlan
    conversation: list[dict]  # every input item so far (a later previous_response_id continues them)
    draft: ResponseDraft
    store: ResponseStore

    @property
    def summary(self) -> bool:
        return self.body.reasoning is not None and self.body.reasoning.wants_summary

    def finish(self, response: dict) -> dict:
        if self.body.stores:
            self.store.put(response, self.conversation + response["output"])
        return response


async def _begin(body: ResponsesRequest, store: ResponseStore, serving: ServingFront, limits: RequestLimits,
           ignore_hosted: bool) -> _Turn:
    """The earlier conversation (previous_response_id) and this input, planned as one chat request."""
    refused_fields(body)
    earlier: list[dict] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        earlier = stored.conversation
    new, tools = parse_items(body.input), parse_tools(body.tools, ignore_hosted)
    items = parse_items(earlier, "previous_response_id") + new
    try:  # count limits and planning 400s name chat's fields: renamed to this API's
        plan = await serving.plan_chat(to_chat(body, items, len(items) - len(new), tools, limits))
    except APIError as exc:
        raise _renamed(exc) from None
    conversation = earlier + [item.model_dump(by_alias=True, exclude_none=True) for item in new]
    draft = ResponseDraft(new_id("resp"), int(time.time()), serving.model_id, _settings(body, tools))
    return _Turn(body, plan, conversation, draft, store)


async def _complete(http: Request, turn: _Turn, group: DeltaGroup) -> Response:
    choices = await collect_choices(http, group)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choice = choices[0]
    truncated = choice.finish_reason == "length"
    outcome = Outcome.of(choice.finish_reason, choice.error)
    output = output_items(_parsed(turn.plan, choice.text, truncated), truncated, turn.summary)
    response = turn.draft.object(outcome.status, output, usage(choice), outcome.incomplete_reason, outcome.error)
    return JSONResponse(turn.finish(response))


async def _stream(turn: _Turn, group: DeltaGroup) -> AsyncIterator[str]:
    event, state = EventWriter(), ChoiceState(0)
    writer = OutputWriter(event, turn.summary)
    try:
        yield event("response.created", response=turn.draft.object("in_progress", []))
        yield event("response.in_progress", response=turn.draft.object("in_progress", []))
        async for parsed, out in parsed_deltas(group, turn.plan.header.parsing):
            state.add(out, keep=False)
            if out.finish_reason == "error":
                error = Outcome.of("error", out.error).error or {}
                yield event("error", code=error["code"], message=error["message"], param=None)
                failed = turn.draft.object("failed", writer.finished_items, usage(state), error=error)
                yield event("response.failed", response=turn.finish(failed))
                return
            for chunk in writer.feed(parsed):
                yield chunk
            if out.finished:
                outcome = Outcome.of(out.finish_reason, out.error)
                for chunk in writer.finish(truncated=out.finish_reason == "length"):
                    yield chunk
                response = turn.draft.object(outcome.status, writer.items, usage(state), outcome.incomplete_reason,
                                             outcome.error)
                yield event(FINAL_EVENTS[outcome.status], response=turn.finish(response))
    finally:
        group.close()


def add_routes(router: APIRouter, serving: ServingFront, limits: RequestLimits,
               config: ServerConfig | None = None, store: ResponseStore | None = None) -> None:
    """The store is this app's own (add_routes runs once per app: a node's or the cluster router's), or the
    one a multi-model server's models share (so a conversation may switch models)."""
    config = config or ServerConfig()
    if store is None:
        store = ResponseStore(config.responses_store_max, config.responses_store_max_bytes)

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        arrival = time.monotonic()
        serving.metrics.api_requests.labels("responses").inc()
        body = validated_at(ResponsesRequest, await json_object(request, limits), "")
        check_header_priority(request, limits)
        turn = await _begin(body, store, serving, limits, config.hosted_tools == "ignore")
        try:
            group = await serving.start(request, turn.plan, arrival)
        except APIError as exc:
            raise _renamed(exc) from None
        if body.stream:
            return SSEResponse(_stream(turn, group))
        return await _complete(request, turn, group)

    add_store_routes(router, store)


def add_store_routes(router: APIRouter, store: ResponseStore) -> None:
    """GET and DELETE /v1/responses/{id}: a node's, and a multi-model server's front over the shared store."""

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, None)
        return stored.response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        if not store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

