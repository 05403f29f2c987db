"""The prefix cache's disk tier: between the block pool (ints) and the files (disk_store.py).

    RAM (BlockPool)  --evicted / shutdown-->  copy to CPU bytes  --writer thread-->  DIR/<key>.kvb
         ^                                                                              |
         └------------ a RAM miss that the disk has: read, checked, into a fresh block --┘

A block's payload is the raw bytes of every KV tensor the runner keeps for it (each layer's K then V, in
layer order; an MLA layer's one latent tensor), so any KV dtype or block layout extends it; the tag names each
tensor's dtype and shape.

Models with more than one memory group keep each group's rows in files of their own kind, in the same
directory, budget and LRU (DiskTier.group): the sliding layers' blocks (window_blocks.py) and hybrids'
recurrent-state snapshots (state_pool.py, a "row" being a state slot). Their keys are the prefix's block key
hashed with the kind's name, so the groups never collide; they are read back on a prefix hit that needs them
(a few blocks behind a window, one snapshot), not preloaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.engine.block_keys import KEY_BYTES
from conveyor.engine.block_pool import BlockPool
from conveyor.engine.disk_store import KV, DiskStore, SpillWriter

logger = logging.getLogger(__name__)

TAG_FORMAT = 1
SAMPLE_BYTES = 1 << 20  # a weight file's first and last MiB go into its fingerprint
# Blocks read from the disk in one go (threads read and check them together; ~24 MiB of SmolLM2 K/V): a run
# stops at the first batch with a bad file.
READ_BATCH = 64
STAGING_BYTES = 64 << 20  # a batch's payloads wait in one staging array before they go to their blocks


@dataclass(frozen=True)
class DiskTierConfig:
    directory: str
    budget_bytes: int | None
    spill: bool = True  # write evicted blocks and, at close, every cached one
    consult: bool = True  # find_prefix reads the disk when RAM misses (off: a store only slots use)
    max_queued: int = 256  # blocks waiting for the writer; beyond, spills are dropped (counted)


def group_key(key: int, kind: str) -> int:
    """The file key of a block key in the group `kind` (the key itself for the prefix cache's own blocks)."""
    if kind == KV:
        return key
    digest = hashlib.blake2b(key.to_bytes(KEY_BYTES, "little") + kind.encode(), digest_size=KEY_BYTES).digest()
    return int.from_bytes(digest, "little")


class DiskTier:
    """Rows of `tensors` (indexed by their first dimension: a block, or a state slot) as files of one kind."""

    def __init__(self, config: DiskTierConfig, tag: dict, tensors: list[torch.Tensor], kind: str = KV,
                 parent: DiskTier | None = None) -> None:
        self.config = config
        self.kind = kind
        self.tensors = tensors  # (num_blocks, ...) each: the pool's bytes, per layer K and V (MLA: its one tensor)
        self._sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self._sizes)
        self._views: list[np.ndarray | None] | None = None  # _host_views(), made on first use
        if parent is None:
            self.store = DiskStore(config.directory, tag, config.budget_bytes)
            self.writer = SpillWriter(self.store, config.max_queued) if config.spill else None
        else:  # another memory group of the same model: the same files, budget and writer
            self.store, self.writer = parent.store, parent.writer
        self._owner = parent is None
        self._loader: ThreadPoolExecutor | None = None  # load_run_async's thread, made on first use
        self._local = threading.local()  # each loading thread's staging array
        self.preloaded = 0  # blocks read in by preload() (also counted among the store's hits)
        self.rows_read = 0  # rows (blocks, state slots) filled from files, preloads included
        self.groups: dict[str, DiskTier] = {}  # the other memory groups' tiers (the main tier only)

    def group(self, kind: str, tensors: list[torch.Tensor]) -> DiskTier:
        """The tier of another memory group of this model, sharing this one's files."""
        tier = self.groups[kind] = DiskTier(self.config, self.store.tag, tensors, kind, parent=self)
        return tier

    @property
    def consult(self) -> bool:
        return self.config.consult

    def _file(self, key: int) -> int:
        return group_key(key, self.kind)

    def contains(self, key: int) -> bool:
        return self.store.contains(self._file(key))

    # -- RAM -> disk -----------------------------------------------------------------------
    def on_evict(self, block: int, key: int, tokens: tuple[int, ...], parent: int | None = None) -> None:
        """The pool's eviction hook (engine thread): the block is about to be reused, so its bytes are copied
        now and written later; a full queue drops it rather than wait."""
        writer = self.writer
        name = self._file(key)
        if writer is None or self.store.contains(name) or writer.is_queued(name):
            return
        if not writer.has_room():
            writer.drop()
            return
        writer.offer(name, tokens, self._copy_out(block), parent=parent, kind=self.kind)

    def spill_cached(self, pool: BlockPool) -> int:
        """At shutdown: queue every cached block the disk lacks, waiting for room (nothing steps any more)."""
        return self.spill_rows((block, key, pool.block_tokens[block], pool.block_parents[block])
                               for block, key in enumerate(pool.block_hashes) if key is not None)

    def spill_rows(self, rows) -> int:
        """Queue each (row, key, tokens, parent) the disk lacks, waiting for room; returns how many."""
        if self.writer is None:
            return 0
        count = 0
        for row, key, tokens, parent in rows:
            name = self._file(key)
            if self.store.contains(name) or self.writer.is_queued(name):
                continue
            self.writer.offer(name, tokens, self._copy_out(row), block=True, parent=parent, kind=self.kind)
            count += 1
        return count

    def write_now(self, block: int, key: int, tokens: tuple[int, ...]) -> int:
        """A slot save: written on the caller's thread; returns the bytes written (0 if already there)."""
        name = self._file(key)
        if self.store.contains(name):
            return 0
        return self.store.write(name, tokens, self._copy_out(block).numpy(), kind=self.kind)

    def _copy_out(self, block: int) -> torch.Tensor:
        return torch.cat([t[block].reshape(-1).view(torch.uint8) for t in self.tensors]).cpu()

    # -- disk -> RAM -----------------------------------------------------------------------
    def load_run(self, blocks: list[int], keys: list[int], tokens: list[tuple[int, ...]]) -> int:
        """load_many in batches (READ_BATCH blocks, at most STAGING_BYTES of them), up to the first short one;
        returns how many lead intact."""
        batch = self._batch_blocks()
        filled = 0
        for start in range(0, len(blocks), batch):
            end = min(start + batch, len(blocks))
            count = self.load_many(blocks[start:end], keys[start:end], tokens[start:end])
            filled += count
            if count < end - start:
                break
        return filled

    def load_run_async(self, blocks: list[int], keys: list[int], tokens: list[tuple[int, ...]]) -> Future:
        """load_run on the loader thread (the step loop goes on meanwhile); the future gives its count."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-disk-loader")
        return self._loader.submit(self.load_run, blocks, keys, tokens)

    def load_many(self, blocks: list[int], keys: list[int], tokens: list[tuple[int, ...] | None],
                  names: list[tuple[tuple[int, ...], int | None]] | None = None) -> int:
        """Fill blocks[i] with the stored K/V of (keys[i], tokens[i]) for the leading run the disk has intact;
        returns how many were filled. Each file lands in a row of a staging array on the thread that read it
        (one copy per file), then each KV tensor takes all the run's blocks in one copy: a few dozen copies
        per run instead of one per file and tensor (thousands, each holding the GIL). A None in tokens takes the
        file's own (a preload); `names`, when given, receives each block's (tokens, parent key or None)."""
        wrong_size: set[int] = set()
        staging = self._staging(len(blocks))

        def stage(i: int, payload: memoryview, header: dict) -> None:
            if len(payload) != self.block_bytes:  # a tag match makes this unreachable; never trust it blindly
                wrong_size.add(i)
                return
            staging[i] = np.frombuffer(payload, dtype=np.uint8)
            if names is not None:
                parent = header.get("parent")
                names[i] = (tuple(header["tokens"]), parent if isinstance(parent, int) else None)

        count = self.store.read_many([(self._file(key), chunk) for key, chunk in zip(keys, tokens)], stage)
        if wrong_size and min(wrong_size) < count:
            bad = min(wrong_size)
            self.store.stats.num_corrupt += 1
            self.store.remove(self._file(keys[bad]))
            count = bad
        if count:
            self._scatter(blocks[:count], staging[:count])
        self.rows_read += count
        return count

    def preload(self, pool: BlockPool, max_bytes: int) -> int:
        """A start: read the most recently used blocks (up to max_bytes, the free blocks and the pool's
        cold-cache budget) into the RAM prefix cache, as if computed here, so a restart's first requests hit
        RAM; returns how many. The pool frees a list tail first, so with the newest first they are the last its
        LRU drops. A corrupt file is skipped alone; a file of another model or KV layout ends the preload (the
        directory is likely full of them: one warning, not one per file)."""
        limit = min(max_bytes // max(self.block_bytes, 1), pool.num_free_blocks)
        if pool.max_cached_free is not None:
            limit = min(limit, pool.max_cached_free)
        keys = [key for key in self.store.recent_keys(limit, self.kind) if not pool.holds(key)]
        blocks = pool.allocate(len(keys)) if keys else None
        if not blocks:
            return 0
        filled = start = 0
        while start < len(keys):
            end = min(start + self._batch_blocks(), len(keys))
            names: list = [None] * (end - start)
            rejected = self.store.stats.num_rejected
            count = self.load_many(blocks[start:end], keys[start:end], [None] * (end - start), names)
            for block, key, (tokens, parent) in zip(blocks[start:start + count], keys[start:start + count], names):
                # The parent makes the block a partial-block candidate too (a prompt ending inside it).
                pool.cache_block(block, key, tokens, parent=parent)
            filled += count
            if self.store.stats.num_rejected > rejected:
                logger.warning("prompt cache disk: preload stopped at a file of another model or KV layout in %s",
                               self.config.directory)
                break
            start += count + (count < end - start)  # past a corrupt file (its block stays plain)
        pool.free(blocks)
        self.preloaded += filled
        return filled

    def _batch_blocks(self) -> int:
        """Blocks read together: READ_BATCH, fewer where that many would pass STAGING_BYTES."""
        return max(1, min(READ_BATCH, STAGING_BYTES // max(self.block_bytes, 1)))

    def _staging(self, rows: int) -> np.ndarray:
        """This thread's (rows, block_bytes) staging array, grown as needed (a slot restore on the engine thread
        and the loader thread may read at once)."""
        array = getattr(self._local, "staging", None)
        if array is None or array.shape[0] < rows:
            array = self._local.staging = np.empty((rows, self.block_bytes), dtype=np.uint8)
        return array[:rows]

    def _scatter(self, blocks: list[int], rows: np.ndarray) -> None:
        """rows[i] (a block's payload: each KV tensor's bytes in turn) into blocks[i], one copy per KV tensor."""
        index = np.asarray(blocks, dtype=np.int64)
        offset = 0
        for tensor, view, size in zip(self.tensors, self._host_views(), self._sizes):
            part = rows[:, offset:offset + size]
            if view is not None:
                view[index] = part
            else:  # off the CPU: one transfer of the run's rows of this tensor
                flat = tensor.view(tensor.shape[0], -1).view(torch.uint8)
                flat[torch.from_numpy(index).to(tensor.device)] = torch.from_numpy(np.ascontiguousarray(part)).to(
                    tensor.device)
            offset += size

    def _host_views(self) -> list[np.ndarray | None]:
        """Per KV tensor, its (num_blocks, bytes per block) uint8 numpy view, or None off the CPU / not contiguous."""
        if self._views is None:
            self._views = [t.view(t.shape[0], -1).view(torch.uint8).numpy()
                           if t.device.type == "cpu" and t.is_contiguous() else None for t in self.tensors]
        return self._views

    # -- lifecycle -------------------------------------------------------------------------
    def close(self, pool: BlockPool | None = None, timeout: float = 60.0) -> None:
        """Spill what RAM still caches (when given the pool; the other groups' spill first, by the caller), then
        wait for the writer."""
        if pool is not None:
            num = self.spill_cached(pool)
            if num:
                logger.info("prompt cache disk: writing %d cached blocks to %s", num, self.config.directory)
        for tier in self.groups.values():
            tier.close()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if not self._owner:
            return
        if self.writer is not None:
            self.writer.close(timeout)
        self.store.close()

    def report(self) -> dict:
        stats = self.store.stats
        return {"enabled": True, "dir": self.config.directory, "spill": self.config.spill,
                "consult": self.config.consult, "entries": stats.num_entries, "bytes": stats.num_bytes,
                "budget_bytes": self.config.budget_bytes, "bytes_per_block": self.block_bytes,
                "hits": stats.num_hits, "preloaded": self.preloaded, "writes": stats.num_writes,
                "group_reads": {kind: tier.rows_read for kind, tier in self.groups.items()},
                "dropped": stats.num_dropped,
                "rejected": stats.num_rejected, "corrupt": stats.num_corrupt, "evictions": stats.num_evictions,
                "write_errors": stats.num_write_errors}


def kv_tag(model_name: str, architecture: str, weights: str, block_size: int, tensors: list[torch.Tensor],
           groups: dict[str, list[torch.Tensor]] | None = None) -> dict:
    """What a block file must match to be used here: the model, and every memory group's layout."""
    tag = {"format": TAG_FORMAT, "model": model_name, "arch": architecture, "weights": weights,
           "block_size": block_size, "tensors": _layout(tensors)}
    for kind, group in (groups or {}).items():
        tag[f"{kind}_tensors"] = _layout(group)
    return tag


def _layout(tensors: list[torch.Tensor]) -> list:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in tensors]


def weights_fingerprint(source: str, weights: dict) -> str:
    """A cheap stable name of the weights: each weight file's size, mtime and first/last MiB, or (a checkpoint
    built in memory) every tensor's name, shape and bytes sampled at both ends."""
    digest = hashlib.blake2b(digest_size=16)
    files = _weight_files(source)
    if files:
        for path in files:
            st = os.stat(path)
            digest.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
            with open(path, "rb") as f:
                digest.update(f.read(SAMPLE_BYTES))
                f.seek(max(st.st_size - SAMPLE_BYTES, 0))
                digest.update(f.read(SAMPLE_BYTES))
        return digest.hexdigest()
    for name in sorted(weights):
        tensor = weights[name]
        raw = getattr(tensor, "raw", tensor)  # GGML blocks: their bytes
        flat = raw.detach().reshape(-1).contiguous().view(torch.uint8)
        digest.update(f"{name}:{tuple(raw.shape)}:{raw.dtype}".encode())
        digest.update(flat[:4096].numpy().tobytes())
        digest.update(flat[-4096:].numpy().tobytes())
    return digest.hexdigest()


def _weight_files(source: str) -> list[str]:
    if os.path.isfile(source):
        return [source]
    if os.path.isdir(source):
        return sorted(os.path.join(source, n) for n in os.listdir(source)
                      if n.endswith((".safetensors", ".gguf", ".bin", ".pt")) or n == "config.json")
    return []


def build_disk_tier(config, checkpoint, kv_tensors: list[torch.Tensor],
                    groups: dict[str, list[torch.Tensor]] | None = None) -> DiskTier | None:
    """The tier `config` (EngineConfig) asks for, or None: --prompt-cache-dir for the prefix cache, or only
    --slot-save-path (then a store under it that slots alone use). `groups`: the model's other memory groups
    (WINDOW, STATE: their tensors), each a tier of its own in tier.groups over the same files."""
    from conveyor.config import parse_kv_budget

    if config.prompt_cache_dir is None and config.slot_save_path is None:
        return None
    if not config.enable_prefix_caching:
        logger.warning("prompt cache disk tier and slot persistence need the prefix cache (--no-prompt-cache given)")
        return None
    groups = {kind: tensors for kind, tensors in (groups or {}).items() if tensors}
    tier_on = config.prompt_cache_dir is not None
    if config.slot_save_path is not None:
        os.makedirs(config.slot_save_path, exist_ok=True)
    directory = config.prompt_cache_dir if tier_on else os.path.join(config.slot_save_path, "blocks")
    budget = parse_kv_budget(config.prompt_cache_disk_budget)
    tag = kv_tag(checkpoint.name, checkpoint.config.architecture,
                 weights_fingerprint(checkpoint.source, checkpoint.weights), config.block_size, kv_tensors, groups)
    tier = DiskTier(DiskTierConfig(directory, budget, spill=tier_on, consult=tier_on), tag, kv_tensors)
    for kind, tensors in groups.items():
        tier.group(kind, tensors)
    logger.info("prompt cache disk tier: %s (%d files, %.1f MiB on disk, budget %s)%s", directory,
                tier.store.stats.num_entries, tier.store.stats.num_bytes / 2**20, config.prompt_cache_disk_budget,
                "" if tier_on else ", used by saved slots only")
    return tier
