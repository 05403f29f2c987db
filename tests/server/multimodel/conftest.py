"""A multi-model server on a free 127.0.0.1 port, in a background thread, for the tests beside this file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig
from conveyor.server.background import serve_app_in_thread
from conveyor.server.multimodel.app import MultiModelApp
from conveyor.server.multimodel.serve import MultiModelLifecycle, build_multi_model_app

ENGINE = EngineConfig(parallel=2, kv_cache_budget="8M", max_queue_depth=64)


@contextmanager
def serve_multi(models: ModelsConfig, server: ServerConfig | None = None,
                engine: EngineConfig = ENGINE) -> Iterator[tuple[str, MultiModelApp]]:
    """A multi-model server (server/multimodel/) on a free port, in a thread; its URL and app."""
    multi = build_multi_model_app(models, engine, server or ServerConfig(metrics=True))
    with serve_app_in_thread(multi, MultiModelLifecycle(multi, 5.0)) as url:
        yield url, multi
