"""Request limits: what a body may hold before anything is tokenized or admitted.

Each limit is a flag (`ServerConfig.max_*`). Order of checks, cheapest first:

  body bytes (413, middleware.py) -> JSON syntax, depth, finite numbers, valid Unicode (400)
  -> pydantic types (400) -> counts: messages, prompt characters, n, stop, logit_bias (400)

Invalid Unicode is refused, never replaced: a lone UTF-16 surrogate (`"\\ud800"`) or bytes
that are not UTF-8 get a 400 naming the field, so what the model sees is what the client sent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from conveyor.config import ServerConfig
from conveyor.server import errors
from conveyor.server.errors import APIError

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = ServerConfig.max_request_bytes
    max_json_depth: int = ServerConfig.max_json_depth
    max_messages: int = ServerConfig.max_messages
    max_prompt_chars: int = ServerConfig.max_prompt_chars
    max_n: int = ServerConfig.max_n
    max_stop_strings: int = ServerConfig.max_stop_strings
    max_logit_bias: int = ServerConfig.max_logit_bias
    max_priority: int = ServerConfig.max_priority

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(config.max_request_bytes, config.max_json_depth, config.max_messages, config.max_prompt_chars,
                   config.max_n, config.max_stop_strings, config.max_logit_bias, config.max_priority)


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes (--max-request-bytes)",
                    "invalid_request_error", code="request_too_large", headers={"Connection": "close"})


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # stateless; built once, not per request


def parse_json(raw: bytes, limits: RequestLimits) -> Any:
    """Bytes -> a JSON value that is safe to validate: bounded depth, finite numbers, valid Unicode."""
    if len(raw) > limits.max_request_bytes:  # the middleware stops most; a body without length ends here
        raise too_large(limits.max_request_bytes)
    try:
        # As json.loads(bytes) decodes (UTF-8/16/32 by BOM); UTF-8-encoded surrogates are caught below.
        data = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:  # the C scanner recurses per level: thousands of '[' end here
        raise _too_deep(limits.max_json_depth) from None
    except ValueError as exc:  # includes UnicodeDecodeError: bytes that are not UTF-8
        raise errors.invalid(f"The request body is not valid JSON: {exc}") from None
    check_json_value(data, limits.max_json_depth)
    return data


def _too_deep(limit: int) -> APIError:
    return errors.invalid(f"The request body is nested more than {limit} levels deep (--max-json-depth)")


def check_json_value(data: Any, max_depth: int) -> None:
    """Iterative walk (no recursion, whatever the depth): depth, finite floats, no lone surrogates.

    Only containers go on the stack, and a path is only built for an error: a list of 16k token
    ids costs about a millisecond.
    """
    if not isinstance(data, (dict, list)):
        _check_scalar(data, ())
        return
    stack: list[tuple[dict | list, int, tuple]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if type(key) is str and not _valid_text(key):
                raise _bad_text(path + (key,))
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1, path + (key,)))
            elif kind is str or kind is float:
                _check_scalar(item, path + (key,))


def _check_scalar(value: Any, path: tuple) -> None:
    if isinstance(value, str) and not _valid_text(value):
        raise _bad_text(path)
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
        param = _dotted(path)
        raise errors.invalid(f"numbers must be finite (at '{param}')" if param else "numbers must be finite",
                             param or None)


def _valid_text(text: str) -> bool:
    # isascii() is O(1) on CPython (a flag of the string); only non-ASCII text is searched.
    return text.isascii() or _SURROGATE.search(text) is None


def _bad_text(path: tuple) -> APIError:
    param = _dotted(path)
    return errors.invalid("strings must be valid Unicode: a lone UTF-16 surrogate (e.g. \\ud800) is not "
                          f"allowed (at '{param}')" if param else "strings must be valid Unicode", param or None)


def _dotted(path: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path)


def check_request(body: Any, limits: RequestLimits) -> None:
    """Count limits on a validated body; reads fields by name, so every request model is covered."""
    messages = getattr(body, "messages", None)
    if messages is not None and len(messages) > limits.max_messages:
        raise errors.invalid(f"at most {limits.max_messages} messages are allowed, got {len(messages)} "
                             "(--max-messages)", "messages")
    chars, param = _prompt_size(body)
    if chars > limits.max_prompt_chars:
        raise errors.invalid(f"the prompt has {chars} characters (or token ids); at most {limits.max_prompt_chars} "
                             "are allowed (--max-prompt-chars)", param)
    n = getattr(body, "n", 1)
    if n > limits.max_n:
        raise errors.invalid(f"n must be at most {limits.max_n} (--max-n)", "n")
    stop = getattr(body, "stop", None)
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        raise errors.invalid(f"at most {limits.max_stop_strings} stop strings are allowed (--max-stop-strings)",
                             "stop")
    stop_ids = getattr(body, "stop_token_ids", None)
    if stop_ids is not None and len(stop_ids) > limits.max_stop_strings:
        raise errors.invalid(f"at most {limits.max_stop_strings} stop_token_ids are allowed (--max-stop-strings)",
                             "stop_token_ids")
    bias = getattr(body, "logit_bias", None)
    if bias is not None and len(bias) > limits.max_logit_bias:
        raise errors.invalid(f"at most {limits.max_logit_bias} logit_bias entries are allowed (--max-logit-bias)",
                             "logit_bias")
    check_priority(getattr(body, "priority", None), "priority", limits)


def check_priority(value: int | None, param: str, limits: RequestLimits) -> None:
    """|priority| <= --max-priority, for the body field and the X-Priority header alike."""
    if value is not None and abs(value) > limits.max_priority:
        raise errors.invalid(f"{param} must be between -{limits.max_priority} and {limits.max_priority}, got {value} "
                             "(--max-priority)", param)


def _prompt_size(body: Any) -> tuple[int, str]:
    """Characters a request asks us to tokenize (token ids count one each), and the field that holds them."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        return sum(len(m.text()) + len(getattr(m, "name", None) or "") for m in messages), "messages"
    prompt = getattr(body, "prompt", None)
    if prompt is None:
        text = getattr(body, "text", None)  # /tokenize
        return (len(text), "content") if isinstance(text, str) else (0, "prompt")
    if isinstance(prompt, str):
        return len(prompt), "prompt"
    return sum(len(p) for p in prompt) if prompt and not isinstance(prompt[0], int) else len(prompt), "prompt"
