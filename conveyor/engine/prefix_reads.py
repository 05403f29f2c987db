"""Prefix blocks on their way back from the disk tier (prefix_disk.py) into the block pool.

A restart's first hit on a long cached prompt reads hundreds of blocks (~0.1-0.2 s for 4k tokens of SmolLM2).
Read on the step loop, that stalls every running stream as long, and the requests that arrive meanwhile
(usually more of the same prompt) miss the next tick. So the scheduler starts the read here and leaves
the request waiting while a loader thread fills fresh blocks; the loop keeps stepping, and the blocks are
published to the prefix cache at the next schedule after the read ends, where that request and those
queued behind it find them in RAM.

Pool bookkeeping stays on the engine thread: the loader thread only writes the bytes of blocks nothing
else holds yet, and the RAM prefix in front of them is shared until then so eviction cannot take it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.engine.block_pool import ROOT_PARENT, BlockPool

if TYPE_CHECKING:
    from conveyor.engine.kv_cache_manager import CacheCounters
    from conveyor.engine.prefix_disk import DiskTier

logger = logging.getLogger(__name__)

# A run this small is read inline (a few ms): a trip through the loader would cost the request a tick and
# hold up the queue behind it for the same time.
INLINE_READ_BYTES = 8 << 20


@dataclass
class DiskRead:
    """One run of prefix blocks being read: keys[i] (token chunk chunks[i]) into blocks[i]."""

    prefix: list[int]  # the RAM blocks in front of the run, shared while it is read
    prefix_keys: list[int]
    keys: list[int]
    parents: list[int]
    chunks: list[tuple[int, ...]]
    blocks: list[int]
    filled: Future | None = None  # -> how many lead intact (None: read on the caller's thread)
    orphaned: bool = False  # the request that started it is gone


class DiskReads:
    """Plans, runs and publishes disk reads for one pool (the engine thread calls everything here)."""

    def __init__(self, pool: BlockPool, disk: DiskTier, block_size: int, counters: CacheCounters) -> None:
        self.pool = pool
        self.disk = disk
        self.block_size = block_size
        self.counters = counters
        self._in_flight: dict[str, DiskRead] = {}  # by the request that started it
        self._done: set[str] = set()  # requests whose read was published since they last asked

    # -- admission's side --------------------------------------------------------------------
    def extend(self, request_id: str, tokens: list[int], keys: list[int], ram_blocks: list[int]) -> list[int] | None:
        """ram_blocks (the request's RAM hit) extended by what the disk has, or None while a read for the
        request is in flight (started here when the run is large). After its read was published, what is
        left (a full pool stopped it short) is read inline: the request does not wait twice."""
        if request_id in self._in_flight:
            return None
        if self.take_done(request_id):
            return self.load_now(tokens, keys, ram_blocks)
        read = self.plan(tokens, keys, ram_blocks)
        if read is None:
            return ram_blocks
        if len(read.blocks) * self.disk.block_bytes <= INLINE_READ_BYTES:
            return self.finish(read, self.disk.load_run(read.blocks, read.keys, read.chunks))
        read.filled = self.disk.load_run_async(read.blocks, read.keys, read.chunks)
        self._in_flight[request_id] = read
        return None

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def take_done(self, request_id: str) -> bool:
        """True once per finished read of this request (then its prefix is as far in RAM as it gets)."""
        if request_id in self._done:
            self._done.discard(request_id)
            return True
        return False

    @property
    def pending(self) -> bool:
        return bool(self._in_flight)

    def reap(self) -> None:
        """Publish every read that has ended (the start of each schedule)."""
        for request_id, read in list(self._in_flight.items()):
            if read.filled.done():
                del self._in_flight[request_id]
                if not read.orphaned:
                    self._done.add(request_id)
                self.finish(read, self._count(read))

    def wait(self, timeout: float) -> None:
        """Block until a read ends or timeout passes (the loop has nothing else to run)."""
        if self._in_flight:
            wait_futures([r.filled for r in self._in_flight.values()], timeout=timeout, return_when="FIRST_COMPLETED")

    def close(self) -> None:
        """Finish every read (shutdown): their blocks go back to the pool like any other."""
        for read in self._in_flight.values():
            wait_futures([read.filled])
        self.reap()
        self._done.clear()

    def forget(self, request_id: str) -> None:
        """The request is gone: a read it started still ends and is published; only its flag goes."""
        self._done.discard(request_id)
        read = self._in_flight.get(request_id)
        if read is not None:
            read.orphaned = True

    # -- both paths ------------------------------------------------------------------------
    def load_now(self, tokens: list[int], keys: list[int], ram_blocks: list[int]) -> list[int]:
        """Read on this thread (a slot restore, or what a finished read left): ram_blocks extended by what
        the disk has intact, published."""
        read = self.plan(tokens, keys, ram_blocks)
        if read is None:
            return ram_blocks
        return self.finish(read, self.disk.load_run(read.blocks, read.keys, read.chunks))

    def plan(self, tokens: list[int], keys: list[int], ram_blocks: list[int]) -> DiskRead | None:
        """Fresh blocks for the run of keys after ram_blocks that the disk has (bounded by the free blocks),
        with ram_blocks shared meanwhile; None when there is nothing to read or no room."""
        first = len(ram_blocks)
        end = first
        while end < len(keys) and self.disk.contains(keys[end]):
            end += 1
        if end == first:
            return None
        self.pool.share(ram_blocks)  # must not be evicted to make room for what is read
        fresh = self.pool.allocate(min(end - first, self.pool.num_free_blocks))
        if not fresh:
            self.pool.free(ram_blocks)
            return None
        run = range(first, first + len(fresh))
        return DiskRead(prefix=list(ram_blocks), prefix_keys=keys[:first], keys=[keys[j] for j in run],
                        parents=[keys[j - 1] if j else ROOT_PARENT for j in run],
                        chunks=[tuple(tokens[j * self.block_size:(j + 1) * self.block_size]) for j in run],
                        blocks=fresh)

    def finish(self, read: DiskRead, filled: int) -> list[int]:
        """Publish the intact lead as if computed here and return every block to the cached-free list;
        returns the prefix it makes (up to the first block the cold-cache budget dropped on the way)."""
        pool = self.pool
        for block, key, chunk, parent in zip(read.blocks[:filled], read.keys, read.chunks, read.parents):
            pool.cache_block(block, key, chunk, parent=parent)
        if filled < len(read.blocks):
            pool.free(read.blocks[filled:])
        out = read.prefix + read.blocks[:filled]
        pool.free(out)  # back to cached-free: admit() adopts them like any other hit
        self.counters.disk_hit_tokens += filled * self.block_size
        for i, (block, key) in enumerate(zip(out, read.prefix_keys + read.keys)):
            if pool.block_hashes[block] != key:
                return out[:i]
        return out

    def _count(self, read: DiskRead) -> int:
        try:
            return read.filled.result()
        except Exception:  # a reader bug must not leak the blocks: nothing of this run is used
            logger.exception("prompt cache disk: a read failed")
            return 0
