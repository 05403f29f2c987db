"""One streaming request to an OpenAI-compatible server, timed into a `RequestRecord`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# vLLM/SGLang stream reasoning models' thinking in separate delta fields; it is output all the same.
_CHAT_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are addressed."""

    base_url: str  # without the trailing /v1
    endpoint: str  # "chat" | "completions"
    model: str

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False


@dataclass
class RequestRecord:
    """What one request did, as absolute `time.perf_counter()` stamps."""

    start_s: float
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    text: str = ""
    num_output_tokens: int = 0  # from `usage` when the server sends it, else the chunk count
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s


def normalize_base_url(url: str) -> str:
    """Accept both http://host:port and http://host:port/v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def make_client(
    api_key: str | None, timeout_s: float, max_connections: int, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # httpx's default pool (100 connections) would silently cap concurrency above 100.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport)


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """The first card of GET /v1/models (at least an "id")."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]


def card_param_count(card: dict[str, Any]) -> float | None:
    """meta.n_params of a model card (llama-server and conveyor send it), if present and sane."""
    meta = card.get("meta")
    count = meta.get("n_params") if isinstance(meta, dict) else None
    return float(count) if isinstance(count, (int, float)) and count > 0 else None


def build_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True  # non-standard; vLLM, SGLang and llama-server honour it
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "completions":
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return "".join(delta.get(name) or "" for name in _CHAT_TEXT_FIELDS)


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    on_first_token: Callable[[], None] | None = None,
) -> RequestRecord:
    """Stream one request. Never raises: every failure ends up in `record.error`."""
    record = RequestRecord(start_s=time.perf_counter())
    try:
        await _stream_into(record, client, target, spec, on_first_token)
    except Exception as exc:  # a benchmark records failures instead of stopping on them
        record.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    record.end_s = time.perf_counter()
    return record


async def _stream_into(
    record: RequestRecord,
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    on_first_token: Callable[[], None] | None,
) -> None:
    url = target.base_url + ENDPOINT_PATHS[target.endpoint]
    usage_tokens: int | None = None
    pieces: list[str] = []
    async with client.stream("POST", url, json=build_body(target, spec)) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            record.error = f"HTTP {response.status_code}: {body}"[:_MAX_ERROR_CHARS]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, `event:` lines and `:` keep-alive comments
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # vLLM reports mid-stream failures as an SSE event
                record.error = f"stream error: {json.dumps(chunk['error'])}"[:_MAX_ERROR_CHARS]
                break
            if (usage := chunk.get("usage")) and usage.get("completion_tokens") is not None:
                usage_tokens = int(usage["completion_tokens"])
            if text := _chunk_text(chunk, target.endpoint):
                record.chunk_times_s.append(time.perf_counter())
                pieces.append(text)
                if on_first_token is not None and len(pieces) == 1:
                    on_first_token()
    record.text = "".join(pieces)
    record.num_output_tokens = usage_tokens if usage_tokens is not None else len(record.chunk_times_s)
