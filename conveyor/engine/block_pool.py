"""Fixed-size KV blocks with reference counts and a prefix-hash cache. Pure Python ints.

Every block is in exactly one of three places:
  used          ref_count > 0 (owned by one or more sequences)
  free_cached   ref_count == 0, still holds a full block of a known prefix (LRU, evictable)
  free_plain    ref_count == 0, holds nothing worth keeping
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Called with (block, key, tokens, parent key) just before a cached block loses its prefix (the disk tier copies
# it out).
EvictHook = Callable[[int, int, tuple[int, ...], "int | None"], None]  # (block, key, tokens, parent key)

ROOT_PARENT = -1  # the parent key of a prompt's first block (block keys are non-negative)


@dataclass
class BlockStats:
    num_blocks: int
    num_used: int
    num_free: int  # free_plain + free_cached (a cached block is reusable on demand)
    num_cached: int  # blocks holding a hashed prefix, used or not
    num_cached_free: int
    num_shared: int  # used by more than one sequence
    num_evictions: int


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, max_cached_free: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The prompt-cache budget: cold cached prefixes kept beyond it are dropped (oldest first)
        # as blocks are freed, so the cache never holds more than its share. None = the pool bounds it.
        self.max_cached_free = max_cached_free
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Cached blocks by the key of the block before them, for partial-block hits (longest_partial).
        self.block_parents: list[int | None] = [None] * num_blocks
        self._children: dict[int, set[int]] = {}
        # Reverse order so block 0 is handed out first (easier to read in tests and dumps).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[int, int] = {}
        self.num_evictions = 0
        self.on_evict: EvictHook | None = None

    # -- capacity --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # -- allocate / free -------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """All-or-nothing: fresh blocks with ref_count 1, or None. Plain blocks go before cold cached ones."""
        if num_blocks > self.num_free_blocks:
            return None
        blocks = []
        for _ in range(num_blocks):
            if self._free_plain:
                block = self._free_plain.pop()
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Take another reference on blocks (adopting a cached or live prefix)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        # Release tail first so a sequence's prefix stays cached longest under LRU.
        for block in reversed(blocks):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)
        if self.max_cached_free is not None and len(self._free_cached) > self.max_cached_free:
            self.evict_cached(len(self._free_cached) - self.max_cached_free)

    def evict_cached(self, num_blocks: int) -> int:
        """Drop up to num_blocks cold cached prefixes (oldest first); returns how many went."""
        evicted = 0
        while evicted < num_blocks and self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._evict(block)
            self._free_plain.append(block)
            evicted += 1
        return evicted

    def uncache(self, blocks: Sequence[int]) -> int:
        """Drop these blocks' prefixes where no sequence holds them (a slot erase; no eviction hook: the
        content is unwanted, not cold). Returns how many went."""
        dropped = 0
        for block in blocks:
            if self.ref_counts[block] == 0 and block in self._free_cached:
                del self._free_cached[block]
                self._forget(block)
                self._free_plain.append(block)
                dropped += 1
        return dropped

    def reset_cache(self) -> None:
        self.evict_cached(len(self._free_cached))

    # -- prefix cache ----------------------------------------------------------------------
    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        block = self._hash_to_block.get(block_hash)
        # A hash hit is confirmed by the tokens themselves, so a collision can never leak KV.
        if block is None or self.block_tokens[block] != tokens:
            return None
        return block

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._hash_to_block

    def cache_block(self, block: int, block_hash: int, tokens: tuple[int, ...], parent: int | None = None) -> None:
        """Publish a full block; `parent` (the previous block's key, ROOT_PARENT for a first block) also makes
        it findable by longest_partial."""
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        if block_hash in self._hash_to_block:
            return  # another block already holds this prefix; keep the first
        self.block_hashes[block] = block_hash
        self.block_tokens[block] = tokens
        self._hash_to_block[block_hash] = block
        if parent is not None:
            self.block_parents[block] = parent
            self._children.setdefault(parent, set()).add(block)

    def longest_partial(self, parent: int, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The cached block following `parent` whose tokens share the longest leading run with `tokens`, and
        that run's length ((None, 0) when none shares a first token). Ties go to the lowest block number
        (any of them holds the same K/V for the shared run)."""
        best, best_len = None, 0
        for block in sorted(self._children.get(parent, ())):
            cached = self.block_tokens[block]
            common = 0
            for a, b in zip(cached, tokens):
                if a != b:
                    break
                common += 1
            if common > best_len:
                best, best_len = block, common
        return best, best_len

    def is_cached(self, block: int) -> bool:
        return self.block_hashes[block] is not None

    def _evict(self, block: int) -> None:
        if self.on_evict is not None:
            self.on_evict(block, self.block_hashes[block], self.block_tokens[block], self.block_parents[block])
        self._forget(block)
        self.num_evictions += 1

    def _forget(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
        self.block_hashes[block] = None
        self.block_tokens[block] = None
        parent = self.block_parents[block]
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block)
            if not siblings:
                del self._children[parent]
            self.block_parents[block] = None

    # -- invariants ------------------------------------------------------------------------
    def stats(self) -> BlockStats:
        used = sum(1 for r in self.ref_counts if r > 0)
        return BlockStats(
            num_blocks=self.num_blocks, num_used=used, num_free=self.num_free_blocks,
            num_cached=len(self._hash_to_block), num_cached_free=len(self._free_cached),
            num_shared=sum(1 for r in self.ref_counts if r > 1), num_evictions=self.num_evictions,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is accounted for exactly once."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a block is twice in the plain free list"
        assert not plain & cached, "a block is both plain-free and cached-free"
        for block, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"block {block} has negative ref count"
            where = (refs > 0) + (block in plain) + (block in cached)
            assert where == 1, f"block {block} is in {where} places (refs={refs})"
            if block in cached:
                assert self.block_hashes[block] is not None, f"cached-free block {block} has no hash"
            if block in plain:
                assert self.block_hashes[block] is None, f"plain-free block {block} still has a hash"
        for block_hash, block in self._hash_to_block.items():
            assert self.block_hashes[block] == block_hash, f"hash map points at block {block} wrongly"
        for parent, children in self._children.items():
            for block in children:
                assert self.block_parents[block] == parent and self.block_hashes[block] is not None, \
                    f"block {block} is indexed under a parent it does not have"
        assert len(plain) + len(cached) + sum(1 for r in self.ref_counts if r > 0) == self.num_blocks

    def all_free(self) -> bool:
        return all(r == 0 for r in self.ref_counts)
