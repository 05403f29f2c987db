"""Where a model load stands, for the people waiting on it: a stage, and tensors / bytes of weights done.

EngineCore advances it while it loads (on its loading thread); `/health` reads `view()` while the
server already listens. On a terminal the weights get a tqdm bar; otherwise a log line every
`LOG_EVERY` of the bytes, so a log file shows the load moving too.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from conveyor.models.tensors import QuantizedTensor, Weight

logger = logging.getLogger(__name__)

LOG_EVERY = 0.1  # of the weight bytes, between two log lines when not on a terminal


def weight_nbytes(tensor: Weight) -> int:
    raw = tensor.raw if isinstance(tensor, QuantizedTensor) else tensor
    return raw.numel() * raw.element_size()


class LoadProgress:
    """Written by the loading thread, read from the event loop: plain values under one lock."""

    def __init__(self, show_bar: bool | None = None) -> None:
        self._lock = threading.Lock()
        self.stage = "starting"
        self.started = time.monotonic()
        self.num_tensors = self.num_tensors_done = 0
        self.num_bytes = self.num_bytes_done = 0
        self.download_bytes = self.download_bytes_total = 0  # a Hub download before the load (loading/hub.py)
        self._show_bar = sys.stderr.isatty() if show_bar is None else show_bar
        self._bar: Any = None
        self._next_log = LOG_EVERY

    def set_stage(self, stage: str) -> None:
        with self._lock:
            self.stage = stage
        logger.info("loading: %s", stage)

    def download(self, done: int, total: int) -> None:
        """A Hub download's bytes so far (huggingface_hub shows its own bar on a terminal)."""
        with self._lock:
            stage = self.stage
            self.download_bytes, self.download_bytes_total = done, total
        if total and done >= total:
            self.set_stage("reading the checkpoint")
        elif stage != "downloading":
            self.set_stage("downloading")

    def track(self, weights: Mapping[str, Weight]) -> Mapping[str, Weight]:
        """`weights` as the model reads them, counting each tensor the first time it is taken."""
        with self._lock:
            self.num_tensors = len(weights)
            self.num_bytes = sum(weight_nbytes(w) for w in weights.values())
        if self._show_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=self.num_bytes, unit="B", unit_scale=True, desc="loading weights", leave=False)
        return _Tracked(weights, self)

    def _advance(self, nbytes: int) -> None:
        with self._lock:
            self.num_tensors_done += 1
            self.num_bytes_done += nbytes
            fraction = self.num_bytes_done / self.num_bytes if self.num_bytes else 1.0
        if self._bar is not None:
            self._bar.update(nbytes)
        elif fraction >= self._next_log:
            self._next_log = (int(fraction / LOG_EVERY) + 1) * LOG_EVERY
            logger.info("loading weights: %d/%d tensors, %.0f/%.0f MB (%.0f%%)", self.num_tensors_done,
                        self.num_tensors, self.num_bytes_done / 1e6, self.num_bytes / 1e6, 100 * fraction)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.set_stage("ready")

    def view(self) -> dict:
        """What /health shows while loading."""
        with self._lock:
            return {"stage": self.stage, "tensors": self.num_tensors_done, "tensors_total": self.num_tensors,
                    "bytes": self.num_bytes_done, "bytes_total": self.num_bytes,
                    "fraction": round(self.num_bytes_done / self.num_bytes, 4) if self.num_bytes else 0.0,
                    "elapsed_s": round(time.monotonic() - self.started, 1),
                    **({"download": {"bytes": self.download_bytes, "bytes_total": self.download_bytes_total,
                                     "fraction": round(self.download_bytes / self.download_bytes_total, 4)
                                     if self.download_bytes_total else 0.0}} if self.download_bytes_total else {})}


class _Tracked(Mapping):
    """A read-only view of the checkpoint's weights that reports each first read to the progress."""

    def __init__(self, weights: Mapping[str, Weight], progress: LoadProgress) -> None:
        self._weights = weights
        self._progress = progress
        self._seen: set[str] = set()

    def __getitem__(self, name: str) -> Weight:
        tensor = self._weights[name]
        if name not in self._seen:
            self._seen.add(name)
            self._progress._advance(weight_nbytes(tensor))
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name: object) -> bool:
        return name in self._weights
