"""One OpenAI request before any engine sees it: its prompts, each choice's SamplingParams, the
reply's header and how engine errors are named.

A node submits the plan to its own engine (openai_serving.py); the cluster router sends the same
plan to prefill nodes (cluster/router.py). Both render, tokenize, validate and name their 400s
with this one code, so a request means the same whichever way it is served.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest

from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.loading import Tokenizer
from conveyor.multimodal.image_input import ImageInput
from conveyor.loading.chat_template import RESERVED_TEMPLATE_VARIABLES
from conveyor.server import errors
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from conveyor.server.responses import ResponseHeader
from conveyor.server.structured_output import ChatPlan, grammar_from_fields, plan_chat, reply_starts_thinking
from conveyor.structured.grammar import GrammarSpec

# Request fields copied into SamplingParams when set (None keeps the engine's default).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "stop_token_ids")
# The params the grammar compiler names in its 400s (structured/compiler.py), renamed to the field that asked.
_GRAMMAR_PARAMS = ("response_format", "guided_regex", "guided_grammar", "guided_choice")


@dataclass
class RequestPlan:
    body: SamplingFields
    prompts: list[list[int]]
    max_tokens: int | None  # None: what the serving engine's context window leaves
    logprobs: int | None  # None = off; k = the chosen token plus k alternatives
    grammar: GrammarSpec | None
    grammar_param: str | None  # the field that asked for the grammar
    header: ResponseHeader
    error_params: dict[str, str] = field(default_factory=dict)  # engine error param -> this endpoint's field
    # The chat's images, one per image marker its template wrote into the prompt, in order (EngineCore.make_request)
    images: list[ImageInput] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.body.n

    def sampling(self, choice: int, max_tokens: int) -> SamplingParams:
        """Choice `choice`'s parameters (InvalidRequestError for values the engine refuses)."""
        body = self.body
        fields = {name: value for name in _SAMPLING_FIELDS if (value := getattr(body, name)) is not None}
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        # Each choice gets its own seed, so n > 1 with a seed gives n different (reproducible) answers.
        seed = body.seed + choice if body.seed is not None else None
        # harmony replies are parsed by their special tokens (<|channel|>, <|message|>, ...), so they stay in the text
        harmony = self.header.parsing is not None and self.header.parsing.harmony
        return SamplingParams(max_tokens=max_tokens, logit_bias=logit_bias(body.logit_bias), stop=stop,
                              ignore_eos=body.ignore_eos, logprobs=self.logprobs, seed=seed, structured=self.grammar,
                              skip_special_tokens=not harmony, **fields)

    def invalid(self, message: str, param: str | None) -> APIError:
        """An engine's 400, with its param named as this endpoint names the field."""
        return errors.invalid(message, self.error_params.get(param or "") or param)

    def error(self, exc: InvalidRequestError) -> APIError:
        return self.invalid(str(exc), exc.param)


def plan_chat_request(body: ChatCompletionRequest, tokenizer: Tokenizer, reasoning_parser: str,
                      model_id: str, template_kwargs: dict[str, Any] | None = None,
                      images: list[ImageInput] | None = None, image_marker: str | None = None) -> RequestPlan:
    """`template_kwargs`: the server's --chat-template-kwargs, under the request's own. `images`: the body's image
    parts, checked and decoded (server/chat_images.py), in the order the template writes their markers.
    `image_marker`: the model's marker text (VisionProcessor.image_marker): where the template writes fewer
    markers than there are images (a text-only template), the image parts are rendered as that text instead, as
    llama-server writes its media marker into the message text."""
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    variables = chat_template_variables(body, template_kwargs)
    try:
        plan, text = _render_chat(body, tokenizer, reasoning_parser, variables)
    except errors.APIError:
        if not (images and image_marker):
            raise
        text = ""  # a template that cannot take image parts at all: the fallback below
    if images and image_marker and text.count(image_marker) < len(images):
        plan, text = _render_chat(body, tokenizer, reasoning_parser, variables, image_marker)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_id, chat=True,
                            want_logprobs=logprobs is not None, parsing=reply_starts_thinking(plan.parsing, text))
    renames = {"prompt": "messages", "logprobs": "top_logprobs", **_grammar_renames(plan.grammar_param)}
    return RequestPlan(body, [prompt], max_tokens, logprobs, plan.grammar, plan.grammar_param, header, renames,
                       list(images or []))


def _render_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, reasoning_parser: str, variables: dict[str, Any],
                 image_text: str | None = None) -> tuple[ChatPlan, str]:
    plan = plan_chat(body, tokenizer, reasoning_parser, image_text)
    try:
        text = tokenizer.apply_chat_template(plan.messages, add_generation_prompt=True, tools=plan.tools,
                                             **variables)
    except ValueError as exc:
        raise errors.invalid(str(exc), "messages") from None
    return plan, text


def chat_template_variables(body: ChatCompletionRequest, defaults: dict[str, Any] | None) -> dict[str, Any]:
    """What the template sees beyond messages and tools: the server's defaults, the request's
    chat_template_kwargs, then reasoning_effort. The template's own inputs cannot be replaced (a 400)."""
    given = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & given.keys())
    if reserved:
        raise errors.invalid(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
    variables = {**(defaults or {}), **given}
    if body.reasoning_effort is not None:
        variables["reasoning_effort"] = body.reasoning_effort
    return variables


def plan_completion_request(body: CompletionRequest, tokenizer: Tokenizer, model_id: str) -> RequestPlan:
    if body.best_of is not None and body.best_of != body.n:
        raise errors.invalid("best_of is not supported (omit it or set it equal to n)", "best_of")
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    grammar, param = grammar_from_fields(body)
    header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_id, chat=False,
                            want_logprobs=body.logprobs is not None)
    renames = {"messages": "prompt", **_grammar_renames(param)}
    return RequestPlan(body, prompts, body.max_tokens, body.logprobs, grammar, param, header, renames)


def _grammar_renames(param: str | None) -> dict[str, str]:
    return {name: param for name in _GRAMMAR_PARAMS} if param is not None else {}


def priority(body: SamplingFields, http: HTTPRequest) -> int:
    if body.priority is not None:
        return body.priority
    header = header_priority(http)
    return 0 if header is None else header


def header_priority(http: HTTPRequest) -> int | None:
    """The X-Priority header as an int (None when absent); a 400 when it is not an integer."""
    header = http.headers.get("x-priority")
    if header is None:
        return None
    try:
        return int(header)
    except ValueError:
        raise errors.invalid(f"X-Priority must be an integer, got {header!r}", "X-Priority") from None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise errors.invalid("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
