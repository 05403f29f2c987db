"""Recurrent-state slots of hybrid models (LFM2, Qwen3.5, Mamba2 hybrids). Pure Python ints.

A slot holds one sequence's state over every recurrent layer (fixed bytes, whatever its length). Every
slot is in exactly one place:
  live      held by a running sequence, from admission to finish, abort or preemption
  scratch   held for one step: the state after a speculating row's real token (rolled back to on a miss), or
            after one of its drafts (a spare: at most max_spare of those at once)
  snapshot  the state after a cached prefix of whole blocks, keyed by that prefix's block hash (LRU)
  free
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StateStats:
    num_slots: int
    num_live: int
    num_scratch: int
    num_snapshots: int
    num_free: int
    bytes_per_slot: int
    num_snapshot_hits: int
    num_snapshot_evictions: int


class StatePool:
    def __init__(self, num_slots: int, bytes_per_slot: int, max_snapshots: int = 0, max_spare: int = 0) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self.max_snapshots = max_snapshots  # prefix snapshots kept at most (0: no prefix caching of state)
        self.max_spare = max_spare  # spare scratch slots (draft states) held at most: the slots sized for them
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        self._live: set[int] = set()
        self._scratch: set[int] = set()
        self._spare: set[int] = set()  # the scratch slots allocate_spare handed out
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # prefix hash -> slot, oldest first
        self.num_snapshot_hits = 0
        self.num_snapshot_evictions = 0
        # Called with (slot, prefix hash) just before a snapshot's slot is reused (the disk tier copies it).
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def _take(self) -> int | None:
        if not self._free and self._snapshots:  # a cold snapshot gives way to live work
            self._evict_oldest()
        return self._free.pop() if self._free else None

    # -- live sequences and scratch --------------------------------------------------------------
    def allocate(self) -> int | None:
        """A slot for a sequence from admission to finish; None when every slot is live or scratch."""
        slot = self._take()
        if slot is not None:
            self._live.add(slot)
        return slot

    def allocate_scratch(self) -> int | None:
        slot = self._take()
        if slot is not None:
            self._scratch.add(slot)
        return slot

    def allocate_spare(self) -> int | None:
        """A scratch slot for optional work (a draft's rollback point), within the max_spare slots sized for it: it
        never evicts a snapshot, nor takes a free slot that another row's rollback point or a snapshot counts on."""
        if len(self._spare) >= self.max_spare or not self._free:
            return None
        slot = self.allocate_scratch()
        self._spare.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._live or slot in self._scratch, f"state slot {slot} is not held"
        self._live.discard(slot)
        self._scratch.discard(slot)
        self._spare.discard(slot)
        self._free.append(slot)

    # -- prefix snapshots ------------------------------------------------------------------------
    def lookup(self, prefix_hash: int) -> int | None:
        slot = self._snapshots.get(prefix_hash)
        if slot is not None:
            self._snapshots.move_to_end(prefix_hash)
        return slot

    def has_snapshot(self, prefix_hash: int) -> bool:
        return prefix_hash in self._snapshots

    def reserve_snapshot(self) -> int | None:
        """A slot a forward will write a snapshot into (scratch until commit_snapshot); None if none is spare.

        Snapshots never take the last free slots from live sequences: at most max_snapshots exist."""
        if not self.max_snapshots:
            return None
        if len(self._snapshots) >= self.max_snapshots:
            self._evict_oldest()
        return self.allocate_scratch() if self._free else None

    def commit_snapshot(self, prefix_hash: int, slot: int) -> None:
        """After the forward wrote it: the slot now holds the state after that prefix."""
        self._scratch.discard(slot)
        if prefix_hash in self._snapshots:  # another row snapshotted the same prefix meanwhile
            self._free.append(slot)
            return
        self._snapshots[prefix_hash] = slot

    def _evict_oldest(self) -> None:
        prefix_hash, slot = self._snapshots.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(slot, prefix_hash)
        self._free.append(slot)
        self.num_snapshot_evictions += 1

    def snapshots(self) -> list[tuple[int, int]]:
        """(slot, prefix hash) of every snapshot, oldest first (a shutdown's spill)."""
        return [(slot, prefix_hash) for prefix_hash, slot in self._snapshots.items()]

    def reset_snapshots(self) -> None:
        while self._snapshots:
            self._evict_oldest()

    # -- invariants ------------------------------------------------------------------------------
    def stats(self) -> StateStats:
        return StateStats(self.num_slots, len(self._live), len(self._scratch), len(self._snapshots), len(self._free),
                          self.bytes_per_slot, self.num_snapshot_hits, self.num_snapshot_evictions)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is in exactly one place."""
        free, snaps = set(self._free), set(self._snapshots.values())
        assert len(free) == len(self._free), "a state slot is twice in the free list"
        assert len(snaps) == len(self._snapshots), "two snapshots share a slot"
        places = [free, self._live, self._scratch, snaps]
        for i, a in enumerate(places):
            for b in places[i + 1:]:
                assert not a & b, f"state slots in two places: {sorted(a & b)}"
        assert sum(len(p) for p in places) == self.num_slots, "a state slot is lost"
        assert self._spare <= self._scratch and len(self._spare) <= self.max_spare, "a spare slot outside its share"

    def all_free(self) -> bool:
        """No live or scratch slot (snapshots may stay: they are a cache)."""
        return not self._live and not self._scratch
