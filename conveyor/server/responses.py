"""OpenAI response shapes: chat / text completions, their stream chunks, usage and logprobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from conveyor.engine.outputs import RequestOutput, TokenLogprob
from conveyor.loading import Tokenizer
from conveyor.structured.output import ChatDelta, ChatParsing


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in of each byte in byte-level BPE pieces."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


class TokenText:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            try:
                piece = self.tokenizer.id_to_piece(token_id)
            except IndexError:  # NOTE: an embedding row past the tokenizer (a padded vocabulary): no text, no bytes
                piece = ""
            # A byte-level piece knows its exact bytes even when they are half a UTF-8 character.
            raw = bytes(_BYTE_DECODER[c] for c in piece) if all(c in _BYTE_DECODER for c in piece) \
                else text.encode()
            hit = self._cache[token_id] = (text, list(raw))
        return hit


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streaming accumulates; streaming only counts)."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    stop_sequence: str | None = None

    def add(self, out: RequestOutput, keep: bool = True) -> None:
        if keep:
            self.text += out.new_text
            self.logprobs += out.logprobs
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.error, self.stop_sequence = out.finish_reason, out.error, out.stop_sequence


def usage(choices: list[ChoiceState], n: int) -> dict:
    """The prompt is counted once per prompt, not once per choice (as OpenAI does for n > 1)."""
    firsts = choices[::n]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


# -- logprobs ------------------------------------------------------------------------------------
# What OpenAI reports for a token that cannot be chosen (a grammar masked it: log 0 = -inf, which JSON cannot carry).
IMPOSSIBLE_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB


def chat_logprobs(token_text: TokenText, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        logprob = _finite(logprob)
        text, raw = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion_logprobs(token_text: TokenText, logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for lp in logprobs:
        text = token_text(lp.token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [{token_text(t)[0]: _finite(v) for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


# -- responses and chunks ------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseHeader:
    id: str
    created: int
    model: str
    chat: bool
    want_logprobs: bool
    parsing: ChatParsing | None = None  # chat replies split into content / reasoning / tool calls

    @property
    def parses(self) -> bool:
        return self.chat and self.parsing is not None and self.parsing.enabled

    def base(self, stream: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def full_response(header: ResponseHeader, choices: list[ChoiceState], token_text: TokenText, n: int) -> dict:
    out = header.base(stream=False)
    out["choices"] = [_full_choice(header, c, token_text) for c in choices]
    out["usage"] = usage(choices, n)
    return out


def _full_choice(header: ResponseHeader, choice: ChoiceState, token_text: TokenText) -> dict:
    if header.chat:
        logprobs = chat_logprobs(token_text, choice.logprobs) if header.want_logprobs else None
        message: dict = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if header.parses:
            parsed = header.parsing.parser().parse(choice.text, truncated=finish_reason == "length")  # type: ignore[union-attr]
            message["content"] = parsed.content or (None if parsed.tool_calls else "")
            if header.parsing.reasons:  # type: ignore[union-attr]
                message["reasoning_content"] = parsed.reasoning or None
            if parsed.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                finish_reason = tool_finish_reason(finish_reason)
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    logprobs = completion_logprobs(token_text, choice.logprobs) if header.want_logprobs else None
    return {"index": choice.index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def tool_finish_reason(finish_reason: str | None) -> str | None:
    """A reply that ended by itself after calling tools ends with "tool_calls" (a length cut stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def chunk(header: ResponseHeader, index: int, text: str, logprobs: list[TokenLogprob], token_text: TokenText,
          finish_reason: str | None = None, role: bool = False, offset: int = 0, with_usage: bool = False,
          parsed: ChatDelta | None = None, first_tool_index: int = 0) -> dict:
    """One choice's delta as a stream chunk; `role` marks a chat stream's opening chunk; `parsed`
    replaces `text` with content / reasoning_content / tool_calls (each call sent whole, numbered
    from first_tool_index, which the official client assembles by index)."""
    out = header.base(stream=True)
    if header.chat:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        if parsed is not None:
            delta = {}
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.reasoning:
                delta["reasoning_content"] = parsed.reasoning
            if parsed.tool_calls:
                delta["tool_calls"] = [call.to_openai(first_tool_index + i) for i, call in enumerate(parsed.tool_calls)]
        lp = chat_logprobs(token_text, logprobs) if header.want_logprobs and logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    else:
        lp = completion_logprobs(token_text, logprobs, offset) if header.want_logprobs and logprobs else None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
    out["choices"] = [choice]
    if with_usage:
        out["usage"] = None  # OpenAI sends null on every chunk but the trailing usage one
    return out


def usage_chunk(header: ResponseHeader, choices: list[ChoiceState], n: int) -> dict:
    return {**header.base(stream=True), "choices": [], "usage": usage(choices, n)}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"
