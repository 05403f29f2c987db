"""What a file yields (a tokenizer, a GGUF header) built once per unchanged file, for the multi-model server.

Its loads run beside streaming models, where any Python or GIL-holding call pauses their streams (the load
runs at idle priority: engine/background.py). So the server reads each catalog model's tokenizer and GGUF
header when it starts (server/multimodel/prefetch.py), and a load takes them from here. Off elsewhere: a
single-model process reads its one model once. What is kept is never changed after it is built.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class FileIdentity:
    """A file as it is now: a rewritten file (new size or mtime) is a new identity, never a stale hit."""

    path: str
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        real = os.path.realpath(path)
        stat = os.stat(real)
        return cls(real, stat.st_ino, stat.st_size, stat.st_mtime_ns)


class FileCache(Generic[T]):
    def __init__(self) -> None:
        self.enabled = False  # the multi-model server turns it on
        self._lock = threading.Lock()
        self._built: dict[tuple, T] = {}
        self._building: dict[tuple, threading.Lock] = {}

    def get_or_build(self, sources: Sequence[str], build: Callable[[], T], extra: Hashable = ()) -> T:
        """What `build` reads from the files `sources` (those absent skipped) and `extra` (what else it takes);
        built once, a second caller of the same files waiting for the first. Disabled: built every time."""
        if not self.enabled:
            return build()
        key = (tuple(FileIdentity.of(path) for path in sources if os.path.exists(path)), extra)
        with self._lock:
            if key in self._built:
                return self._built[key]
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                if key in self._built:
                    return self._built[key]
            value = build()
            with self._lock:
                paths = {identity.path for identity in key[0]}
                # an older version of these files goes
                self._built = {k: v for k, v in self._built.items() if not paths & {i.path for i in k[0]}}
                self._built[key] = value
                self._building.pop(key, None)
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._built)

    def clear(self) -> None:
        with self._lock:
            self._built.clear()
