"""`conveyor serve --node-role prefill|decode|router`: the same server, plus (or instead of) a role.

prefill / decode: the usual engine and HTTP API (health, loads, metrics stay available), plus
the role's frame server on --serving-bind, started and stopped with the app.
router: no engine and no weights; the tokenizer and chat template only.
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

import gguf
import uvicorn
from fastapi import FastAPI

from conveyor.cluster.transport import join_address
from conveyor.config import ClusterConfig, EngineConfig, ServerConfig

logger = logging.getLogger(__name__)

SOCKET_CLOSE_TIMEOUT_S = 5.0


def load_tokenizer(model: str | None, hf_file: str | None = None, revision: str | None = None):
    """(Tokenizer, model name) from a model path (or Hub name) without touching its weights."""
    from conveyor.loading import LoadError, default_model_path
    from conveyor.loading.hub import resolve_model
    from conveyor.loading.gguf_loader import model_name as gguf_name
    from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
    from conveyor.loading.hf_loader import load_hf_tokenizer, model_name as hf_name

    model = resolve_model(model, hf_file, revision)
    path = os.path.abspath(os.path.expanduser(model)) if model is not None else default_model_path()  # keep a Hub link's .gguf name
    if os.path.isdir(path):
        path = os.path.realpath(path)
        return load_hf_tokenizer(path), hf_name(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return tokenizer_from_gguf(gguf.GGUFReader(path), path), gguf_name(path)
    raise LoadError(f"model path not found or not a model: {model}")


def attach_node(app: FastAPI, node) -> None:
    """Run the role's frame server for as long as the app runs (inside the engine's lifespan)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI):
        async with inner(app_):
            await node.start()
            try:
                yield
            finally:
                await node.stop()

    app.router.lifespan_context = lifespan
    app.state.node = node


def build_cluster_server(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                         router_models: tuple[str, ...] = ()):
    """A node, or the router; `router_models`: every --model a router was given (the first is the default),
    each routed by name to the nodes that serve it."""
    if cluster.node_role == "router":
        from conveyor.cluster.models import RoutedModel
        from conveyor.cluster.router import create_router_app

        tokenizer, name = load_tokenizer(router_models[0] if router_models else engine_config.model,
                                         engine_config.hf_file, engine_config.revision)
        more = [RoutedModel(*load_tokenizer(model)) for model in router_models[1:]]
        app = create_router_app(tokenizer, name, cluster, server_config, engine_config.max_queue_depth, more)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_config=None,
                                timeout_graceful_shutdown=SOCKET_CLOSE_TIMEOUT_S)
        return uvicorn.Server(config)

    from conveyor.cluster.decode import DecodeNode
    from conveyor.cluster.prefill import PrefillNode
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import create_app
    from conveyor.server.lifecycle import GracefulServer

    engine = AsyncEngine.from_config(engine_config)
    app = create_app(engine, server_config)
    role = PrefillNode if cluster.node_role == "prefill" else DecodeNode
    # It tells the router what its /v1/models lists, and where its HTTP API is (for embeddings, rerank, score).
    attach_node(app, role(engine, cluster, models=[app.state.serving.model_id],
                          http_address=join_address(server_config.host, server_config.port)))
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_config=None,
                            timeout_graceful_shutdown=SOCKET_CLOSE_TIMEOUT_S)
    return GracefulServer(config, app.state.lifecycle)
