"""The wire APIs, side by side, each a thin adapter over the one request front (server/front.py).

Each module parses its API's body, turns it into the chat request the server already plans
(request_plan.py: template, tools, grammar, reasoning, limits), starts it through `ServingFront.start`
(a node's engine or the router's cluster), and writes the deltas back in its own shapes and errors:

  chat_completions.py  OpenAI chat/completions and completions (the native shapes), /v1/models
  messages.py          Anthropic Messages: POST /v1/messages, /v1/messages/count_tokens
  responses_api.py     OpenAI Responses: POST /v1/responses, GET / DELETE /v1/responses/{id}
  responses_input.py   its body and input items -> the chat request
  responses_output.py  its output items, Response object and SSE events
  response_store.py    the Responses API's bounded store (previous_response_id, GET)
  body.py              a body parsed under the server's limits (shared)
  turns.py             agent conversations as strict chat templates take them (shared)
  thinking_budget.py   Messages' thinking.budget_tokens: thinking, then the answer, as two engine requests
  embeddings.py        OpenAI /v1/embeddings and llama-server's /embedding, on a pooling engine (a node's only)
  rerank.py            /v1/rerank (Jina / Cohere shape) and vLLM's /v1/score, on a reranking engine
"""

from __future__ import annotations

from fastapi import APIRouter

from conveyor.config import ServerConfig
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.front import ServingFront
from conveyor.server.limits import RequestLimits


def add_agent_routes(router: APIRouter, serving: ServingFront, limits: RequestLimits, config: ServerConfig,
                     response_store: ResponseStore | None = None) -> None:
    """The Messages and Responses routes, on a node and on the cluster router alike (response_store: one
    shared by several models, else the app's own)."""
    from conveyor.server.apis import messages, responses_api

    messages.add_routes(router, serving, limits, config)
    responses_api.add_routes(router, serving, limits, config, response_store)


def add_pooling_routes(router: APIRouter, serving, limits: RequestLimits) -> None:
    """Embeddings, rerank and score: a node's routes (its engine pools; server/apis/embeddings.py)."""
    from conveyor.server.apis import embeddings, rerank

    embeddings.add_routes(router, serving, limits)
    rerank.add_routes(router, serving, limits)
