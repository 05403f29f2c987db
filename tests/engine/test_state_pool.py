"""StatePool: every slot in exactly one place, snapshots as an LRU cache that gives way to live work."""

import pytest

from conveyor.engine.state_pool import StatePool


def test_live_and_scratch_slots_come_back():
    pool = StatePool(3, bytes_per_slot=100)
    a, b = pool.allocate(), pool.allocate_scratch()
    assert {a, b} == {0, 1} and pool.num_free == 1 and pool.total_bytes == 300
    pool.check_integrity()
    pool.free(a)
    pool.free(b)
    assert pool.all_free() and pool.num_free == 3
    with pytest.raises(AssertionError, match="not held"):
        pool.free(a)


def test_snapshots_are_an_lru_that_live_work_evicts():
    pool = StatePool(4, bytes_per_slot=8, max_snapshots=2)
    first = pool.reserve_snapshot()
    pool.commit_snapshot(111, first)
    second = pool.reserve_snapshot()
    pool.commit_snapshot(222, second)
    assert pool.lookup(111) == first  # 111 is now the most recent
    third = pool.reserve_snapshot()  # at the cap: the oldest (222) goes
    pool.commit_snapshot(333, third)
    assert pool.lookup(222) is None and pool.has_snapshot(111) and pool.has_snapshot(333)
    assert pool.stats().num_snapshot_evictions == 1
    live = [pool.allocate() for _ in range(4)]  # live sequences take every slot, evicting snapshots
    assert None not in live and pool.stats().num_snapshots == 0
    assert pool.allocate() is None  # all-or-nothing: no slot left, nothing half-granted
    pool.check_integrity()


def test_a_duplicate_snapshot_returns_its_slot_and_none_without_a_budget():
    pool = StatePool(3, bytes_per_slot=8, max_snapshots=2)
    a, b = pool.reserve_snapshot(), pool.reserve_snapshot()
    pool.commit_snapshot(7, a)
    pool.commit_snapshot(7, b)  # two rows snapshotted the same prefix in one tick
    assert pool.stats().num_snapshots == 1 and pool.num_free == 2
    pool.check_integrity()
    assert StatePool(2, bytes_per_slot=8).reserve_snapshot() is None


def test_spare_slots_stay_within_their_share_and_never_evict():
    pool = StatePool(5, bytes_per_slot=8, max_snapshots=2, max_spare=2)
    a, b = pool.allocate_spare(), pool.allocate_spare()
    assert a is not None and b is not None
    assert pool.allocate_spare() is None and pool.num_free == 3  # its share is spent, free slots or not
    pool.free(a)
    c = pool.allocate_spare()
    assert c is not None
    pool.free(b)
    pool.commit_snapshot(1, pool.reserve_snapshot())
    for _ in range(3):
        pool.allocate()
    assert pool.num_free == 0 and pool.stats().num_scratch == 1  # c: one of its two
    assert pool.allocate_spare() is None and pool.stats().num_snapshots == 1  # no free slot: the snapshot stays
    pool.check_integrity()
