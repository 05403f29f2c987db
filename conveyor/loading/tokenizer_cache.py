"""Tokenizers built once per file, so a model's load does not build one while other models stream.

Building a tokenizer is one long call into the Rust `tokenizers` library that holds the GIL throughout (a
49k-token BPE: ~30 ms from GGUF metadata, ~80 ms from tokenizer.json; a 128k or 262k vocabulary several
times that). A load beside streaming models runs at idle priority (engine/background.py), so such a call
there stretches into a 100-150 ms pause of every stream. The multi-model server turns the cache on and
builds the tokenizers of its catalog when it starts (server/multimodel/prefetch.py); every load of the same
unchanged file then takes the one built. Off elsewhere: a single-model process builds its one tokenizer once.
A `Tokenizer` is never changed after it is built, so engines share it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from conveyor.loading.tokenizer import Tokenizer


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


class TokenizerCache:
    def __init__(self) -> None:
        self.enabled = False  # the multi-model server turns it on
        self._lock = threading.Lock()
        self._built: dict[tuple, Tokenizer] = {}
        self._building: dict[tuple, threading.Lock] = {}

    def get_or_build(self, sources: Sequence[str], build: Callable[[], Tokenizer], extra: Hashable = ()) -> Tokenizer:
        """The tokenizer read from the files `sources` (a GGUF file; a directory's tokenizer files, those absent
        skipped) and `extra` (what else the build takes); built by `build` once, a second caller of the same files
        waiting for the first. Disabled: built every time."""
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
            tokenizer = build()
            with self._lock:
                paths = {identity.path for identity in key[0]}
                # an older version of these files goes
                self._built = {k: v for k, v in self._built.items() if not paths & {i.path for i in k[0]}}
                self._built[key] = tokenizer
                self._building.pop(key, None)
            return tokenizer

    def __len__(self) -> int:
        with self._lock:
            return len(self._built)

    def clear(self) -> None:
        with self._lock:
            self._built.clear()


TOKENIZERS = TokenizerCache()
