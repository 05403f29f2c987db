"""OpenAI request -> engine requests -> OpenAI response (JSON or SSE).

Everything a request can get wrong is checked here, before the engine sees it: the model
name, the chat template, sampling parameters and the context window. Admission (503) is
the last step before the response starts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.server import errors
from conveyor.server.errors import APIError
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from conveyor.server.responses import (ChoiceState, ResponseHeader, TokenText, chunk, full_response, sse,
                                       tool_finish_reason, usage_chunk)
from conveyor.server.streams import RequestGroup, wait_for_disconnect
from conveyor.server.structured_output import grammar_from_fields, plan_chat, reply_starts_thinking
from conveyor.structured.grammar import GrammarSpec

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; nobody reads it

# Request fields copied into SamplingParams when set (None keeps the engine's default).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "stop_token_ids")


class SSEResponse(StreamingResponse):
    """A stream that always closes its generator, so a vanished client aborts its requests at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # NOTE: when a disconnect cancels us during send(), the generator is parked at a yield
            # and would only be finalized by the garbage collector; close it now instead.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_id: str, metrics: ServerMetrics,
                 reasoning_parser: str = "auto") -> None:
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.core = engine.core
        self.model_id = model_id
        self.model_names = {model_id, self.core.model_name}
        self.metrics = metrics
        self.token_text = TokenText(self.core.tokenizer)
        self.active: set[RequestGroup] = set()
        self.draining = False

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, http: HTTPRequest, body: ChatCompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plan = plan_chat(body, self.core.tokenizer, self.reasoning_parser)
        try:
            text = self.core.tokenizer.apply_chat_template(plan.messages, add_generation_prompt=True, tools=plan.tools)
        except ValueError as exc:
            raise errors.invalid(str(exc), "messages") from None
        prompt = self.core.tokenizer.encode(text, add_special_tokens=False)
        await self._compile(plan.grammar, plan.grammar_param)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        requests = self._make_requests(body, [prompt], max_tokens, logprobs, _priority(body, http),
                                       {"prompt": "messages", "logprobs": "top_logprobs",
                                        "response_format": plan.grammar_param}, plan.grammar)
        header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_id, chat=True,
                                want_logprobs=logprobs is not None,
                                parsing=reply_starts_thinking(plan.parsing, text))
        return await self._run(http, body, header, requests, arrival)

    async def completion(self, http: HTTPRequest, body: CompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise errors.invalid("best_of is not supported (omit it or set it equal to n)", "best_of")
        tokenizer = self.core.tokenizer
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        grammar, param = grammar_from_fields(body)
        await self._compile(grammar, param)
        requests = self._make_requests(body, prompts, body.max_tokens, body.logprobs, _priority(body, http),
                                       {"messages": "prompt", "response_format": param}, grammar)
        header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_id, chat=False,
                                want_logprobs=body.logprobs is not None)
        return await self._run(http, body, header, requests, arrival)

    async def _compile(self, grammar: GrammarSpec | None, param: str | None) -> None:
        """Compile (or find cached) off the event loop, so a large schema never stalls other requests."""
        if grammar is None:
            return
        try:
            await asyncio.to_thread(self.core.grammars.compile, grammar)
        except InvalidRequestError as exc:
            raise errors.invalid(str(exc), param or exc.param) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           "invalid_request_error", "model", "model_not_found")

    # -- request -> engine requests --------------------------------------------------------
    def _make_requests(self, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                       logprobs: int | None, priority: int, params: dict[str, str | None],
                       grammar: GrammarSpec | None = None) -> list[Request]:
        """n requests per prompt, all validated before any is submitted. Choice index = prompt * n + i.

        `params` renames the engine's error params to this endpoint's field names.
        """
        base_id = uuid.uuid4().hex[:12]
        requests = []
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                try:
                    sampling = self._sampling_params(body, prompt, max_tokens, logprobs, i)
                    sampling.structured = grammar
                    requests.append(self.core.make_request(prompt, sampling, f"{base_id}-{p * body.n + i}",
                                                           priority=priority, cache_prompt=body.cache_prompt))
                except InvalidRequestError as exc:
                    raise errors.invalid(str(exc), params.get(exc.param or "") or exc.param) from None
        return requests

    def _sampling_params(self, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                         logprobs: int | None, choice: int) -> SamplingParams:
        fields = {name: value for name in _SAMPLING_FIELDS if (value := getattr(body, name)) is not None}
        if max_tokens is None:  # as many as the context window leaves
            max_tokens = max(self.core.max_model_len - len(prompt), 1)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        # Each choice gets its own seed, so n > 1 with a seed gives n different (reproducible) answers.
        seed = body.seed + choice if body.seed is not None else None
        return SamplingParams(max_tokens=max_tokens, logit_bias=_logit_bias(body.logit_bias), stop=stop,
                              ignore_eos=body.ignore_eos, logprobs=logprobs, seed=seed, **fields)

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

    async def _run(self, http: HTTPRequest, body: SamplingFields, header: ResponseHeader,
                   requests: list[Request], arrival: float) -> Response:
        group = self.admit(requests, arrival)
        if body.stream:
            return SSEResponse(self._stream(group, header, body.include_usage, body.n))
        return await self._complete(http, group, header, body.n)

    async def _complete(self, http: HTTPRequest, group: RequestGroup, header: ResponseHeader, n: int) -> Response:
        collect = asyncio.create_task(self._collect(group))
        gone = asyncio.create_task(wait_for_disconnect(http.receive))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            client_left = not collect.done()  # (or this handler was cancelled)
            if client_left:
                collect.cancel()
                group.close()  # frees the KV blocks now, not when the cancellation lands
        if client_left:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = collect.result()
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise errors.generation_failed(failed.error or "generation failed")
        return JSONResponse(full_response(header, choices, self.token_text, n))

    async def _collect(self, group: RequestGroup) -> list[ChoiceState]:
        choices = [ChoiceState(i) for i in range(len(group.request_ids))]
        while not group.done:
            index, out = await group.next()
            choices[index].add(out)
        return choices

    async def _stream(self, group: RequestGroup, header: ResponseHeader, include_usage: bool,
                      n: int) -> AsyncIterator[str]:
        choices = [ChoiceState(i) for i in range(len(group.request_ids))]
        offsets = [0] * len(choices)  # text_offset of each completion choice's next token
        try:
            if header.chat:
                for c in choices:
                    yield sse(chunk(header, c.index, "", [], self.token_text, role=True, with_usage=include_usage))
            parsers = [header.parsing.parser() for _ in choices] if header.parses else None  # type: ignore[union-attr]
            while not group.done:
                index, out = await group.next()
                choices[index].add(out, keep=False)
                parsed, finish_reason, first_tool = None, out.finish_reason if out.finished else None, 0
                if parsers is not None:
                    first_tool = parsers[index].num_tool_calls
                    parsed = parsers[index].feed(out.new_text)
                    if out.finished:
                        parsed += parsers[index].finish(truncated=out.finish_reason == "length")
                        if parsers[index].num_tool_calls:
                            finish_reason = tool_finish_reason(finish_reason)
                    if parsed.is_empty and not (out.logprobs or out.finished):
                        continue
                elif not (out.new_text or out.logprobs or out.finished):
                    continue  # text held back (stop-string prefix or half a character)
                payload = chunk(header, index, out.new_text, out.logprobs, self.token_text,
                                finish_reason=finish_reason, offset=offsets[index],
                                with_usage=include_usage, parsed=parsed, first_tool_index=first_tool)
                offsets[index] += sum(len(self.token_text(lp.token_id)[0]) for lp in out.logprobs)
                if out.finish_reason == "error":
                    payload["error"] = errors.generation_failed(out.error or "generation failed").body()["error"]
                yield sse(payload)
            if include_usage:
                yield sse(usage_chunk(header, choices, n))
            yield sse("[DONE]")
        finally:
            group.close()


def _priority(body: SamplingFields, http: HTTPRequest) -> int:
    if body.priority is not None:
        return body.priority
    header = http.headers.get("x-priority")
    if header is None:
        return 0
    try:
        return int(header)
    except ValueError:
        raise errors.invalid(f"X-Priority must be an integer, got {header!r}", "X-Priority") from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise errors.invalid("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
