"""`conveyor serve` with several models: the catalog, the registry that loads them, the front, the server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import uvicorn

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig
from conveyor.engine.compute_share import ComputeShare
from conveyor.engine.load_progress import LoadProgress
from conveyor.server.apis.response_store import ResponseStore
from conveyor.server.lifecycle import ABORT_WAIT_S, POLL_S, GracefulServer
from conveyor.server.multimodel.app import MultiModelApp
from conveyor.server.multimodel.catalog import ModelSpec, build_catalog
from conveyor.server.multimodel.registry import LoadedModel, ModelRegistry, ModelState

logger = logging.getLogger(__name__)


def engine_app_loader(response_store: ResponseStore, compute_share: ComputeShare | None = None,
                      load_duty: float = 1.0):
    """load_model for the registry: a model's engine (built on the thread that steps it) and its own app,
    without the page and with its metrics (the front serves the page and merges every model's /metrics).
    quiet (other models are streaming): loaded on one intra-op thread, so their steps keep the cores, resting
    between tensors for a load_duty share of the time (--models-load-duty), so it takes less of their memory bandwidth.
    compute_share: the engines' turns on the cores (pooling models in the background)."""
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import create_app

    def load_model(spec: ModelSpec, progress: LoadProgress, quiet: bool) -> LoadedModel:
        engine = AsyncEngine.from_config(spec.engine_config, progress=progress, load_threads=1 if quiet else 0,
                                         load_duty=load_duty if quiet else 1.0, compute_share=compute_share)
        app = create_app(engine, dataclasses.replace(spec.server_config, webui=False, metrics=True),
                         response_store=response_store)
        def resume(resume_progress: LoadProgress, resume_quiet: bool) -> dict[str, int]:
            engine.resume(resume_progress, load_threads=1 if resume_quiet else 0,
                          load_duty=load_duty if resume_quiet else 1.0)
            return engine.core.memory_report()

        return LoadedModel(app, engine.core.memory_report(), suspend=engine.suspend, resume=resume)

    return load_model


def build_multi_model_app(models: ModelsConfig, engine: EngineConfig, server: ServerConfig,
                          load_model=None) -> MultiModelApp:
    """ConfigError (before anything loads) for a catalog that does not hold together."""
    specs = build_catalog(models, engine, server)
    store = ResponseStore(server.responses_store_max, server.responses_store_max_bytes)
    share = ComputeShare(models.models_background_share) if models.models_background_share < 1 else None
    registry = ModelRegistry(specs, load_model or engine_app_loader(store, share, models.models_load_duty), memory_budget=models.memory_budget_bytes,
                             max_loaded=models.models_max, autoload=models.models_autoload,
                             contention=models.models_contention, wait_timeout=models.models_wait_timeout,
                             compute_share=share)
    for spec in specs:
        logger.info("model %s: %s%s", spec.name, spec.source, " (pinned)" if spec.pinned else "")
    return MultiModelApp(registry, server, store)


class MultiModelLifecycle:
    """Graceful shutdown (server/lifecycle.py's contract): stop taking requests, let the running ones end
    within the grace period, abort the rest."""

    def __init__(self, multi: MultiModelApp, grace_seconds: float) -> None:
        self.multi = multi
        self.grace_seconds = grace_seconds

    async def drain(self) -> bool:
        self.multi.draining = True
        clean = await self._wait_idle(self.grace_seconds)
        if not clean:
            for entry in self.multi.registry.entries.values():
                if entry.state is ModelState.LOADED and entry.app is not None:
                    entry.app.state.serving.abort_all()
            await self._wait_idle(ABORT_WAIT_S)
        return clean

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(e.num_active for e in self.multi.registry.entries.values()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


def build_multi_model_server(models: ModelsConfig, engine: EngineConfig, server: ServerConfig,
                             socket_close_timeout: float) -> GracefulServer:
    multi = build_multi_model_app(models, engine, server)
    config = uvicorn.Config(multi, host=server.host, port=server.port, log_config=None,
                            timeout_graceful_shutdown=socket_close_timeout)
    logger.info("serving %d models on http://%s:%d (loaded on first request%s)", len(multi.registry.entries),
                server.host, server.port, ", pinned ones now" if any(s.pinned for s in
                                                                     (e.spec for e in multi.registry.entries.values())) else "")
    return GracefulServer(config, MultiModelLifecycle(multi, server.shutdown_grace_seconds))
