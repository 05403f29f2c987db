"""The engine with a q8_0 KV cache: batching, chunking, prefix hits, preemption, speculation and the KV handoff
never change a greedy output, the pool counts the quantized bytes, and unsupported setups are refused."""

import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.models.config import ModelConfigError
from conveyor.testing import FAMILY_OVERRIDES, tiny_checkpoint, tiny_hybrid_checkpoint
from tests.engine.test_kv_transfer import hand_over, prompts, run_all

pytestmark = pytest.mark.batch_invariant
GREEDY = dict(temperature=0, ignore_eos=True)
Q8 = dict(cache_type_k="q8_0", cache_type_v="q8_0")


def _prompts(n):
    return [f"Story {i}: " + "once upon a time " * (3 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint(head_dim=32)  # q8_0 needs whole 32-value blocks (the default tiny model has 16)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=8, kv_cache_budget="none", **Q8)


def _one_at_a_time_equals_batched(llm, prompts, params):
    batched = llm.generate(prompts, params)
    assert llm.engine.scheduler.stats.num_preemptions == 0
    for prompt, p, got in zip(prompts, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    llm.engine.pool.check_integrity()
    return batched


def test_caches_are_q8_0_and_the_pool_counts_their_bytes(checkpoint, llm):
    for key_cache, value_cache in llm.engine.runner.kv_layers():
        assert key_cache.dtype == value_cache.dtype == torch.uint8 and key_cache.shape[-1] == 34
    bf16 = LLM(checkpoint=checkpoint, parallel=2, kv_cache_budget="none")
    assert llm.engine.pool_plan.bytes_per_block * 64 == bf16.engine.pool_plan.bytes_per_block * 34
    # The same byte budget holds ~1.9x the blocks.
    budget = str(200 * bf16.engine.pool_plan.bytes_per_block)
    small = LLM(checkpoint=checkpoint, parallel=4, kv_cache_budget=budget, ctx_size=4 * 2048)
    more = LLM(checkpoint=checkpoint, parallel=4, kv_cache_budget=budget, ctx_size=4 * 2048, **Q8)
    assert small.engine.pool.num_blocks == 200 and more.engine.pool.num_blocks == 200 * 64 // 34


def test_16_concurrent_equal_one_at_a_time_with_chunked_prefill(llm):
    params = [SamplingParams(max_tokens=4 + 3 * (i % 5), **GREEDY) for i in range(16)]
    batched = _one_at_a_time_equals_batched(llm, _prompts(16), params)
    assert len({tuple(r.token_ids) for r in batched}) > 1  # not a degenerate model


def test_prefix_hit_and_preemption_are_exact_against_cold(checkpoint, llm):
    cold = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, kv_cache_budget="none",
               enable_prefix_caching=False, **Q8)
    system = "You are a helpful assistant. " * 12
    prompts_ = [system + f"Question {i}?" for i in range(6)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    want = cold.generate(prompts_, [params] * 6)
    warm = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, **Q8)
    warm.generate(prompts_[:1], [params])
    got = warm.generate(prompts_, [params] * 6)
    assert all(g.num_cached_tokens >= 16 * 4 for g in got)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # a fully cached prompt: every block adopted, the last one copied on write
    assert warm.generate(prompts_[:1], [params])[0].token_ids == want[0].token_ids
    warm.engine.pool.check_integrity()
    # 36 blocks for 8 requests that each grow to ~9: rows are preempted and recomputed
    tight = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, enable_prefix_caching=False,
                kv_cache_budget=str(36 * cold.engine.pool_plan.bytes_per_block), **Q8)
    assert tight.engine.pool.num_blocks == 36
    long = [SamplingParams(max_tokens=80, **GREEDY) for _ in range(8)]
    want = cold.generate(_prompts(8), long)
    got = tight.generate(_prompts(8), long)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    tight.engine.pool.check_integrity()
    assert tight.engine.pool.all_free()


def test_prompt_lookup_speculation_equals_plain_decoding(checkpoint):
    """Rejected drafts' K/V are simply overwritten (rollback truncates): verified rows equal decoded rows."""
    plain = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=0, kv_cache_budget="none", **Q8)
    spec = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=4, speculative_max_rows=40,
               kv_cache_budget="none", **Q8)
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in range(8)]
    want = plain.generate(_prompts(8), params)
    got = spec.generate(_prompts(8), params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    spec.engine.pool.check_integrity()


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5_text"])
def test_sliding_window_group_and_hybrid_layers_quantize_the_same_way(family):
    checkpoint = (tiny_checkpoint(head_dim=32, **FAMILY_OVERRIDES[family]) if family in FAMILY_OVERRIDES
                  else tiny_hybrid_checkpoint(family, head_dim=32))
    llm = LLM(checkpoint=checkpoint, parallel=8, prefill_chunk_size=8, kv_cache_budget="none", **Q8)
    assert all(k.shape[-1] == 34 for k, _ in llm.engine.runner.kv_layers())
    assert family != "gemma3" or llm.engine.sliding_window  # gemma3's sliding layers keep their own group
    params = [SamplingParams(max_tokens=6 + i % 4, **GREEDY) for i in range(8)]
    _one_at_a_time_equals_batched(llm, _prompts(8), params)


def test_handoff_carries_q8_0_blocks_and_a_bf16_node_refuses_them(checkpoint):
    single, prefill, decode = (EngineCore(EngineConfig(parallel=4, **Q8), checkpoint=checkpoint) for _ in range(3))
    params = SamplingParams(max_tokens=16, **GREEDY)
    ids = prompts(single)
    reference = run_all(single, [single.make_request(p, params, f"ref{i}") for i, p in enumerate(ids)])
    handed = [hand_over(prefill, decode, p, params, f"m{i}") for i, p in enumerate(ids)]
    blob = handed[0][0].kv_handoff.kv
    assert (blob.cache_type_k, blob.cache_type_v) == ("q8_0", "q8_0")
    assert len(blob.data) == blob.num_layers * 2 * blob.num_tokens * blob.num_kv_heads * 34
    outs = run_all(decode, [moved for _, moved in handed])
    assert decode.kv_transfer.stats.num_imported == 3
    for i, (first, _) in enumerate(handed):
        got = first.new_token_ids + [t for o in outs[f"m{i}"] for t in o.new_token_ids]
        assert got == [t for o in reference[f"ref{i}"] for t in o.new_token_ids]
    plain = EngineCore(EngineConfig(parallel=4), checkpoint=checkpoint)
    with pytest.raises(ValueError, match="cache type .*q8_0.*--cache-type-k"):
        plain.kv_transfer.check_layout(blob)


def test_head_dim_not_a_multiple_of_32_is_refused_at_startup(tiny_checkpoint):
    with pytest.raises(ModelConfigError, match="multiple of 32.*head_dim 16"):
        EngineCore(EngineConfig(parallel=2, cache_type_v="q8_0"), checkpoint=tiny_checkpoint)


def test_props_and_cache_stats_show_the_cache_types(llm):
    from types import SimpleNamespace

    from conveyor.server.observability import cache_stats, props

    engine = SimpleNamespace(core=llm.engine, max_queue_depth=1)
    stats = cache_stats(engine)
    assert (stats["cache_type_k"], stats["cache_type_v"]) == ("q8_0", "q8_0")
    assert stats["bytes_per_block"] == llm.engine.pool_plan.bytes_per_block
    assert props(engine, "tiny")["kv_cache_type"] == {"k": "q8_0", "v": "q8_0"}


def test_a_self_draft_with_q8_0_kv_accepts_everything_and_matches_plain_decoding(checkpoint):
    """The draft model's K/V share the blocks and the cache types: same weights, same bits, every draft accepted."""
    params = [SamplingParams(max_tokens=16 + 5 * (i % 3), **GREEDY) for i in range(6)]
    plain = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=0, **Q8)
    spec = LLM(checkpoint=checkpoint, draft_checkpoint=checkpoint, parallel=8, draft_policy="enable",
               speculative_ngram=0, speculative_max_rows=64, **Q8)
    assert all(k.dtype == torch.uint8 for k, _ in spec.engine.runner.drafter.runner.kv_layers())
    want = plain.generate(_prompts(6), params)
    got = spec.generate(_prompts(6), params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0 and stats.num_model_accepted_tokens == stats.num_model_draft_tokens
    spec.engine.pool.check_integrity()
