"""Embeddings: OpenAI's POST /v1/embeddings and llama-server's POST /embedding, on a pooling engine.

Each input is one engine request (engine/engine.py make_pooling_request) that shares the continuous batch
with everything else; a request's inputs are fed to the engine a window at a time, so a burst of a thousand
texts queues behind nobody and in front of nobody for long. `run_pooled` is shared with rerank.py.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence

import numpy as np
from fastapi import APIRouter, Request

from conveyor.engine.async_engine import EngineDeadError, QueueFullError
from conveyor.errors import InvalidRequestError
from conveyor.server import errors
from conveyor.server.apis.body import parse_body
from conveyor.server.limits import RequestLimits
from conveyor.server.protocol import (MAX_EMBEDDING_INPUTS, EmbeddingInput, EmbeddingRequest,
                                      LlamaEmbeddingRequest)
from conveyor.server.request_plan import header_priority


def add_routes(router: APIRouter, serving, limits: RequestLimits) -> None:
    """`serving`: a node's OpenAIServing (its engine and model id)."""

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await pooling_body(serving, request, EmbeddingRequest, "embeddings", limits)
        prompts = tokenize_inputs(serving, body.input, body.add_special_tokens, body.truncate_prompt_tokens,
                                  prompt_prefix(serving, body.prompt_name), limits)
        vectors = await run_pooled(serving, request, prompts, _priority(body.priority, request))
        data = []
        for index, vector in enumerate(vectors):
            vector = matryoshka(vector, body.dimensions, serving.core.pooling.normalize)
            data.append({"object": "embedding", "index": index,
                         "embedding": encode_base64(vector) if body.encoding_format == "base64" else vector})
        tokens = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": serving.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/embedding")
    @router.post("/embeddings")  # llama-server's aliases
    async def llama_embedding(request: Request) -> list[dict]:
        body = await pooling_body(serving, request, LlamaEmbeddingRequest, "embeddings", limits)
        prompts = tokenize_inputs(serving, body.content, True, None, "", limits)
        vectors = await run_pooled(serving, request, prompts, _priority(body.priority, request))
        # llama-server wraps a pooled vector in a list (an unpooled model would list one per token)
        return [{"index": i, "embedding": [vector]} for i, vector in enumerate(vectors)]


async def pooling_body(serving, request: Request, body_type: type, api: str, limits: RequestLimits):
    """A pooling route's body: counted for its API, parsed under the limits, its model checked and the engine's task
    matched (embeddings on an embedding model, rerank and score on a reranker)."""
    serving.metrics.api_requests.labels(api).inc()
    body = await parse_body(request, body_type, limits)
    serving.check_model(body.model)
    check_task(serving, "embedding" if api == "embeddings" else "reranking")
    return body


def check_task(serving, task: str) -> None:
    """A 400 unless the engine pools for `task` ("embedding" or "reranking")."""
    have = serving.core.pooling_task
    if have == task:
        return
    name = serving.model_id
    if have is None:
        raise errors.invalid(f"'{name}' generates text and serves no {task}: serve an embedding or reranking model, "
                             f"or start this one with --{'embeddings' if task == 'embedding' else 'reranking'}",
                             "model")
    raise errors.invalid(f"'{name}' is a{'n' if have == 'embedding' else ''} {have} model: it serves "
                         f"{'/v1/embeddings' if have == 'embedding' else '/v1/rerank and /v1/score'}", "model")


def prompt_prefix(serving, prompt_name: str | None) -> str:
    """The text a named prompt puts before each input (sentence-transformers' `prompts`), else the default one's."""
    pooling = serving.core.pooling
    name = prompt_name if prompt_name is not None else pooling.default_prompt_name
    if name is None:
        return ""
    if name not in pooling.prompts:
        known = ", ".join(sorted(pooling.prompts)) or "none"
        raise errors.invalid(f"unknown prompt_name {name!r} (this model's prompts: {known})", "prompt_name")
    return pooling.prompts[name]


def tokenize_inputs(serving, inputs: EmbeddingInput, add_special_tokens: bool, truncate: int | None, prefix: str,
                    limits: RequestLimits) -> list[list[int]]:
    """Each input's token ids: text tokenized (after the prompt prefix), token arrays checked; an input longer
    than the context is a 400 unless `truncate` asks to keep its last tokens."""
    core = serving.core
    items: Sequence = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else inputs
    if not items:
        raise errors.invalid("input must not be empty", "input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise errors.invalid(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(items)}", "input")
    if sum(len(item) for item in items) > limits.max_prompt_chars:
        raise errors.invalid(f"the inputs hold more than {limits.max_prompt_chars} characters or token ids "
                             f"(--max-prompt-chars)", "input")
    vocab = core.model_config.vocab_size
    limit = core.max_model_len if truncate in (None, -1) else min(truncate, core.max_model_len)
    prompts = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise errors.invalid(f"input[{index}] is an empty string", "input")
            ids = serving.tokenizer.encode(prefix + item, add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise errors.invalid(f"input[{index}] must be a non-empty list of token ids in [0, {vocab})", "input")
        if len(ids) > limit:
            if truncate is None:
                raise errors.invalid(f"input[{index}] has {len(ids)} tokens, more than the model's context of "
                                     f"{core.max_model_len} (set truncate_prompt_tokens to keep the last ones)",
                                     "input")
            ids = ids[-limit:]
        prompts.append(ids)
    return prompts


async def run_pooled(serving, http: Request, prompts: list[list[int]], priority: int,
                     token_types: list[list[int]] | None = None) -> list[list[float]]:
    """Each prompt's pooled vector (or score), in order. Validated first (a 400 before anything runs); then fed to
    the engine a window at a time: a 503 only if not even the first fits the queue; a client that leaves aborts
    what is still running."""
    core, engine = serving.core, serving.engine
    base_id = uuid.uuid4().hex[:12]
    try:
        requests = [core.make_pooling_request(ids, f"emb-{base_id}-{i}", priority,
                                              token_types[i] if token_types is not None else None)
                    for i, ids in enumerate(prompts)]
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc), exc.param) from None
    if serving.draining:
        raise errors.shutting_down()
    # Two ticks' admissions: one batch runs while the next waits, and a few clients together stay within the
    # admission queue (--max-queue-depth) instead of filling it.
    window = core.config.max_batch_prefill * 2
    results: list[list[float] | None] = [None] * len(requests)
    running: dict[asyncio.Task, int] = {}
    queue = iter(enumerate(requests))
    pending = next(queue, None)
    try:
        while pending is not None or running:
            while pending is not None and len(running) < window:
                index, request = pending
                try:
                    stream = engine.submit(request)
                except QueueFullError:
                    if not running:
                        serving.metrics.rejected.labels("overloaded").inc()
                        raise errors.overloaded() from None
                    break  # the queue is full: go on when one of ours finishes
                except EngineDeadError as exc:
                    raise errors.engine_dead(str(exc)) from None
                running[asyncio.ensure_future(stream.get())] = index
                pending = next(queue, None)
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = running.pop(task)
                out = task.result()
                if out.pooled is None:
                    raise errors.generation_failed(f"input[{index}] failed: {out.error or out.finish_reason}")
                results[index] = out.pooled
    finally:
        for task, index in running.items():
            task.cancel()
            engine.abort(requests[index].request_id)
    return results  # type: ignore[return-value]


def matryoshka(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (renormalised where the model's vectors are unit length)."""
    if dimensions is None:
        return vector
    if dimensions > len(vector):
        raise errors.invalid(f"dimensions must be at most the model's {len(vector)}", "dimensions")
    cut = np.asarray(vector[:dimensions], dtype=np.float32)
    if normalize:
        cut = cut / max(float(np.linalg.norm(cut)), 1e-12)
    return cut.tolist()


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes (what its SDK decodes with numpy)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _priority(value: int | None, http: Request) -> int:
    if value is not None:
        return value
    header = header_priority(http)
    return 0 if header is None else header
