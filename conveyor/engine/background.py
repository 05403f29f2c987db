"""A load that must not slow the models already serving: the loading thread at idle priority.

Linux's SCHED_IDLE runs a thread only on a core nothing else wants, so a model loading beside others that
stream takes only the time they leave. Used only where the thread can go back to normal priority after
(root or CAP_SYS_NICE: an unprivileged thread may lower its priority but never raise it again); elsewhere
the load runs at normal priority (on one thread: EngineCore's load_threads).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


@contextmanager
def idle_priority() -> Iterator[bool]:
    """The calling thread at SCHED_IDLE for the block where that can be undone; yields whether it is."""
    if not idle_priority_available():
        yield False
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)  # pid 0: this thread (Linux)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield True
    finally:
        os.sched_setscheduler(0, policy, param)


@functools.cache
def idle_priority_available() -> bool:
    """Whether a thread may go to SCHED_IDLE and back: tried once, on a thread of its own."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, policy, param)
            result.append(True)
        except OSError as exc:
            logger.info("background loads at normal priority (no way back from idle priority here: %s)", exc)
            result.append(False)

    thread = threading.Thread(target=probe, name="conveyor-priority-probe")
    thread.start()
    thread.join()
    return result[0]


class PacedWeights(Mapping):
    """A checkpoint's weights that make a background load rest between tensors: after each, as long as the work
    since the previous took times (1 - duty) / duty. Idle priority keeps a load off the cores other models use,
    not off the memory they share: a load streams the file and writes the packed weights at several GB/s, which
    alone lifts a streaming model's p99 inter-token gap ~1.4x here (benchmarks/results.md, issue #40)."""

    def __init__(self, weights: Mapping[str, Any], duty: float) -> None:
        self._weights = weights
        self._rest_per_work = (1 - duty) / duty
        self._seen: set[str] = set()
        self._last: float | None = None

    def __getitem__(self, name: str) -> Any:
        if name not in self._seen:
            self._seen.add(name)
            now = time.monotonic()
            if self._last is not None:
                time.sleep((now - self._last) * self._rest_per_work)
            self._last = time.monotonic()
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name: object) -> bool:
        return name in self._weights
