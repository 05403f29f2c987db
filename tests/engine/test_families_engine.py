"""Each dense family on the engine (tiny random weights, bf16 on the CPU kernels): concurrent greedy equals
one at a time, and with sliding windows shorter than the prompts, prefix-cache hits, preemption and
speculative decoding leave the tokens exactly as plain decoding makes them."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import FAMILY_OVERRIDES, tiny_checkpoint

pytestmark = pytest.mark.batch_invariant

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (2 + i % 4) for i in range(8)]  # 20-40 tokens


@pytest.fixture(scope="module", params=sorted(FAMILY_OVERRIDES))
def family(request):
    return tiny_checkpoint(**FAMILY_OVERRIDES[request.param])


@pytest.fixture(scope="module")
def gemma3():
    return tiny_checkpoint(**FAMILY_OVERRIDES["gemma3"])


def test_concurrent_greedy_equals_one_at_a_time(family):
    llm = LLM(checkpoint=family, parallel=8, prefill_chunk_size=16)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 3), **GREEDY) for i in range(8)]
    batched = llm.generate(PROMPTS, params)
    assert len({tuple(b.token_ids) for b in batched}) > 1  # the model is not degenerate
    for prompt, p, got in zip(PROMPTS, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    llm.engine.pool.check_integrity()


def test_windowed_prefix_hits_preemption_and_speculation_stay_exact(gemma3):
    params = [SamplingParams(max_tokens=64, **GREEDY) for _ in range(8)]
    plain = LLM(checkpoint=gemma3, parallel=8, ctx_size=8 * 512, kv_cache_budget="none",
                enable_prefix_caching=False, speculative_ngram=0)
    want = [w.token_ids for w in plain.generate(PROMPTS, params)]
    # Prefix hits: a shared 40-token system text, cached blocks adopted past the window.
    system = "You are a helpful assistant. " * 6
    cached = LLM(checkpoint=gemma3, parallel=8, ctx_size=8 * 512, speculative_ngram=0)
    cold = [w.token_ids for w in plain.generate([system + p for p in PROMPTS[:4]], params[:4])]
    cached.generate([system + PROMPTS[0]], params[:1])
    warm = cached.generate([system + p for p in PROMPTS[:4]], params[:4])
    assert all(w.num_cached_tokens >= 32 for w in warm)
    assert [w.token_ids for w in warm] == cold
    # Preemption: 36 blocks of 16 tokens for 8 requests growing to ~6 blocks each (in the full-attention
    # layers' group; the sliding layers' own blocks come off the budget first).
    plan = plain.engine.pool_plan
    tight = LLM(checkpoint=gemma3, parallel=8, ctx_size=8 * 512, enable_prefix_caching=False, speculative_ngram=0,
                kv_cache_budget=str(plan.window_pool_bytes + 36 * plan.bytes_per_block))
    assert [g.token_ids for g in tight.generate(PROMPTS, params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    # Speculation: drafts verified as prefill rows attend through the same windows.
    spec = LLM(checkpoint=gemma3, parallel=8, ctx_size=8 * 512, speculative_ngram=4, speculative_max_rows=40)
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    for llm in (cached, tight, spec):
        llm.engine.pool.check_integrity()


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
def test_gemma4_sixteen_concurrent_equal_one_at_a_time(experts):
    """Gemma 4: K/V-sharing layers attend over earlier layers' caches (sliding and global), PLE, per-layer head
    dims, and (26B-A4B's shape) experts beside every dense MLP; windows shorter than the prompts. Prefix hits and
    speculation keep the tokens too."""
    from conveyor.testing import TINY_GEMMA4_EXPERTS, tiny_gemma4_checkpoint

    checkpoint = tiny_gemma4_checkpoint(**(TINY_GEMMA4_EXPERTS if experts else {}))
    prompts = [f"Echo {i}: " + "alpha beta gamma delta " * (2 + i % 4) for i in range(16)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 3), **GREEDY) for i in range(16)]
    llm = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, speculative_ngram=0)
    assert len(llm.engine.runner.kv_caches) == 4  # layers 4 and 5 keep no K/V of their own
    # ... nor bytes in the plan: a 16-token block holds K and V (bf16) of layers 1, 3 (1 head x 32) in the full
    # group and of layers 0, 2 (2 heads x 16) in the sliding one
    plan = llm.engine.pool_plan
    assert (plan.bytes_per_block, plan.window_bytes_per_block) == (2 * 16 * 1 * 32 * 2 * 2, 2 * 16 * 2 * 16 * 2 * 2)
    batched = llm.generate(prompts, params)
    assert len({tuple(b.token_ids) for b in batched}) > 1  # the model is not degenerate
    for prompt, p, got in zip(prompts, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    llm.engine.pool.check_integrity()
    # a cached prefix longer than the window, and n-gram drafts verified as prefill rows
    spec = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, speculative_ngram=4)
    spec.generate([prompts[3]], params[3:4])
    again = spec.generate(prompts, params)
    assert [g.token_ids for g in again] == [b.token_ids for b in batched]
    assert again[3].num_cached_tokens >= 16 and spec.engine.scheduler.stats.num_accepted_tokens > 0
    spec.engine.pool.check_integrity()


def test_gemma3n_sixteen_concurrent_equal_one_at_a_time():
    """Gemma 3n: AltUp streams, LAuReL, a sparse MLP gate (row statistics), K/V-sharing layers, PLE; windows shorter
    than the prompts. A prefix hit and speculation keep the tokens too."""
    from conveyor.testing import tiny_gemma3n_checkpoint

    checkpoint = tiny_gemma3n_checkpoint()
    prompts = [f"Echo {i}: " + "alpha beta gamma delta " * (2 + i % 4) for i in range(16)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 3), **GREEDY) for i in range(16)]
    llm = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, speculative_ngram=0)
    assert len(llm.engine.runner.kv_caches) == 4  # layers 4 and 5 keep no K/V of their own
    batched = llm.generate(prompts, params)
    assert len({tuple(b.token_ids) for b in batched}) > 1  # the model is not degenerate
    for prompt, p, got in zip(prompts, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    llm.engine.pool.check_integrity()
    spec = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, speculative_ngram=4)
    spec.generate([prompts[3]], params[3:4])
    again = spec.generate(prompts, params)
    assert [g.token_ids for g in again] == [b.token_ids for b in batched]
    assert again[3].num_cached_tokens >= 16 and spec.engine.scheduler.stats.num_accepted_tokens > 0
    spec.engine.pool.check_integrity()
