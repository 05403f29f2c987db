"""Property-based fuzzing of the HTTP API: no input may reach a 5xx.

Requests come from the server's own request models (their JSON schemas turned into hypothesis
strategies, so a field added to protocol.py is fuzzed without touching this file), plus
hand-written mutations: wrong types, extreme numbers, deep or huge structures, bad encodings.
Every answer must be < 500; every 4xx must be OpenAI-shaped; every 200 well-formed.

  python -m conveyor.fuzz --quick              # what tests/server/test_fuzz.py runs (~150 examples)
  python -m conveyor.fuzz --examples 3000      # the long run, on its own tiny random-model server
  python -m conveyor.fuzz --url http://host:port --examples 500   # against any running server

Needs the `test` extra (hypothesis).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

import httpx
import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import EngineConfig
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

QUICK_EXAMPLES = 150
# The smallest context the engine allows (512 tokens a slot) bounds a generation that omits max_tokens.
FUZZ_ENGINE = EngineConfig(parallel=2, ctx_size=1024, max_queue_depth=64)
EXTREME_INTS = (0, -1, 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, -(10 ** 30))
EXTREME_FLOATS = (0.0, -0.0, 1e-308, 5e-324, 1e308, -1e308, 3.4e38, 1e-30, 2.0, -2.0, 100.0)
ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
GENERATING = ("/v1/chat/completions", "/v1/completions")
FINISH_REASONS = {"stop", "length", "abort", "error", None}

json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from(EXTREME_INTS),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


# -- requests from the models' JSON schemas ------------------------------------------------------
def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """A JSON schema (as pydantic writes it) -> values that mostly fit it, with extremes at its edges."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum", -2), schema.get("maximum", 40)
        return st.one_of(st.integers(low, high), st.integers(low, high), st.sampled_from(EXTREME_INTS))
    if kind == "number":
        return st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from(EXTREME_FLOATS))
    if kind == "string":
        return st.text(max_size=40)
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=low,
                        max_size=max(low, min(schema.get("maxItems", 4), 4)))
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties")
            values = from_schema(extra, defs) if isinstance(extra, dict) else json_values
            return st.dictionaries(st.text(max_size=8), values, max_size=3)
        required = set(schema.get("required", ()))
        strategies = {name: from_schema(sub, defs) for name, sub in props.items()}
        return st.fixed_dictionaries({k: v for k, v in strategies.items() if k in required},
                                     optional={k: v for k, v in strategies.items() if k not in required})
    return json_values


def _model_strategy(model) -> st.SearchStrategy:
    schema = model.model_json_schema()
    return from_schema(schema, schema.get("$defs", {}))


@st.composite
def schema_requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = draw(_model_strategy(ROUTES[path]))
    if path in GENERATING:
        # Short generations keep the run fast; the extremes of max_tokens are the mutations' job.
        body.setdefault("max_tokens", draw(st.integers(1, 4)))
        if isinstance(body.get("max_completion_tokens"), int):
            body["max_completion_tokens"] = min(max(body["max_completion_tokens"], 1), 4)
    return path, json.dumps(body).encode()


# -- mutations of a valid body ---------------------------------------------------------------------
BASE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/tokenize": {"content": "hi"}, "/detokenize": {"tokens": [1, 2]}}


def _deep(depth: int, opener: str) -> str:
    closer = "]" if opener == "[" else "}"
    inner = '"x":' if opener == "{" else ""
    return (opener + inner) * (depth - 1) + opener + closer * depth


RAW_MUTATIONS: tuple[bytes, ...] = (
    b"", b"null", b"[]", b"42", b'"text"', b"{", b'{"messages": [', b"\x00" * 8, b"\xef\xbb\xbf{}",
    b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"temperature": 1e999}',
    b'{"max_tokens": 1' + b"0" * 5000 + b"}", b'{"messages": ' + _deep(5000, "[").encode() + b"}",
    b'{"metadata": ' + _deep(3000, "{").encode() + b"}", _deep(200000, "[").encode(),
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"prompt": "\\udfff\\ud800"}',
    b'{"content": "\\ud83d"}', b'{"prompt": "\xff\xfe\xfd"}', b'{"prompt": "\xc3"}', b'{"prompt": "\xed\xa0\x80"}',
    '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"), '{"content": "hi"}'.encode("utf-32"),
    b'{"prompt": "hi", "prompt": [1, 2], "max_tokens": 2}', b'{"tokens": [' + b"1," * 100000 + b"1]}",
)


@st.composite
def mutated_requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    kind = draw(st.sampled_from(("raw", "wrong_type", "extreme", "huge", "drop", "extra")))
    if kind == "raw":
        return path, draw(st.sampled_from(RAW_MUTATIONS))
    body = json.loads(json.dumps(BASE[path]))
    keys = sorted(ROUTES[path].model_json_schema().get("properties", {}))
    key = draw(st.sampled_from(keys))
    if kind == "wrong_type":
        body[key] = draw(json_values)
    elif kind == "extreme":
        body[key] = draw(st.one_of(st.sampled_from(EXTREME_INTS), st.sampled_from(EXTREME_FLOATS)))
    elif kind == "huge":
        size = draw(st.sampled_from((10_000, 300_000)))
        body[key] = draw(st.sampled_from(("x" * size, [1] * (size // 10), {str(i): 1 for i in range(size // 100)})))
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))), None)
    else:
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    if path in GENERATING and isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 10 ** 6:
        body["max_tokens"] = min(body["max_tokens"], 4)
    return path, json.dumps(body).encode()


# -- checking one answer ---------------------------------------------------------------------------
@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> str:
        return f"{self.num_requests} requests, statuses {dict(sorted(self.statuses.items()))}, " \
               f"{len(self.failures)} failures"


def check_response(path: str, body: bytes, response: httpx.Response, stream: bool) -> str | None:
    """None when the answer is acceptable, else why not."""
    status = response.status_code
    if status >= 500:
        return f"{status} on {path}: {response.text[:300]}"
    if status >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} on {path} is not an OpenAI error: {response.text[:300]}"
        if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
                and isinstance(error["message"], str) and error["message"]):
            return f"{status} on {path}: bad error shape {error}"
        return None
    if stream:
        return _check_stream(path, response.text)
    try:
        data = response.json()
    except ValueError:
        return f"200 on {path} is not JSON: {response.text[:300]}"
    if path in GENERATING:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or "usage" not in data:
            return f"200 on {path} without choices/usage: {response.text[:300]}"
        if any(c.get("finish_reason") not in FINISH_REASONS - {None, "error"} for c in choices):
            return f"200 on {path} with a bad finish_reason: {response.text[:300]}"
    return None


def _check_stream(path: str, text: str) -> str | None:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream on {path} does not end with [DONE]: {text[-300:]}"
    for event in events[:-1]:
        try:
            chunk = json.loads(event)
        except ValueError:
            return f"stream on {path} has a chunk that is not JSON: {event[:200]}"
        if "error" in chunk:
            return f"stream on {path} carried an error: {event[:300]}"
        if any(c.get("finish_reason") not in FINISH_REASONS for c in chunk.get("choices", [])):
            return f"stream on {path} with a bad finish_reason: {event[:300]}"
    return None


def send(client: httpx.Client, path: str, body: bytes, report: FuzzReport, headers: dict | None = None) -> None:
    try:
        parsed = json.loads(body)
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
    except (ValueError, RecursionError):  # the mutations include bodies no JSON parser should accept
        stream = False
    try:
        response = client.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    except httpx.HTTPError as exc:  # a reset or a hang is a failure too
        report.failures.append(f"{type(exc).__name__} on {path}: {exc}")
        return
    report.statuses[response.status_code] += 1
    problem = check_response(path, body, response, stream)
    if problem is not None:  # with the request, so a failure can be replayed
        report.failures.append(f"{problem}\n  request: {body[:2000]!r}")


def run_fuzz(url: str, examples: int = QUICK_EXAMPLES, seed: int | None = 0, timeout_s: float = 30.0,
             headers: dict | None = None) -> FuzzReport:
    """Half schema-generated requests, half mutations, over one keep-alive connection pool."""
    report = FuzzReport()
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=["generate"])
        @given(st.one_of(schema_requests(), mutated_requests()))
        def one(request: tuple[str, bytes]) -> None:
            send(client, *request, report, headers)

        (hypothesis.seed(seed)(one) if seed is not None else one)()  # a seed makes the run reproducible
        health = client.get("/health")
        if health.status_code != 200:
            report.failures.append(f"/health answered {health.status_code} after the run: {health.text[:200]}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="fuzz this server (default: start a tiny random-model server)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_EXAMPLES} examples (the CI profile)")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=None, help="reproducible run (default: a fresh random one)")
    args = parser.parse_args(argv)
    examples = QUICK_EXAMPLES if args.quick else args.examples
    if args.url:
        report = run_fuzz(args.url, examples, args.seed)
    else:
        from conveyor.config import ServerConfig
        from conveyor.server.background import serve_in_thread
        from conveyor.testing import tiny_checkpoint

        with serve_in_thread(FUZZ_ENGINE, ServerConfig(metrics=True), tiny_checkpoint()) as (url, core):
            report = run_fuzz(url, examples, args.seed)
            core.pool.check_integrity()
            if core.pool.stats().num_used:
                report.failures.append(f"{core.pool.stats().num_used} KV blocks still held after the run")
    print(report.summary())
    for failure in report.failures[:20]:
        print("FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
