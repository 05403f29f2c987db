"""The sliding layers' K/V blocks (Gemma 2/3, hybrids whose attention layers slide): a second block group.

A request's window table is indexed like its full table (entry i holds positions [i*bs, (i+1)*bs)), but
sliding layers read only the last `window` keys, so the entries no later query can read are given back
as the sequence advances and become NULL, the runner's zero block (never allocated, never written):

    positions  0       16      32      48      64      80      96
    full       [ b3   ][ b7   ][ b1   ][ b9   ][ b4   ][ b2   ]     every block, to the end
    window     [ NULL ][ NULL ][ NULL ][ w5   ][ w0   ][ w8   ]     window 40: the next query, at 90, reads 51..90

The attention kernel reads keys [pos - window + 1, pos] through the table, so it never touches a NULL
entry. Given-back blocks that hold a hashed prefix go to the pool's cold LRU: a later prompt sharing
the prefix adopts the recent ones, and a hit of h blocks needs only the blocks its next query reads
(vLLM's SlidingWindowManager works the same way). Pure Python ints, like the BlockPool under it.
"""

from __future__ import annotations

from conveyor.engine.block_pool import BlockPool


class WindowBlocks:
    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        if window < 1:
            raise ValueError("a sliding group needs a window of at least one token")
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.null_block = pool.num_blocks  # one past the pool: the runner's extra zero block
        self.tables: dict[str, list[int]] = {}
        self._num_released: dict[str, int] = {}  # leading NULL entries of each table

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_live(self, num_computed: int) -> int:
        """The first block a query at position num_computed (or later) reads: it holds key num_computed - window + 1."""
        return max(num_computed - self.window + 1, 0) // self.block_size

    # -- prefix hits ---------------------------------------------------------------------------
    def cached_runs(self, hashes: list[int], block_tokens: list[tuple[int, ...]]) -> list[int]:
        """For each block of a prefix the full group matched: how many blocks ending there this group has cached."""
        runs, run = [], 0
        for block_hash, tokens in zip(hashes, block_tokens):
            run = run + 1 if self.pool.lookup(block_hash, tokens) is not None else 0
            runs.append(run)
        return runs

    def serves(self, runs: list[int], num_blocks: int, num_tokens: int) -> bool:
        """Whether a hit of num_blocks whole blocks, resuming at num_tokens, holds every block its next query reads."""
        return num_blocks - self.first_live(num_tokens) <= runs[num_blocks - 1]

    def hit_blocks(self, hashes: list[int], block_tokens: list[tuple[int, ...]], num_blocks: int,
                   num_tokens: int) -> list[int]:
        """The table a hit adopts: NULL up to the window of its next query, then the cached blocks."""
        first = self.first_live(num_tokens)
        cached = [self.pool.lookup(h, t) for h, t in zip(hashes[first:num_blocks], block_tokens[first:num_blocks])]
        assert None not in cached, "hit_blocks() of a prefix serves() rejected"
        return [self.null_block] * first + cached

    def blocks_to_admit(self, hit_blocks: list[int], num_hit_tokens: int, total_tokens: int) -> int:
        """Fresh blocks an admission takes here: new ones, revived cold cached ones, and a copy-on-write one."""
        need = max(self.blocks_needed(total_tokens) - len(hit_blocks), 0)
        revived = sum(1 for b in hit_blocks if b != self.null_block and self.pool.ref_counts[b] == 0)
        copy = 1 if num_hit_tokens % self.block_size else 0
        return need + revived + copy

    # -- per request ---------------------------------------------------------------------------
    def adopt(self, request_id: str, hit_blocks: list[int]) -> None:
        self.pool.share([b for b in hit_blocks if b != self.null_block])
        self.tables[request_id] = list(hit_blocks)
        self._num_released[request_id] = sum(1 for b in hit_blocks if b == self.null_block)

    def release(self, request_id: str, num_computed: int) -> None:
        """Give back the blocks before the next query's window (hashed ones stay findable, as cold cache)."""
        table = self.tables[request_id]
        start, end = self._num_released[request_id], min(self.first_live(num_computed), len(table))
        if end <= start:
            return
        self.pool.free(table[start:end])
        table[start:end] = [self.null_block] * (end - start)
        self._num_released[request_id] = end

    def num_new_blocks(self, request_id: str, total_tokens: int) -> int:
        return max(self.blocks_needed(total_tokens) - len(self.tables[request_id]), 0)

    def extend(self, request_id: str, blocks: list[int]) -> None:
        self.tables[request_id].extend(blocks)

    def allocate_table(self, request_id: str, num_computed: int, total_tokens: int) -> bool:
        """A table for a sequence whose K/V arrives from elsewhere: live blocks only from its window on."""
        first = min(self.first_live(num_computed), self.blocks_needed(total_tokens))
        blocks = self.pool.allocate(self.blocks_needed(total_tokens) - first)
        if blocks is None:
            return False
        self.tables[request_id] = [self.null_block] * first + blocks
        self._num_released[request_id] = first
        return True

    def copy_on_write(self, request_id: str, num_computed: int) -> tuple[int, int] | None:
        """If the next write lands in a shared or cached block, swap in a private copy: (src, dst) to copy."""
        table = self.tables[request_id]
        index = num_computed // self.block_size
        if index >= len(table):
            return None
        src = table[index]
        if self.pool.ref_counts[src] == 1 and not self.pool.is_cached(src):
            return None
        new = self.pool.allocate(1)
        if new is None:
            return None
        table[index] = new[0]
        self.pool.free([src])
        return src, new[0]

    def cache_block(self, request_id: str, index: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        block = self.tables[request_id][index]
        if block != self.null_block:  # given back before it was published: nothing to cache
            self.pool.cache_block(block, block_hash, tokens)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self._num_released.pop(request_id, None)
        if table:
            self.pool.free([b for b in table if b != self.null_block])

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(1 for b in self.tables.get(request_id, ()) if b != self.null_block)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The pool's own invariants, plus: NULL only in each table's released head, and every block's
        reference count is the number of tables that hold it."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for request_id, table in self.tables.items():
            released = self._num_released[request_id]
            assert all(b == self.null_block for b in table[:released]), f"{request_id}: a released entry is live"
            for block in table[released:]:
                assert 0 <= block < self.pool.num_blocks, f"{request_id}: NULL or bad block {block} in its window"
                refs[block] += 1
        assert refs == self.pool.ref_counts, "window tables and block reference counts disagree"
