"""Vision-tower outputs by image content hash, least recently used first out, encoded on one worker thread.

An image is submitted when its request arrives (prefetch) and the scheduler runs no chunk of a request before
its remaining images are ready, so the tower never stalls the step loop: other rows keep decoding meanwhile.
16 requests about one image encode it once. Every encode runs on the same worker, one image per call, so a
re-encode after eviction gives the same bits: eviction never changes an output.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from conveyor.multimodal.vision import ImageItem, VisionEncoder

DEFAULT_MAX_BYTES = 256 * 2**20  # ~200 Gemma 3 4B images (256 x 2560 bf16)


class EncoderCache:
    def __init__(self, encoder: VisionEncoder, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="vision-encoder")
        self._bytes = 0
        self.num_encoded = 0  # images sent to the tower (misses)
        self.num_hits = 0
        self.encode_seconds = 0.0  # the tower's wall time, summed (written by the worker only)

    def prefetch(self, items: list[ImageItem]) -> None:
        """Start encoding the images not held or under way."""
        self._collect()
        for item in items:
            if item.embeds is None and item.content_hash not in self._rows and item.content_hash not in self._pending:
                self._pending[item.content_hash] = self._worker.submit(self._encode, item)
                self.num_encoded += 1

    def ready(self, item: ImageItem) -> bool:
        """Whether get(item) returns without waiting (one evicted meanwhile is submitted again)."""
        if item.embeds is not None or item.content_hash in self._rows:
            return True
        self.prefetch([item])
        future = self._pending.get(item.content_hash)
        # (None: it finished and joined the LRU meanwhile; a failed one is never ready: take_failures() ends its
        # requests before a chunk of theirs could fail a whole step)
        return future is None or (future.done() and future.exception() is None)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float) -> None:
        """Block until some encode ends or `timeout` passes (an idle step loop waits here, not spinning)."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when="FIRST_COMPLETED")
        self._collect()

    def get(self, item: ImageItem) -> torch.Tensor:
        """(item.num_embeds, text hidden): the item's embeddings, waiting for (or starting) its encode."""
        if item.embeds is not None:  # carried with the item (a handoff): nothing to encode
            return item.embeds
        rows = self._rows.get(item.content_hash)
        if rows is not None:
            self._rows.move_to_end(item.content_hash)
            self.num_hits += 1
            return rows
        self.prefetch([item])
        rows = self._pending.pop(item.content_hash).result()  # an encode's exception fails this step's rows
        self._keep(item.content_hash, rows)
        return rows

    def peek(self, content_hash: str) -> torch.Tensor | None:
        """The rows held for an image, if any, without counting a hit or refreshing its place (a KV handoff's
        export reads them)."""
        self._collect()
        return self._rows.get(content_hash)

    def _keep(self, content_hash: str, rows: torch.Tensor) -> None:
        self._rows[content_hash] = rows
        self._bytes += rows.numel() * rows.element_size()
        while self._bytes > self.max_bytes and len(self._rows) > 1:
            _, old = self._rows.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def _collect(self) -> None:
        """Finished encodes join the LRU (an aborted request's too, so none waits in _pending forever); a failed
        one stays until take_failures()."""
        for content_hash, future in list(self._pending.items()):
            if future.done() and future.exception() is None:
                del self._pending[content_hash]
                self._keep(content_hash, future.result())

    def take_failures(self) -> dict[str, str]:
        """Content hash -> error of each encode that raised, forgotten here (a later request retries it)."""
        failed = {h: f"{type(f.exception()).__name__}: {f.exception()}" for h, f in self._pending.items()
                  if f.done() and f.exception() is not None}
        for content_hash in failed:
            del self._pending[content_hash]
        return failed

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _encode(self, item: ImageItem) -> torch.Tensor:
        started = time.perf_counter()
        rows = self.encoder.encode(item)
        self.encode_seconds += time.perf_counter() - started
        if rows.shape[0] != item.num_embeds:
            raise ValueError(f"vision encoder gave {rows.shape[0]} rows for an image of {item.num_embeds} embeds")
        return rows

    def __len__(self) -> int:
        return len(self._rows)
