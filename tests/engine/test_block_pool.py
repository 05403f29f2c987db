from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.block_pool import BlockPool


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert pool.allocate(2) is None
    pool.free(blocks)
    pool.check_integrity()
    assert pool.all_free()


def test_cached_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111, (1, 2))
    pool.cache_block(b, 222, (3, 4))
    pool.free([a, b])
    assert pool.lookup(111, (1, 2)) == a
    assert pool.lookup(111, (9, 9)) is None  # hash hit, token mismatch: no adoption
    pool.share([a])  # revive a from the cached-free list
    assert pool.ref_counts[a] == 1
    got = pool.allocate(2)  # the plain block first, then the coldest cached one (b)
    assert got is not None and b in got and pool.lookup(222, (3, 4)) is None
    assert pool.num_evictions == 1
    pool.free(got + [a])
    pool.check_integrity()


def test_shared_block_needs_every_owner_to_free():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.share([a])
    pool.free([a])
    assert pool.ref_counts[a] == 1 and not pool.all_free()
    pool.free([a])
    assert pool.all_free()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "free", "cache", "evict"]),
                          st.integers(0, 5), st.integers(0, 10**6)), max_size=60))
def test_random_operations_keep_integrity(ops):
    pool = BlockPool(8)
    owned: list[list[int]] = []  # one list per owner reference
    for op, n, h in ops:
        if op == "alloc":
            got = pool.allocate(n)
            if got is not None:
                owned.append(got)
        elif op == "share" and owned:
            blocks = owned[n % len(owned)]
            pool.share(blocks)
            owned.append(list(blocks))
        elif op == "free" and owned:
            pool.free(owned.pop(n % len(owned)))
        elif op == "cache" and owned and owned[n % len(owned)]:
            block = owned[n % len(owned)][0]
            pool.cache_block(block, h, (h,))
        elif op == "evict":
            pool.evict_cached(n)
        pool.check_integrity()
    for blocks in owned:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.all_free()
