"""`conveyor serve`: load the model, start the engine and serve the HTTP API until a signal.

Also runnable alone: `python -m conveyor.server.cli [flags]`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from conveyor.config import (ConfigError, EngineConfig, ServerConfig, add_flags, describe, env_alias_report,
                             load_cluster_config,
                             load_configs)

logger = logging.getLogger("conveyor.server")

SOCKET_CLOSE_TIMEOUT_S = 5.0  # after draining: how long uvicorn waits for connections to close


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                   description="Serve the OpenAI-compatible HTTP API with continuous batching.")
    add_flags(parser)
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    _setup_logging()
    try:
        engine_config, server_config = load_configs(args)
        cluster_config = load_cluster_config(args)
    except ConfigError as exc:
        print(f"conveyor serve: configuration error: {exc}", file=sys.stderr)
        return 2
    for line in env_alias_report(args):
        logger.info("environment: %s", line)
    shown = (engine_config, server_config) + ((cluster_config,) if cluster_config.node_role else ())
    logger.info("effective configuration:\n%s", describe(*shown))
    from conveyor.loading import LoadError

    try:
        if cluster_config.node_role is None:
            server = build_server(engine_config, server_config)
        else:  # disaggregated serving, docs/distributed.md
            from conveyor.cluster.serve import build_cluster_server

            server = build_cluster_server(engine_config, server_config, cluster_config)
    except (LoadError, ValueError) as exc:  # unreadable model, a context window that does not fit...
        print(f"conveyor serve: cannot start: {exc}", file=sys.stderr)
        return 1
    server.run()
    logger.info("server stopped")
    return 0


def _setup_logging() -> None:
    # A no-op format-wise when `conveyor` already configured logging; a server logs at INFO at least
    # (the effective config, startup, drain), so only lower a higher root level.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


def build_server(engine_config: EngineConfig, server_config: ServerConfig):
    """Load the model and wire engine, app and uvicorn (nothing runs until `.run()`)."""
    # Imported here so `conveyor --help` stays fast.
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import create_app
    from conveyor.server.lifecycle import GracefulServer

    engine = AsyncEngine.from_config(engine_config)  # built on the thread that will step it
    app = create_app(engine, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_config=None,
                            timeout_graceful_shutdown=SOCKET_CLOSE_TIMEOUT_S)
    return GracefulServer(config, app.state.lifecycle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.server.cli", description=__doc__)
    add_flags(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
