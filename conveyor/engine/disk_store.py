"""The disk tier's files: one checksummed, tagged file per prefix block, a byte budget (least recently used
first out), and the background writer that keeps the step loop off the disk.

A file is `<key hex>.kvb` (a full-attention block), `<key hex>.window.kvb` (a sliding-window block) or
`<key hex>.state.kvb` (a hybrid's recurrent state after a prefix): one directory, budget and LRU for all
the memory groups of a model, each group's keys its own (prefix_disk.py derives them):

    MAGIC (8) | header length, u32 LE (4) | header JSON | payload | CRC-32 of everything before, u32 LE (4)

The header names the block (its key and token ids) and carries the tag: model, weights fingerprint, block
size and every KV tensor's dtype and per-block shape. A file whose checksum, length or tag does not match is
never used: it is counted (corrupt or rejected), logged, and dropped from the index.

The checksum guards against torn and bit-flipped files, not against an adversary (whoever can write the
directory can write any K/V): CRC-32 (zlib) checks a restart's 90 MiB in ~20 ms of CPU where blake2b took
~100 ms, and that read is on the way to a first token. Files of the first format (MAGIC ...1, blake2b) read
as corrupt and are removed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from conveyor.engine.block_keys import KEY_BYTES, key_hex

logger = logging.getLogger(__name__)

MAGIC = b"CVKVBLK2"
SUFFIX = ".kvb"
# The kinds of file, one per memory group: the prefix cache's own blocks (the only kind of one-group models),
# the sliding layers' blocks (window_blocks.py) and hybrids' recurrent-state snapshots (state_pool.py).
KV, WINDOW, STATE = "kv", "window", "state"
# A file's kind -> its name's ending; the kind tells a restart's index which group a file belongs to.
SUFFIXES = {KV: SUFFIX, WINDOW: ".window" + SUFFIX, STATE: ".state" + SUFFIX}
_DIGEST = 4  # CRC-32, little endian


@dataclass
class DiskStats:
    num_entries: int = 0
    num_bytes: int = 0
    num_hits: int = 0  # blocks read back and used
    num_read_bytes: int = 0  # their files' bytes
    num_writes: int = 0
    num_dropped: int = 0  # spills refused because the writer's queue was full
    num_rejected: int = 0  # files of another model / layout (tag mismatch)
    num_corrupt: int = 0  # checksum, length or format wrong
    num_evictions: int = 0  # files removed by the budget
    num_write_errors: int = 0


class DiskStore:
    """The files of one directory, indexed in memory (key -> bytes, least recently used first).

    Thread-safe: the engine thread reads, the writer thread writes and evicts."""

    def __init__(self, directory: str, tag: dict, budget_bytes: int | None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.tag = json.loads(json.dumps(tag, sort_keys=True))  # as a header carries it back
        self.budget_bytes = budget_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()
        self._kinds: dict[int, str] = {}  # keys of files of another kind than KV
        self._pool: ThreadPoolExecutor | None = None  # readers, started by the first multi-block read
        self._local = threading.local()  # each reader's file buffer, reused
        self._scan()

    def _scan(self) -> None:
        """Index what earlier runs left, oldest first by mtime; contents are checked only when read."""
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):  # a write cut short by a crash
                _remove(path)
                continue
            named = _key_of(name)
            if named is None:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append((st.st_mtime_ns, *named, st.st_size))
        for _, key, kind, size in sorted(found):
            self._index[key] = size
            if kind != KV:
                self._kinds[key] = kind
            self.stats.num_bytes += size
        self.stats.num_entries = len(self._index)
        with self._lock:
            self._evict_over_budget()

    def path(self, key: int, kind: str | None = None) -> str:
        """The file of `key` (of `kind`; default: the kind it was indexed with, else KV)."""
        return os.path.join(self.directory, key_hex(key) + SUFFIXES[kind or self._kinds.get(key, KV)])

    def contains(self, key: int) -> bool:
        return key in self._index

    # -- read ------------------------------------------------------------------------------
    def read(self, key: int, tokens: Sequence[int]) -> bytes | None:
        """The block's payload, or None (absent, or a bad file: counted, logged and forgotten)."""
        got: list[bytes] = []
        return got[0] if self.read_many([(key, tokens)], lambda _, payload, __: got.append(bytes(payload))) else None

    def recent_keys(self, limit: int, kind: str = KV) -> list[int]:
        """Up to `limit` keys of `kind`, most recently used first (a start's preload)."""
        with self._lock:
            return list(itertools.islice((k for k in reversed(self._index) if self._kinds.get(k, KV) == kind),
                                         limit))

    def read_many(self, blocks: Sequence[tuple[int, Sequence[int] | None]],
                  consume: Callable[[int, memoryview, dict], None]) -> int:
        """Read a run of blocks; returns how many lead it intact. A block's tokens must match its file's, unless
        given as None (a preload: the file names them). Each intact file's payload and header go to
        consume(i, payload, header) on a reader thread (the view is valid only during the call); the files are
        read and checksummed on a few threads at once (file reads, CRC-32 and copies release the GIL), each into a
        buffer its thread reuses: a restart's first hit reads hundreds. The count stops at the first file
        absent or bad (counted, logged and forgotten); what was read after it goes uncounted."""
        def fetch(i: int) -> str | None:
            key, tokens = blocks[i]
            payload, fault, header = self._fetch(key, tokens)
            if fault is None:
                consume(i, payload, header)
            return fault

        if len(blocks) > 1:
            faults = list(self._readers().map(fetch, range(len(blocks))))
        else:
            faults = [fetch(i) for i in range(len(blocks))]
        count = 0
        for (key, _), fault in zip(blocks, faults):
            if not self._accept(key, fault):
                break
            count += 1
        return count

    def _readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                thread_name_prefix="conveyor-disk-reader")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _fetch(self, key: int, tokens: Sequence[int] | None) -> tuple[memoryview | None, str | None, dict]:
        """Read and check one file into this thread's buffer (no bookkeeping: any thread). fault "missing"
        for a file that is gone."""
        try:
            with open(self.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buffer = getattr(self._local, "buffer", None)
                if buffer is None or len(buffer) < size:
                    buffer = self._local.buffer = bytearray(size)
                data = memoryview(buffer)[:f.readinto(memoryview(buffer)[:size])]
        except OSError:
            return None, "missing", {}
        return self._check(data, key, tokens)

    def _accept(self, key: int, fault: str | None) -> bool:
        """Account for one fetched block (the caller's thread): a hit, or a missing / bad file forgotten."""
        if fault == "missing":
            self._forget(key)
            return False
        if fault is not None:
            corrupt = fault.startswith("corrupt")
            if corrupt:
                self.stats.num_corrupt += 1
            else:
                self.stats.num_rejected += 1
            logger.warning("prompt cache disk: %s not used (%s)", self.path(key), fault)
            self._forget(key, delete=corrupt)  # a mismatched file may be another model's: left in place
            return False
        self.stats.num_hits += 1
        with self._lock:
            if key in self._index:
                self.stats.num_read_bytes += self._index[key]
                self._index.move_to_end(key)
        _touch(self.path(key))  # the LRU order survives a restart
        return True

    def _check(self, data: memoryview, key: int,
               tokens: Sequence[int] | None) -> tuple[memoryview | None, str | None, dict]:
        if len(data) < len(MAGIC) + 4 + _DIGEST or data[:len(MAGIC)] != MAGIC:
            return None, "corrupt: not a block file or truncated", {}
        if _crc32(memoryview(data)[:-_DIGEST]) != bytes(data[-_DIGEST:]):
            return None, "corrupt: checksum mismatch", {}
        (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            header = json.loads(bytes(data[start:start + header_len]))
        except ValueError:
            return None, "corrupt: unreadable header", {}
        payload = data[start + header_len:-_DIGEST]
        if header.get("payload_bytes") != len(payload):
            return None, "corrupt: payload length", {}
        if header.get("tag") != self.tag:
            return None, f"rejected: tag {header.get('tag')} is not this engine's {self.tag}", {}
        names = header.get("tokens")
        if header.get("key") != key_hex(key) or not isinstance(names, list) or (tokens is not None and
                                                                                names != list(tokens)):
            return None, "rejected: the file names another prefix", {}
        return payload, None, header

    # -- write (the writer thread, or a slot save) -----------------------------------------
    def write(self, key: int, tokens: Sequence[int], payload, parent: int | None = None, kind: str = KV) -> int:
        """Write one block atomically (temp file + rename); returns the file's bytes. `parent`: the key of the
        block before it (-1 for a first block), when known."""
        header = json.dumps({"key": key_hex(key), "tag": self.tag, "tokens": list(tokens), "parent": parent,
                             "payload_bytes": memoryview(payload).nbytes}).encode()
        head = MAGIC + struct.pack("<I", len(header)) + header
        digest = _crc32(payload, zlib.crc32(head))
        path = self.path(key, kind)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
            f.write(digest)
            size = f.tell()
        _touch(tmp)
        os.replace(tmp, path)
        with self._lock:
            old = self._index.pop(key, 0)
            self._index[key] = size
            if kind != KV:
                self._kinds[key] = kind
            self.stats.num_bytes += size - old
            self.stats.num_writes += 1
            self._evict_over_budget()
            self.stats.num_entries = len(self._index)
        return size

    def remove(self, key: int) -> None:
        self._forget(key, delete=True)

    def _forget(self, key: int, delete: bool = False) -> None:
        path = self.path(key)
        with self._lock:
            size = self._index.pop(key, None)
            self._kinds.pop(key, None)
            if size is not None:
                self.stats.num_bytes -= size
            self.stats.num_entries = len(self._index)
        if delete:
            _remove(path)

    def _evict_over_budget(self) -> None:
        """Oldest first until the files fit the budget (lock held)."""
        while self.budget_bytes is not None and self.stats.num_bytes > self.budget_bytes and self._index:
            key, size = self._index.popitem(last=False)
            path = self.path(key)
            self._kinds.pop(key, None)
            self.stats.num_bytes -= size
            self.stats.num_evictions += 1
            _remove(path)
        self.stats.num_entries = len(self._index)

    def keys(self) -> list[int]:
        with self._lock:
            return list(self._index)


class SpillWriter:
    """Writes spilled blocks on its own thread. offer() never waits: with the queue full the block is dropped
    (counted), as the engine must not stall on a slow disk."""

    def __init__(self, store: DiskStore, max_queued: int) -> None:
        self.store = store
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._queued: set[int] = set()  # keys waiting, so a block evicted twice is written once
        self._thread = threading.Thread(target=self._run, name="conveyor-disk-writer", daemon=True)
        self._thread.start()

    def has_room(self) -> bool:
        return not self._queue.full()

    def is_queued(self, key: int) -> bool:
        return key in self._queued

    def drop(self) -> None:
        self.store.stats.num_dropped += 1

    def offer(self, key: int, tokens: tuple[int, ...], payload, block: bool = False,
              parent: int | None = None, kind: str = KV) -> bool:
        """Queue a block (payload: a CPU tensor or bytes the caller no longer touches)."""
        try:
            self._queue.put((key, tokens, payload, parent, kind), block=block)
        except queue.Full:
            self.drop()
            return False
        self._queued.add(key)
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is written; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, tokens, payload, parent, kind = item
                try:
                    self.store.write(key, tokens, _as_bytes(payload), parent, kind)
                except OSError as exc:
                    self.store.stats.num_write_errors += 1
                    logger.warning("prompt cache disk: writing %s failed: %s", self.store.path(key, kind), exc)
                finally:
                    self._queued.discard(key)
            finally:
                self._queue.task_done()


def _as_bytes(payload):
    return payload.numpy() if hasattr(payload, "numpy") else payload


def _key_of(name: str) -> tuple[int, str] | None:
    """(key, kind) of a file's name, or None for a name no block file has."""
    stem = name[:2 * KEY_BYTES]
    kind = next((kind for kind, suffix in SUFFIXES.items() if name[2 * KEY_BYTES:] == suffix), None)
    if kind is None:
        return None
    try:
        return int.from_bytes(bytes.fromhex(stem), "little"), kind
    except ValueError:
        return None


def _touch(path: str) -> None:
    """mtime = now, at the clock's resolution (the file system's own stamps can tie within a tick)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def _crc32(data, start: int = 0) -> bytes:
    return struct.pack("<I", zlib.crc32(data, start))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
