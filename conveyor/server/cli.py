"""Serving one node: load the model, start the engine and serve the HTTP API until a signal.

`conveyor serve` (conveyor/cli.py) uses these pieces and dispatches `--node-role` to
conveyor/cluster/serve.py; `python -m conveyor.server.cli [flags]` serves a single node only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from conveyor.config import (ClusterConfig, ConfigError, EngineConfig, ModelsConfig, ServerConfig, add_flags, describe,
                             env_alias_report, load_cluster_config, load_configs, load_models_config)

logger = logging.getLogger("conveyor.server")

SOCKET_CLOSE_TIMEOUT_S = 5.0  # after draining: how long uvicorn waits for connections to close


def load_serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, ClusterConfig,
                                                        ModelsConfig] | None:
    """The configs from flags and environment, logged; None (after saying why) when they are invalid."""
    _setup_logging()
    try:
        engine_config, server_config = load_configs(args)
        cluster_config = load_cluster_config(args)
        models_config = load_models_config(args)
        router_models = cluster_config.node_role == "router" and not (models_config.models_dir
                                                                       or models_config.models_preset)
        if models_config.enabled and cluster_config.node_role is not None and not router_models:
            raise ConfigError("a prefill or decode node serves one model, and a router takes several only as "
                              "--model given more than once (--models-dir and --models-preset are a single server's)")
    except ConfigError as exc:
        print(f"conveyor serve: configuration error: {exc}", file=sys.stderr)
        return None
    for line in env_alias_report(args):
        logger.info("environment: %s", line)
    shown = (engine_config, server_config) + ((cluster_config,) if cluster_config.node_role else ()) \
        + ((models_config,) if models_config.enabled else ())
    logger.info("effective configuration:\n%s", describe(*shown))
    return engine_config, server_config, cluster_config, models_config


def serve_until_signal(build: Callable[[], Any]) -> int:
    """Build the server (a model that does not load is exit 1), then run it until SIGTERM/SIGINT."""
    from conveyor.loading import LoadError

    try:
        server = build()
    except ConfigError as exc:  # a models catalog that does not hold together
        print(f"conveyor serve: configuration error: {exc}", file=sys.stderr)
        return 2
    except (LoadError, ValueError) as exc:  # unreadable model, a context window that does not fit...
        print(f"conveyor serve: cannot start: {exc}", file=sys.stderr)
        return 1
    server.run()
    if getattr(server, "failure", None) is not None:  # loaded after listening (server/deferred.py) and failed
        print(f"conveyor serve: cannot start: {server.failure}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """One node, no role (roles are dispatched by `conveyor serve`, conveyor/cli.py)."""
    configs = load_serve_configs(args)
    if configs is None:
        return 2
    engine_config, server_config, cluster_config, models_config = configs
    if cluster_config.node_role is not None:
        print("conveyor serve: python -m conveyor.server.cli serves a single node; for --node-role use "
              "`conveyor serve` (python -m conveyor.cli serve)", file=sys.stderr)
        return 2
    return serve_until_signal(lambda: build_node_server(engine_config, server_config, models_config))


def build_node_server(engine_config: EngineConfig, server_config: ServerConfig, models_config: ModelsConfig):
    """One model (build_server), or several (server/multimodel/)."""
    if not models_config.enabled:
        return build_server(engine_config, server_config)
    from conveyor.server.multimodel.serve import build_multi_model_server

    return build_multi_model_server(models_config, engine_config, server_config, SOCKET_CLOSE_TIMEOUT_S)


def _setup_logging() -> None:
    # A no-op format-wise when `conveyor` already configured logging; a server logs at INFO at least
    # (the effective config, startup, drain), so only lower a higher root level.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


def build_server(engine_config: EngineConfig, server_config: ServerConfig):
    """The uvicorn server; it listens at once and loads the model on a thread meanwhile (`/health` says
    503 "loading" with the progress until it is ready; server/deferred.py). Nothing runs until `.run()`."""
    # Imported here so `conveyor --help` stays fast.
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import create_app
    from conveyor.server.deferred import DeferredApp
    from conveyor.server.lifecycle import GracefulServer

    def build(progress):
        engine = AsyncEngine.from_config(engine_config, progress=progress)  # built on the thread that will step it
        return create_app(engine, server_config)

    deferred = DeferredApp(build, webui=server_config.webui)
    config = uvicorn.Config(deferred, host=server_config.host, port=server_config.port, log_config=None,
                            timeout_graceful_shutdown=SOCKET_CLOSE_TIMEOUT_S)
    server = GracefulServer(config, None)

    def ready(app) -> None:
        server.lifecycle = app.state.lifecycle
        page = f" (the chat and dashboard page: http://{server_config.host}:{server_config.port}/)" \
            if server_config.webui else ""
        logger.info("ready: serving %s%s", app.state.serving.model_id, page)

    deferred.on_ready, deferred.on_failure = ready, server.fail
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.server.cli", description=__doc__)
    add_flags(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
