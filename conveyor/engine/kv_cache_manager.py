"""Per-request block tables on top of the BlockPool: prefix adoption, growth, copy-on-write, release.

Models whose sliding layers keep their K/V apart (engine/window_blocks.py) have a second group with its
own pool and tables; every verb here covers both, all-or-nothing, and a prefix hit is the longest prefix
both can serve. Without one, `window` is None and nothing else changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.block_keys import chain_hashes
from conveyor.engine.block_pool import ROOT_PARENT, BlockPool
from conveyor.engine.disk_store import STATE, WINDOW
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.prefix_reads import DiskReads
from conveyor.engine.request import Request
from conveyor.engine.state_pool import StatePool
from conveyor.engine.window_blocks import WindowBlocks

if TYPE_CHECKING:
    from conveyor.engine.prefix_disk import DiskTier

__all__ = ["CacheCounters", "KVCacheManager", "PrefixHit", "chain_hashes"]

# Interval snapshots one prompt takes at most (its last ones): a 16k-token agent prompt would otherwise fill
# --state-snapshots (8) alone and push out other conversations' snapshots.
INTERVAL_SNAPSHOTS = 2


@dataclass
class PrefixHit:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    state_source: int | None = None  # hybrid models: the snapshot slot holding the state after num_tokens
    num_matched_blocks: int = 0  # blocks the K/V cache matched (a hybrid's hit may stop short, at a snapshot)
    window_blocks: list[int] = field(default_factory=list)  # the sliding group's table for the hit (NULL head)
    num_partial_tokens: int = 0  # of num_tokens, those from the leading part of a cached block
    pending: bool = False  # the prefix is on its way back from the disk tier: the request waits (prefix_reads.py)


@dataclass
class CacheCounters:
    hit_tokens: int = 0
    miss_tokens: int = 0  # prompt tokens that had to be computed at admission
    disk_hit_tokens: int = 0  # tokens of blocks brought back from the disk tier (then counted as hits)
    partial_hit_tokens: int = 0  # tokens adopted from the leading part of a cached block (also in hit_tokens)


class KVCacheManager:
    """Attention K/V in blocks, and (hybrid models) each sequence's recurrent state in a slot of `states`."""

    def __init__(self, pool: BlockPool, block_size: int, states: StatePool | None = None,
                 window: WindowBlocks | None = None, disk: DiskTier | None = None,
                 snapshot_interval: int = 0) -> None:
        self.pool = pool  # the full-attention group (every attention layer when there is no sliding group)
        self.block_size = block_size
        self.states = states
        self.window = window
        # Hybrids: prefills also snapshot every this many tokens (whole blocks; 0 = none).
        self.snapshot_interval = snapshot_interval // block_size * block_size
        self.disk: DiskTier | None = None  # the prefix cache's disk tier (the full group's blocks)
        self.window_disk: DiskTier | None = None  # ... the sliding group's blocks, in the same files
        self.state_disk: DiskTier | None = None  # ... the state snapshots, likewise
        self.disk_reads: DiskReads | None = None
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[int]] = {}  # hashes of the request's full, computed blocks
        self.req_slots: dict[str, int] = {}  # request -> its state slot (hybrid models)
        # Prefix lengths (whole blocks) whose state a request snapshots as its prefill passes them.
        self._snapshot_targets: dict[str, tuple[int, ...]] = {}
        self.counters = CacheCounters()
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do first
        self.pending_state_copies: list[tuple[int, int]] = []  # (src, dst) state slots, likewise
        self.pending_window_copies: list[tuple[int, int]] = []  # (src, dst) blocks of the sliding group
        if disk is not None:
            self.attach_disk(disk)

    def attach_disk(self, disk: DiskTier) -> None:
        """Use `disk` for the prefix cache, and its groups for the sliding blocks and state snapshots; with a
        writer, what each group's RAM gives up goes there."""
        self.disk = disk
        self.disk_reads = DiskReads(self.pool, disk, self.block_size, self.counters)
        self.window_disk = disk.groups.get(WINDOW) if self.window is not None else None
        self.state_disk = disk.groups.get(STATE) if self.states is not None else None
        if disk.writer is None:
            return
        self.pool.on_evict = disk.on_evict
        if self.window_disk is not None:
            self.window.pool.on_evict = self.window_disk.on_evict
        if self.state_disk is not None:
            state_disk = self.state_disk
            self.states.on_evict = lambda slot, key: state_disk.on_evict(slot, key, ())

    def close_disk(self) -> None:
        """Shutdown: reads in flight end and are published, then what RAM still caches in every group goes to
        the disk tier, and the writer finishes (engine thread)."""
        if self.disk is None:
            return
        self.disk_reads.close()
        spill = self.disk.writer is not None
        if spill and self.window_disk is not None:
            self.window_disk.spill_cached(self.window.pool)
        if spill and self.state_disk is not None:
            self.state_disk.spill_rows((slot, key, (), None) for slot, key in self.states.snapshots())
        self.disk.close(self.pool if spill else None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------
    def reap_disk_reads(self) -> None:
        if self.disk_reads is not None:
            self.disk_reads.reap()

    @property
    def disk_reads_pending(self) -> bool:
        return self.disk_reads is not None and self.disk_reads.pending

    def wait_for_disk_reads(self, timeout: float) -> None:
        if self.disk_reads is not None:
            self.disk_reads.wait(timeout)

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request's tokens, in whole blocks; at least one token is left to run.
        Where RAM misses, the disk tier (if any) brings the following blocks back first: inline when few, else
        on the loader thread, and then the hit is `pending` (the request waits; prefix_reads.py)."""
        if not self.pool.enable_caching or not request.cache_prompt:
            return PrefixHit()
        tokens = request.all_token_ids
        max_blocks = len(tokens) // self.block_size
        keys = self.block_keys(request, max_blocks)
        hit = PrefixHit(blocks=self._ram_blocks(tokens, keys))
        if self.disk is not None and self.disk.consult and len(hit.blocks) < max_blocks:
            blocks = self.disk_reads.extend(request.request_id, tokens, keys, hit.blocks)
            if blocks is None:
                return PrefixHit(pending=True)
            hit.blocks = blocks
        hit.num_matched_blocks = len(hit.blocks)
        if self.states is not None or self.window is not None:
            matched = len(hit.blocks)
            return self._limited_hit(tokens, hit, keys[:matched], [self._chunk(tokens, i) for i in range(matched)],
                                     from_disk=self.disk is not None and self.disk.consult)
        # The last token must run to produce logits; if it sits in an adopted block, that
        # block is copied before the write (copy-on-write), see admit().
        hit.num_tokens = min(len(hit.blocks) * self.block_size, len(tokens) - 1)
        return self._extend_into_partial_block(tokens, keys, hit, request.key_spans)

    def _extend_into_partial_block(self, tokens: list[int], keys: list[int], hit: PrefixHit,
                                   spans: list[tuple[int, int, bytes]] = ()) -> PrefixHit:
        """Token-level reuse past the last whole block, as llama-server's prompt cache does: a cached block
        after the matched prefix whose leading tokens equal the request's next ones is adopted for those
        tokens; admit() copies it before the first write (copy-on-write), and the prefill overwrites the rest.
        Exact: a token's K/V depends only on the tokens before it. (Models with one block group only: a
        hybrid resumes only from a state snapshot, a sliding group from whole blocks.)"""
        start = len(hit.blocks) * self.block_size
        stop = min(start + self.block_size, len(tokens) - 1)
        # Never past an image's first token: another image's block can hold the same placeholder tokens.
        stop = min([stop] + [max(first, start) for first, end, _ in spans if end > start])
        wanted = tokens[start:stop]
        if not wanted:
            return hit
        parent = keys[len(hit.blocks) - 1] if hit.blocks else ROOT_PARENT
        block, common = self.pool.longest_partial(parent, wanted)
        if block is None:
            return hit
        hit.blocks.append(block)
        hit.num_tokens = start + common
        hit.num_partial_tokens = common
        return hit

    def ram_prefix_tokens(self, request: Request) -> int:
        """Leading tokens whose blocks RAM holds right now (no side effects: a probe, not an admission)."""
        if not self.pool.enable_caching or not request.cache_prompt:
            return 0
        tokens = request.all_token_ids
        return len(self._ram_blocks(tokens, self.block_keys(request, len(tokens) // self.block_size))) * self.block_size

    def block_keys(self, request: Request, num_blocks: int) -> list[int]:
        """Keys of the request's first num_blocks full blocks (computed once per request)."""
        keys = request.block_keys
        if len(keys) < num_blocks:
            keys += chain_hashes(request.all_token_ids, self.block_size, num_blocks, start=len(keys),
                                 parent=keys[-1] if keys else None, spans=request.key_spans)
        return keys[:num_blocks]

    def _chunk(self, tokens: list[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.block_size:(index + 1) * self.block_size])

    def _ram_blocks(self, tokens: list[int], keys: list[int]) -> list[int]:
        """The blocks RAM holds for the leading keys, up to the first miss (token-verified)."""
        blocks = []
        for i, key in enumerate(keys):
            block = self.pool.lookup(key, self._chunk(tokens, i))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def warm_prefix(self, token_ids: list[int]) -> int:
        """Slot restore: bring token_ids' whole blocks into the prefix cache from the disk tier (RAM hits are
        kept), with the sliding blocks and state snapshot a resume there needs; returns how many tokens from
        the start a longer prompt can now resume after."""
        keys = chain_hashes(token_ids, self.block_size, len(token_ids) // self.block_size)
        blocks = self._ram_blocks(token_ids, keys)
        if self.disk is not None and len(blocks) < len(keys):
            blocks = self.disk_reads.load_now(token_ids, keys, blocks)
        if self.states is None and self.window is None:
            return len(blocks) * self.block_size
        chunks = [self._chunk(token_ids, i) for i in range(len(blocks))]
        hit = self._limited_hit(token_ids, PrefixHit(blocks=blocks), keys[:len(blocks)], chunks,
                                limit=len(token_ids), from_disk=self.disk is not None)
        return hit.num_tokens

    def save_prefix(self, token_ids: list[int]) -> tuple[int, int]:
        """Slot save: write token_ids' leading whole blocks that RAM or the disk holds to the disk tier, ending
        where the other groups can resume too (the sliding blocks its next query reads, a state snapshot), and
        those; returns (tokens saved, bytes written)."""
        disk, size = self.disk, self.block_size
        keys = chain_hashes(token_ids, size, len(token_ids) // size)
        chunks = [self._chunk(token_ids, i) for i in range(len(keys))]
        num_blocks = 0
        while num_blocks < len(keys) and (self.pool.lookup(keys[num_blocks], chunks[num_blocks]) is not None
                                          or disk.contains(keys[num_blocks])):
            num_blocks += 1
        while num_blocks and not self._resumable_at(keys, chunks, num_blocks):
            num_blocks -= 1
        written = 0
        for i in range(num_blocks):
            block = self.pool.lookup(keys[i], chunks[i])
            if block is not None:
                written += disk.write_now(block, keys[i], chunks[i])
        if self.window is not None and num_blocks:
            for i in range(self.window.first_live(num_blocks * size - 1), num_blocks):
                block = self.window.pool.lookup(keys[i], chunks[i])
                if block is not None:
                    written += self.window_disk.write_now(block, keys[i], chunks[i])
        if self.states is not None and num_blocks:
            slot = self.states.lookup(keys[num_blocks - 1])
            if slot is not None:
                written += self.state_disk.write_now(slot, keys[num_blocks - 1], ())
        return num_blocks * size, written

    def _resumable_at(self, keys: list[int], chunks: list[tuple[int, ...]], num_blocks: int) -> bool:
        """Whether RAM or the disk holds what the other groups need to resume after num_blocks whole blocks
        (sliding blocks from the window of a query at either of its last two positions on)."""
        if self.window is not None:
            for i in range(self.window.first_live(num_blocks * self.block_size - 1), num_blocks):
                if self.window.pool.lookup(keys[i], chunks[i]) is None and not self.window_disk.contains(keys[i]):
                    return False
        if self.states is not None:
            key = keys[num_blocks - 1]
            return self.states.has_snapshot(key) or self.state_disk.contains(key)
        return True

    def _limited_hit(self, tokens: list[int], hit: PrefixHit, hashes: list[int], chunks: list[tuple[int, ...]],
                     limit: int | None = None, from_disk: bool = False) -> PrefixHit:
        """The longest matched prefix of whole blocks the rest of the cache can resume from too: the sliding
        group must hold every block its next query reads, and a hybrid resumes only where a state snapshot
        exists (leaving at least one token to run: at most `limit` tokens, by default all but the last).
        `from_disk`: what RAM lacks of those comes from the disk tier where it has it."""
        limit = len(tokens) - 1 if limit is None else limit
        runs = self.window.cached_runs(hashes, chunks) if self.window is not None else []
        for num_blocks in range(len(hit.blocks), 0, -1):
            num_tokens = min(num_blocks * self.block_size, limit)
            if self.states is not None and (num_blocks * self.block_size > limit
                                            or not self._has_snapshot(hashes[num_blocks - 1], from_disk)):
                continue
            if self.window is not None and not self.window.serves(runs, num_blocks, num_tokens):
                if not (from_disk and self._window_from_disk(hashes, chunks, num_blocks, num_tokens)):
                    continue
                runs = self.window.cached_runs(hashes, chunks)
                if not self.window.serves(runs, num_blocks, num_tokens):
                    continue
            slot = None
            if self.states is not None:
                slot = self.states.lookup(hashes[num_blocks - 1])
                if slot is None and from_disk:
                    slot = self._state_from_disk(hashes[num_blocks - 1])
                if slot is None:
                    continue
            window_blocks = [] if self.window is None else self.window.hit_blocks(hashes, chunks, num_blocks,
                                                                                  num_tokens)
            return PrefixHit(hit.blocks[:num_blocks], num_tokens, slot, hit.num_matched_blocks, window_blocks)
        return PrefixHit(num_matched_blocks=hit.num_matched_blocks)

    def _has_snapshot(self, key: int, from_disk: bool) -> bool:
        return self.states.has_snapshot(key) or (from_disk and self.state_disk is not None
                                                 and self.state_disk.contains(key))

    def _window_from_disk(self, hashes: list[int], chunks: list[tuple[int, ...]], num_blocks: int,
                          num_tokens: int) -> bool:
        """Bring the sliding blocks a resume at num_tokens reads that RAM lacks from the disk tier into the
        sliding group's prefix cache (a few blocks: read inline); True when all of them came."""
        window, disk = self.window, self.window_disk
        if disk is None:
            return False
        held, missing = [], []
        for i in range(window.first_live(num_tokens), num_blocks):
            block = window.pool.lookup(hashes[i], chunks[i])
            if block is not None:
                held.append(block)
            elif disk.contains(hashes[i]):
                missing.append(i)
            else:
                return False
        if not missing:
            return False
        window.pool.share(held)  # not evicted to make room for what is read
        fresh = window.pool.allocate(len(missing))
        if fresh is None:
            window.pool.free(held)
            return False
        count = disk.load_run(fresh, [hashes[i] for i in missing], [chunks[i] for i in missing])
        for block, i in zip(fresh[:count], missing):
            window.pool.cache_block(block, hashes[i], chunks[i])
        window.pool.free(held + fresh)
        return count == len(missing)

    def _state_from_disk(self, key: int) -> int | None:
        """The snapshot slot of prefix `key` read from the disk tier, or None (absent, bad, or no spare slot)."""
        disk = self.state_disk
        if disk is None or not disk.contains(key):
            return None
        slot = self.states.reserve_snapshot()
        if slot is None:
            return None
        if disk.load_many([slot], [key], [()]) != 1:
            self.states.free(slot)
            return None
        self.states.commit_snapshot(key, slot)
        return self.states.lookup(key)

    def num_blocks_to_admit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> int:
        """Fresh blocks an admission needs: the adopted prefix is already paid for, unless it sits free-cached."""
        need = self.blocks_needed(hit.num_tokens + num_new_tokens) - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if self.pool.ref_counts[b] == 0)
        copy = 1 if hit.num_tokens % self.block_size else 0
        return max(need, 0) + revived + copy

    def can_admit(self, request: Request, hit: PrefixHit, num_new_tokens: int, reserve: float = 0.0) -> bool:
        """Room in every group for an admission while keeping `reserve` (a share of each pool) free."""
        pool = self.pool
        if self.num_blocks_to_admit(request, hit, num_new_tokens) + int(reserve * pool.num_blocks) \
                > pool.num_free_blocks:
            return False
        if self.window is None:
            return True
        need = self.window.blocks_to_admit(hit.window_blocks, hit.num_tokens, hit.num_tokens + num_new_tokens)
        return need + int(reserve * self.window.pool.num_blocks) <= self.window.pool.num_free_blocks

    def admit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """All-or-nothing: adopt the prefix and allocate room for num_new_tokens more (and a state slot)."""
        if not self.can_admit(request, hit, num_new_tokens):
            return False
        if self.states is not None and not self._take_state_slot(request, hit):
            return False
        self.pool.share(hit.blocks)
        self.req_blocks[request.request_id] = list(hit.blocks)
        self._req_hashes[request.request_id] = []
        if self.window is not None:
            self.window.adopt(request.request_id, hit.window_blocks)
        if not self.grow(request, hit.num_tokens + num_new_tokens):
            self.free(request)  # unreachable when the count above is right; keeps the grant atomic anyway
            return False
        request.num_computed_tokens = hit.num_tokens
        request.num_cached_tokens = hit.num_tokens
        copy = self.copy_on_write(request)
        if copy is not None:
            self.pending_copies.append(copy)
        if self.window is not None:
            copy = self.window.copy_on_write(request.request_id, hit.num_tokens)
            if copy is not None:
                self.pending_window_copies.append(copy)
        self.counters.hit_tokens += hit.num_tokens
        self.counters.partial_hit_tokens += hit.num_partial_tokens
        self.counters.miss_tokens += request.num_tokens - hit.num_tokens
        return True

    def _take_state_slot(self, request: Request, hit: PrefixHit) -> bool:
        slot = self.states.allocate()
        if slot is None:
            return False
        self.req_slots[request.request_id] = slot
        if hit.state_source is not None:  # resume from the prefix's snapshot
            self.pending_state_copies.append((hit.state_source, slot))
            self.states.num_snapshot_hits += 1
        if self.states.max_snapshots and request.cache_prompt and self.pool.enable_caching:
            # Snapshot where this prompt's last whole block ends (the next turn of a chat extends it), where
            # the K/V cache matched it (a prefix others share, such as a system prompt), and every interval on
            # the way (so the first of many prompts sharing a long prefix leaves a snapshot near its end, and a
            # restart finds it on disk, as llama-server's checkpoints during prompt processing).
            prompt_end = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
            matched = hit.num_matched_blocks * self.block_size
            spaced = range(self.snapshot_interval, prompt_end, self.snapshot_interval) if self.snapshot_interval else ()
            spaced = spaced[-INTERVAL_SNAPSHOTS:]  # the last ones: where a shared prefix most likely ends
            self._snapshot_targets[request.request_id] = tuple(sorted(
                {b for b in (prompt_end, matched, *spaced) if hit.num_tokens < b <= request.num_tokens - 1}))
        return True

    def plan_snapshots(self, request: Request, start: int, num_tokens: int) -> tuple[list[tuple[int, int]],
                                                                                  list[tuple[int, int]]]:
        """Snapshots a chunk [start, start + num_tokens) takes: ([(tokens in, slot)], [(prefix hash, slot)])."""
        targets = [b for b in self._snapshot_targets.get(request.request_id, ()) if start < b <= start + num_tokens]
        at, pending = [], []
        for boundary in targets:
            prefix_hash = self.block_keys(request, boundary // self.block_size)[-1]
            if self.states.has_snapshot(prefix_hash):
                continue
            slot = self.states.reserve_snapshot()
            if slot is None:
                break
            at.append((boundary - start, slot))
            pending.append((prefix_hash, slot))
        return at, pending

    def commit_snapshots(self, pending: list[tuple[int, int]]) -> None:
        for prefix_hash, slot in pending:
            self.states.commit_snapshot(prefix_hash, slot)

    def abandon_snapshots(self, pending: list[tuple[int, int]]) -> None:
        """The forward that would have written them failed: the slots go back unwritten."""
        for _, slot in pending:
            self.states.free(slot)

    def release_step(self, plan: SchedulerOutput) -> None:
        """A forward failed: its snapshot and rollback slots go back unwritten (update() never ran)."""
        self.abandon_snapshots(plan.pending_snapshots)
        for chunk in plan.chunks:
            self.free_rollback(chunk)

    def free_rollback(self, chunk: ScheduledChunk) -> None:
        """A speculating chunk's rollback slots back to the pool (after update() restored one, or unwritten)."""
        if chunk.rollback_slot is not None:
            self.states.free(chunk.rollback_slot)
        for slot in chunk.draft_state_slots:
            self.states.free(slot)

    def state_slot(self, request_id: str) -> int | None:
        return self.req_slots.get(request_id)

    def allocate_imported(self, request: Request, num_computed: int, state_slot: int | None = None) -> bool:
        """All-or-nothing: blocks for a request whose KV of [0, num_computed) arrives from elsewhere, plus its
        next token's (and the state slot it was given); the sliding group only from its window on."""
        total = num_computed + 1
        if self.window is not None and not self.window.allocate_table(request.request_id, num_computed, total):
            return False
        blocks = self.pool.allocate(self.blocks_needed(total))
        if blocks is None:
            if self.window is not None:
                self.window.free(request.request_id)
            return False
        self.req_blocks[request.request_id] = blocks
        self._req_hashes[request.request_id] = []
        if state_slot is not None:
            self.req_slots[request.request_id] = state_slot
        return True

    # -- growth ------------------------------------------------------------------------------
    def grow(self, request: Request, total_tokens: int) -> bool:
        """Make room for total_tokens; all-or-nothing."""
        blocks = self.req_blocks[request.request_id]
        need = self.blocks_needed(total_tokens) - len(blocks)
        if self.window is not None:
            return self._grow_both(request, blocks, need, total_tokens)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        blocks.extend(new)
        return True

    def _grow_both(self, request: Request, blocks: list[int], need: int, total_tokens: int) -> bool:
        """grow() with a sliding group: it first gives back what the next query cannot read any more."""
        window = self.window
        window.release(request.request_id, request.num_computed_tokens)
        window_need = window.num_new_blocks(request.request_id, total_tokens)
        if need > self.pool.num_free_blocks or window_need > window.pool.num_free_blocks:
            return False
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if window_need:
            window.extend(request.request_id, window.pool.allocate(window_need))
        return True

    def copy_on_write(self, request: Request) -> tuple[int, int] | None:
        """If the next write lands in a shared or cached block, swap in a private copy: (src, dst) to copy."""
        blocks = self.req_blocks[request.request_id]
        index = request.num_computed_tokens // self.block_size
        if index >= len(blocks):
            return None
        src = blocks[index]
        if self.pool.ref_counts[src] == 1 and not self.pool.is_cached(src):
            return None
        new = self.pool.allocate(1)
        if new is None:
            return None
        blocks[index] = new[0]
        self.pool.free([src])
        return src, new[0]

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.pool.enable_caching or not request.cache_prompt:
            return
        hashes = self._req_hashes[request.request_id]
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= len(hashes):
            return
        tokens = request.all_token_ids
        keys = self.block_keys(request, num_full)
        new = keys[len(hashes):]
        blocks = self.req_blocks[request.request_id]
        for i, block_hash in enumerate(new, start=len(hashes)):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            self.pool.cache_block(blocks[i], block_hash, block_tokens, parent=keys[i - 1] if i else ROOT_PARENT)
            if self.window is not None:
                self.window.cache_block(request.request_id, i, block_hash, block_tokens)
        hashes.extend(new)

    # -- release -----------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        if self.disk_reads is not None:
            self.disk_reads.forget(request.request_id)
        blocks = self.req_blocks.pop(request.request_id, None)
        self._req_hashes.pop(request.request_id, None)
        self._snapshot_targets.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks)
        if self.window is not None:
            self.window.free(request.request_id)
        slot = self.req_slots.pop(request.request_id, None)
        if slot is not None:
            self.states.free(slot)

    def check_integrity(self) -> None:
        """Each pool's invariants, and every block's reference count is the number of tables holding it."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for block in blocks:
                refs[block] += 1
        assert refs == self.pool.ref_counts, "block tables and block reference counts disagree"
        if self.window is not None:
            self.window.check_integrity()
        if self.states is not None:
            self.states.check_integrity()
            assert len(set(self.req_slots.values())) == len(self.req_slots), "two requests share a state slot"

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks[request_id]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def window_table(self, request_id: str) -> list[int]:
        """The sliding group's table (NULL where nothing is held any more); empty without one."""
        return self.window.table(request_id) if self.window is not None else []

    def num_window_blocks_held(self, request_id: str) -> int:
        return self.window.num_blocks_held(request_id) if self.window is not None else 0
