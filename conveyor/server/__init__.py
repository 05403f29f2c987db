"""OpenAI-compatible HTTP server: create_app(engine, config) and the `conveyor serve` command."""

from conveyor.server.app import create_app

__all__ = ["create_app"]
