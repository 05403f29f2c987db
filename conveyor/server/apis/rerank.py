"""Reranking: POST /v1/rerank (Jina / Cohere shape; llama-server's /rerank aliases) and vLLM's /v1/score.

Each (query, document) pair is one pooling request on a reranking engine (--reranking, or a cross-encoder):
a cross-encoder reads the pair as its tokenizer joins two texts; a yes/no reranker (Qwen3-Reranker) reads
the judging prompt it was trained on. The score is a probability in [0, 1] either way (runner/model_runner.py).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from conveyor.engine.rerank_prompt import pair_tokens
from conveyor.server import errors
from conveyor.server.apis.embeddings import _priority, pooling_body, run_pooled
from conveyor.server.limits import RequestLimits
from conveyor.server.protocol import MAX_EMBEDDING_INPUTS, RerankRequest, ScoreRequest

def add_routes(router: APIRouter, serving, limits: RequestLimits) -> None:

    @router.post("/v1/rerank")
    @router.post("/rerank")
    @router.post("/v1/reranking")
    @router.post("/reranking")  # llama-server's aliases
    async def rerank(request: Request) -> dict:
        body = await pooling_body(serving, request, RerankRequest, "rerank", limits)
        documents = [_document_text(d, i) for i, d in enumerate(body.documents)]
        scores, tokens = await _scores(serving, request, [body.query] * len(documents), documents, body.instruction,
                                       _priority(body.priority, request), limits)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex[:12]}", "object": "list", "model": serving.model_id,
                "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/v1/score")
    @router.post("/score")
    async def score(request: Request) -> dict:
        body = await pooling_body(serving, request, ScoreRequest, "score", limits)
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise errors.invalid("text_1 must be one text or as many texts as text_2 (and text_2 not empty)",
                                 "text_1")
        scores, tokens = await _scores(serving, request, first, second, body.instruction,
                                       _priority(body.priority, request), limits)
        return {"id": f"score-{uuid.uuid4().hex[:12]}", "object": "list", "model": serving.model_id,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _scores(serving, http: Request, queries: list[str], documents: list[str], instruction: str | None,
                  priority: int, limits: RequestLimits) -> tuple[list[float], int]:
    """Each pair's score, and the tokens they took."""
    if len(documents) > MAX_EMBEDDING_INPUTS:
        raise errors.invalid(f"at most {MAX_EMBEDDING_INPUTS} documents per request", "documents")
    if sum(len(q) + len(d) for q, d in zip(queries, documents)) > limits.max_prompt_chars:
        raise errors.invalid(f"the texts hold more than {limits.max_prompt_chars} characters (--max-prompt-chars)",
                             "documents")
    pairs = [pair_tokens(serving.tokenizer, serving.core.pooling, q, d, instruction)
             for q, d in zip(queries, documents)]
    prompts, types = [ids for ids, _ in pairs], [t for _, t in pairs]
    limit = serving.core.max_model_len
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise errors.invalid(f"document {i} with its query is {len(ids)} tokens, more than the model's context "
                                 f"of {limit}", "documents")
    scores = [vector[0] for vector in await run_pooled(serving, http, prompts, priority, types)]
    return scores, sum(len(p) for p in prompts)


def _document_text(document: str | dict, index: int) -> str:
    """A document as a string, or Cohere's {"text": ...}."""
    if isinstance(document, str):
        return document
    text = document.get("text")
    if not isinstance(text, str):
        raise errors.invalid(f"documents[{index}] must be a string or an object with a string 'text'", "documents")
    return text
