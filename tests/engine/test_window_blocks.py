"""The sliding layers' own block group: blocks given back as a sequence advances, prefix hits limited to
what the window group still holds, copy-on-write and all-or-nothing across both groups, integrity."""

import pytest
import torch

from conveyor.engine.block_keys import chain_hashes
from conveyor.engine.block_pool import BlockPool
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.memory import WindowGroupNeed, plan_kv_pool
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.window_blocks import WindowBlocks
from conveyor.models.cache_specs import KVSpec, kv_window
from conveyor.runner.model_runner import kv_group_bytes_per_block

BS, WINDOW = 4, 6  # a query at position p reads keys p-5..p: at most 3 blocks of 4


def _manager(full_blocks=32, window_blocks=12, caching=True):
    window = WindowBlocks(BlockPool(window_blocks, enable_caching=caching), BS, WINDOW)
    return KVCacheManager(BlockPool(full_blocks, enable_caching=caching), BS, window=window)


def _request(rid, tokens, max_tokens=64):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def _prefill(kv, request):
    assert kv.admit(request, kv.find_prefix(request), request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def _decode(kv, request, num_steps, token=1000):
    """The scheduler's loop for a decode row: room for the next token, run it, append the sampled one."""
    for _ in range(num_steps):
        assert kv.grow(request, request.num_computed_tokens + 1)
        request.num_computed_tokens += 1
        request.append_output_token(token)
        token += 1
        kv.cache_computed_blocks(request)


def test_blocks_before_the_window_go_back_as_the_sequence_advances():
    kv = _manager()
    request = _request("a", range(10))
    _prefill(kv, request)
    null = kv.window.null_block
    for _ in range(30):
        # The grow before each step gives back every block before the one holding the step's first key.
        first = (request.num_computed_tokens - WINDOW + 1) // BS
        _decode(kv, request, 1)
        table = kv.window_table("a")
        assert table[:first] == [null] * first and null not in table[first:]
        assert kv.num_window_blocks_held("a") <= -(-WINDOW // BS) + 2
        kv.check_integrity()
    assert kv.num_blocks_held("a") == -(-request.num_computed_tokens // BS)  # the full group keeps every block
    assert kv.num_window_blocks_held("a") == 2 < kv.num_blocks_held("a") == 10  # positions 32..39 (a query at 39 reads 34..39)
    kv.free(request)
    kv.check_integrity()
    assert kv.pool.all_free() and kv.window.pool.all_free()


def test_given_back_blocks_stay_cached_and_serve_a_later_hit():
    kv = _manager()
    first = _request("a", range(20))
    _prefill(kv, first)
    _decode(kv, first, 1)  # the grow before it gives back blocks 0..2 (its query at 20 reads 15..20)
    assert kv.window_table("a")[:3] == [kv.window.null_block] * 3
    assert kv.window.pool.num_cached_free_blocks == 3  # cold cached, not plain free
    second = _request("b", list(range(16)) + [90, 91, 92])
    hit = kv.find_prefix(second)
    # Its next query, at 16, reads keys 11..16: blocks 2 and 3, both still cached (2 cold, 3 live).
    assert hit.num_tokens == 16 and hit.blocks == kv.block_table("a")[:4]
    null = kv.window.null_block
    assert hit.window_blocks == [null, null, kv.window.pool.lookup(*_key(range(16), 2)), kv.window_table("a")[3]]
    assert kv.admit(second, hit, 3)
    assert kv.num_window_blocks_held("b") == 3 and kv.num_blocks_held("b") == 5
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.check_integrity()


def _key(tokens, index):
    """(chained key, tokens) of block `index` of a token list, as the prefix cache keys it."""
    tokens = list(tokens)
    return chain_hashes(tokens, BS, index + 1)[-1], tuple(tokens[index * BS:(index + 1) * BS])


def test_a_hit_is_limited_to_what_the_window_group_still_holds():
    kv = _manager()
    first = _request("a", range(20))
    _prefill(kv, first)
    _decode(kv, first, 1)
    kv.free(first)
    kv.window.pool.evict_cached(1)  # the oldest cold block: block 2, given back first (tail first)
    assert kv.window.pool.lookup(*_key(range(20), 2)) is None
    assert kv.pool.lookup(*_key(range(20), 2)) is not None  # the full group still has the whole prefix
    second = _request("b", list(range(16)) + [90])
    hit = kv.find_prefix(second)
    # 16 and 12 tokens would read block 2; 8 tokens read keys 3..8 (blocks 0, 1), which the window group has.
    assert hit.num_tokens == 8 and len(hit.blocks) == 2 and hit.num_matched_blocks == 4
    assert kv.window.null_block not in hit.window_blocks and len(hit.window_blocks) == 2
    assert kv.admit(second, hit, 9)
    assert second.num_computed_tokens == 8
    kv.check_integrity()
    kv.free(second)
    kv.window.pool.reset_cache()
    third = _request("c", list(range(16)) + [90])
    assert kv.find_prefix(third).num_tokens == 0  # nothing left in the window group: no hit at all
    kv.check_integrity()


def test_a_fully_cached_prompt_copies_its_last_block_in_both_groups():
    kv = _manager()
    first = _request("a", range(8))
    _prefill(kv, first)
    second = _request("b", range(8))
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 7 and len(hit.blocks) == 2  # the last token reruns for its logits
    assert kv.admit(second, hit, 1)
    (src, dst), = kv.pending_copies
    (wsrc, wdst), = kv.pending_window_copies
    assert src == kv.block_table("a")[1] and dst == kv.block_table("b")[1]
    assert wsrc == kv.window_table("a")[1] and wdst == kv.window_table("b")[1]
    assert kv.window_table("b")[0] == kv.window_table("a")[0]  # shared: its keys 2..3 are still read
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.check_integrity()


def test_admission_and_growth_are_all_or_nothing_across_groups():
    kv = _manager(full_blocks=32, window_blocks=3)
    big = _request("a", range(16))  # 4 blocks: the full group has room, the window group does not
    assert not kv.admit(big, kv.find_prefix(big), 16)
    assert kv.pool.all_free() and kv.window.pool.all_free() and "a" not in kv.req_blocks
    assert kv.admit(big, kv.find_prefix(big), 8)  # a chunk that fits
    big.num_computed_tokens = 8
    kv.cache_computed_blocks(big)
    other = _request("b", range(100, 104))
    assert kv.admit(other, kv.find_prefix(other), 4)  # the last window block
    assert not kv.grow(big, 16)  # 8..15 need two more window blocks (a query at 8 still reads block 0)
    assert kv.num_blocks_held("a") == 2 and kv.num_window_blocks_held("a") == 2  # nothing taken
    kv.check_integrity()


def test_imported_sequences_hold_only_their_window():
    kv = _manager()
    request = _request("a", range(21))
    assert kv.allocate_imported(request, 20)
    assert kv.num_blocks_held("a") == 6  # positions 0..20
    assert kv.window_table("a")[:3] == [kv.window.null_block] * 3 and kv.num_window_blocks_held("a") == 3
    kv.check_integrity()


def test_integrity_catches_a_table_that_lost_its_reference():
    kv = _manager()
    request = _request("a", range(12))
    _prefill(kv, request)
    kv.window.tables["a"].append(kv.window.tables["a"][0])
    with pytest.raises(AssertionError):
        kv.check_integrity()


def _gemma3_270m_specs():
    """18 layers, every sixth global, the rest sliding over 512 tokens; 1 KV head of 256 dims."""
    return [KVSpec(1, 256, 0 if (i + 1) % 6 == 0 else 512) for i in range(18)]


def test_gemma3_270m_kv_at_4k_tokens():
    specs = _gemma3_270m_specs()
    assert kv_window(specs) == 512
    full_bytes, window_bytes = kv_group_bytes_per_block(specs, 16, torch.bfloat16)
    assert (full_bytes, window_bytes) == (3 * 16 * 1024, 15 * 16 * 1024)
    window = WindowBlocks(BlockPool(64), 16, 512)
    kv = KVCacheManager(BlockPool(512), 16, window=window)
    request = _request("a", [i % 100 for i in range(4096)], max_tokens=8)
    assert kv.admit(request, kv.find_prefix(request), 256)
    for _ in range(16):  # chunked prefill, 256 tokens a tick, as the scheduler runs it
        assert kv.grow(request, request.num_computed_tokens + 256)
        request.num_computed_tokens += 256
        kv.cache_computed_blocks(request)
    assert kv.grow(request, 4097)  # the next decode: its query at 4096 reads keys 3585..4096
    assert (kv.num_blocks_held("a"), kv.num_window_blocks_held("a")) == (257, 33)
    held = kv.num_blocks_held("a") * full_bytes + kv.num_window_blocks_held("a") * window_bytes
    one_group = kv.num_blocks_held("a") * (full_bytes + window_bytes)
    assert (round(one_group / 2**20, 1), round(held / 2**20, 1)) == (72.3, 19.8)
    kv.check_integrity()


def test_plan_gives_the_window_group_its_share_and_the_rest_to_the_full_group():
    full_bytes, window_bytes = kv_group_bytes_per_block(_gemma3_270m_specs(), 16, torch.bfloat16)
    need = WindowGroupNeed(512, window_bytes, prefill_tokens_per_tick=2048, max_prefill_rows=4)
    plan = plan_kv_pool(model_max_len=32768, ctx_size=8 * 4096, num_slots=8, kv_unified=False, block_size=16,
                        bytes_per_block=full_bytes, budget=256 * 2**20, weight_bytes=0, window_group=need)
    assert plan.window_blocks == 8 * (32 + 2) + 2048 // 16 + 4
    assert plan.num_blocks == min(8 * 256, (256 * 2**20 - plan.window_pool_bytes) // full_bytes)
    assert plan.pool_bytes <= 256 * 2**20
    # Unbounded: every slot's window in the full group; the window group never more than that.
    tiny = plan_kv_pool(model_max_len=512, ctx_size=0, num_slots=1, kv_unified=False, block_size=16,
                        bytes_per_block=full_bytes, budget=None, weight_bytes=0, window_group=need)
    assert tiny.window_blocks == tiny.num_blocks == 32
