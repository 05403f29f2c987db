from conveyor.engine.block_pool import BlockPool
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams


def _request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def _run_prefill(kv, request):
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_concurrent_requests_share_a_common_prefix_once():
    kv = KVCacheManager(BlockPool(16), block_size=4)
    first = _request("a", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert kv.admit(first, kv.find_prefix(first), 10)
    _run_prefill(kv, first)
    second = _request("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 8 and hit.blocks == kv.block_table("a")[:2]
    assert kv.admit(second, hit, 3)
    assert kv.pool.stats().num_shared == 2  # stored once, referenced twice
    assert second.num_computed_tokens == 8
    kv.free(first)
    kv.free(second)
    kv.pool.check_integrity()
    assert kv.pool.stats().num_cached_free == 2  # the prefix stays cached for the next request


def test_fully_cached_prompt_copies_the_block_it_must_write():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    first = _request("a", range(8))
    assert kv.admit(first, kv.find_prefix(first), 8)
    _run_prefill(kv, first)
    second = _request("b", range(8))
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 7 and len(hit.blocks) == 2  # last token reruns for its logits
    assert kv.admit(second, hit, 1)
    (src, dst), = kv.pending_copies
    assert src == kv.block_table("a")[1] and kv.block_table("b") == [kv.block_table("a")[0], dst]
    assert kv.pool.ref_counts[src] == 1  # only the first request still owns the original
    kv.free(first)
    kv.free(second)
    kv.pool.check_integrity()


def test_admission_is_all_or_nothing():
    kv = KVCacheManager(BlockPool(2), block_size=4)
    big = _request("a", range(12))
    assert not kv.admit(big, kv.find_prefix(big), 12)
    assert kv.pool.all_free() and "a" not in kv.req_blocks


def test_a_cached_block_serves_its_leading_tokens_to_a_prompt_that_diverges_inside_it():
    kv = KVCacheManager(BlockPool(16), block_size=4)
    first = _request("a", range(12))  # three full blocks, all cached after its prefill
    assert kv.admit(first, kv.find_prefix(first), 12)
    _run_prefill(kv, first)
    second = _request("b", list(range(10)) + [70, 71, 72])  # diverges after 2 tokens of the third block
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 10 and hit.num_partial_tokens == 2
    assert hit.blocks == kv.block_table("a")
    assert kv.admit(second, hit, 3)
    (src, dst), = kv.pending_copies  # the shared block is copied before the first write into it
    assert src == kv.block_table("a")[2] and kv.block_table("b")[:3] == kv.block_table("a")[:2] + [dst]
    assert second.num_computed_tokens == 10 and kv.counters.partial_hit_tokens == 2
    kv.free(first)
    kv.free(second)
    kv.pool.check_integrity()


def test_a_first_block_matches_partially_and_eviction_forgets_it():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    first = _request("a", range(8))
    assert kv.admit(first, kv.find_prefix(first), 8)
    _run_prefill(kv, first)
    kv.free(first)
    second = _request("b", [0, 1, 2, 90, 91])
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 3 and len(hit.blocks) == 1
    assert kv.pool.block_tokens[hit.blocks[0]] == (0, 1, 2, 3)
    kv.pool.reset_cache()  # the cached blocks lose their prefixes: nothing partial is left to find
    kv.pool.check_integrity()
    assert kv.find_prefix(_request("c", [0, 1, 2, 90, 91])).num_tokens == 0


def test_no_partial_hit_leaves_the_last_token_to_run():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    first = _request("a", range(8))
    assert kv.admit(first, kv.find_prefix(first), 8)
    _run_prefill(kv, first)
    short = _request("b", [0, 1, 2])  # every token matches the cached block's start; the last must run
    hit = kv.find_prefix(short)
    assert hit.num_tokens == 2 and hit.num_partial_tokens == 2
    other = _request("c", [5, 6, 7])  # shares nothing
    assert kv.find_prefix(other).num_tokens == 0
