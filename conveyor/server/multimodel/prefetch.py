"""At start, the tokenizer of every model in the catalog and a GGUF file's header, so loading one later neither
builds the one nor parses the other beside the streams of the models already serving (loading/tokenizer_cache.py
and loading/gguf_header.py say why that pauses them). In the background, at normal priority: the server answers
meanwhile, and a load that comes first reads its own model's (once: the caches let the other caller wait)."""

from __future__ import annotations

import logging
import threading
import time

from conveyor.loading.gguf_header import HEADERS
from conveyor.loading.loader import prefetch_tokenizer
from conveyor.loading.tokenizer_cache import TOKENIZERS
from conveyor.server.multimodel.catalog import ModelSpec

logger = logging.getLogger(__name__)


def start_tokenizer_prefetch(specs: list[ModelSpec]) -> threading.Thread:
    """Turn the tokenizer cache on and fill it on a thread of its own (a load that comes first builds its
    model's tokenizer itself, once: the cache lets the other caller wait)."""
    TOKENIZERS.enabled = HEADERS.enabled = True
    thread = threading.Thread(target=_prefetch, args=([spec.engine_config.model for spec in specs],),
                              name="conveyor-tokenizer-prefetch", daemon=True)
    thread.start()
    return thread


def stop_tokenizer_cache() -> None:
    """The server is done: its tokenizers go, and loads build their own again."""
    TOKENIZERS.enabled = HEADERS.enabled = False
    TOKENIZERS.clear()
    HEADERS.clear()


def _prefetch(sources: list[str | None]) -> None:
    started, count = time.monotonic(), 0
    for source in sources:
        try:
            count += prefetch_tokenizer(source)
        except Exception as exc:  # the model's own load reports what is wrong with its files
            logger.debug("no tokenizer prefetched for %s: %s", source, exc)
    logger.info("tokenizers (and GGUF headers) of %d models read ahead in %.2f s", count, time.monotonic() - started)
