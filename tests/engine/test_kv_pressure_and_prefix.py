"""Preemption under a tight KV budget and prefix-cache adoption never change greedy output."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(n):
    return [f"Story {i}: " + "once upon a time " * (3 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def roomy(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=8, ctx_size=8 * 512, kv_cache_budget="none",
               enable_prefix_caching=False)


@pytest.mark.batch_invariant
def test_preemption_under_tight_budget_keeps_outputs_exact(tiny_checkpoint, roomy):
    # 36 blocks of 16 tokens for 8 requests that each grow to ~9 blocks: rows must be preempted.
    bytes_per_block = roomy.engine.pool_plan.bytes_per_block
    tight = LLM(checkpoint=tiny_checkpoint, parallel=8, ctx_size=8 * 512, kv_cache_budget=str(36 * bytes_per_block),
                enable_prefix_caching=False)
    assert tight.engine.pool.num_blocks == 36
    params = [SamplingParams(max_tokens=80, **GREEDY) for _ in range(8)]
    want = roomy.generate(_prompts(8), params)
    got = tight.generate(_prompts(8), params)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    tight.engine.pool.check_integrity()
    assert tight.engine.pool.all_free()


@pytest.mark.batch_invariant
def test_prefix_cache_hit_is_exact_and_skips_prefill(tiny_checkpoint, roomy):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=8, ctx_size=8 * 512)
    system = "You are a helpful assistant. " * 12
    prompts = [system + f"Question {i}?" for i in range(6)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    cold = roomy.generate(prompts, [params] * 6)
    first = llm.generate(prompts[:1], [params])[0]
    assert first.num_cached_tokens == 0
    computed_before = llm.engine.scheduler.stats.num_prompt_tokens_computed
    warm = llm.generate(prompts, [params] * 6)
    assert all(w.num_cached_tokens >= 16 * 4 for w in warm)
    assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
    computed = llm.engine.scheduler.stats.num_prompt_tokens_computed - computed_before
    assert computed < sum(len(w.prompt_token_ids) for w in warm) // 2
    # A fully cached prompt adopts every block and copy-on-writes the last one.
    again = llm.generate(prompts[:1], [params])[0]
    assert again.token_ids == cold[0].token_ids
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1 or again.num_cached_tokens % 16 == 0
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


def test_cache_prompt_false_opts_out(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2, ctx_size=2 * 512)
    prompt = llm.tokenizer.encode("shared prefix " * 30)
    engine = llm.engine
    llm.generate([prompt], [SamplingParams(max_tokens=2, **GREEDY)])
    request = engine.make_request(prompt, SamplingParams(max_tokens=2, **GREEDY), cache_prompt=False)
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    assert request.num_cached_tokens == 0


@pytest.mark.batch_invariant
def test_priority_preemption_is_exact_end_to_end(tiny_checkpoint, roomy):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2, ctx_size=2 * 512, enable_preemption=True,
              preemption_policy="longest-first", tick_policy="alternate")
    engine = llm.engine
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    want = roomy.generate(prompts, [params] * 3)
    low = [engine.make_request(llm.tokenizer.encode(p), params, priority=0) for p in prompts[:2]]
    for r in low:
        engine.add_request(r)
    for _ in range(10):
        engine.step()
    high = engine.make_request(llm.tokenizer.encode(prompts[2]), params, priority=10)
    engine.add_request(high)
    while engine.has_work():
        engine.step()
    assert engine.scheduler.stats.num_preemptions >= 1
    assert max(r.num_preemptions for r in low) >= 1
    assert [r.output_token_ids for r in low + [high]] == [w.token_ids for w in want]
    engine.pool.check_integrity()
    assert engine.pool.all_free()


def test_grant_interval_bounds_ttft_end_to_end(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=4, ctx_size=4 * 1024, tick_policy="alternate",
              prefill_chunk_size=32, prefill_grant_interval=2, enable_prefix_caching=False)
    engine = llm.engine
    streams = [engine.make_request(llm.tokenizer.encode(p), SamplingParams(max_tokens=200, **GREEDY))
               for p in _prompts(2)]
    for r in streams:
        engine.add_request(r)
    while not all(r.output_token_ids for r in streams):
        engine.step()
    long = engine.make_request(list(range(100, 100 + 160)), SamplingParams(max_tokens=1, **GREEDY))
    engine.add_request(long)
    ticks = 0
    while not long.output_token_ids:
        engine.step()
        ticks += 1
    assert ticks <= (160 // 32) * (2 + 1)
    assert engine.scheduler.stats.num_prefill_grants >= 4


@pytest.mark.batch_invariant
def test_a_prompt_diverging_inside_a_cached_block_reuses_its_leading_tokens_exactly(tiny_checkpoint, roomy):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=8, ctx_size=8 * 512)
    base = [(7 * i) % 200 + 3 for i in range(70)]  # 4 whole blocks of 16 and 6 tokens into the fifth
    prompts = [base + [201 + i] * 10 for i in range(4)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    cold = roomy.generate(prompts, [params] * 4)
    llm.generate(prompts[:1], [params])  # caches all five blocks of the first prompt
    warm = llm.generate(prompts[1:], [params] * 3)
    assert [w.num_cached_tokens for w in warm] == [70, 70, 70]  # 64 whole + 6 from the fifth block
    assert llm.engine.kv.counters.partial_hit_tokens >= 6
    assert [w.token_ids for w in warm] == [c.token_ids for c in cold[1:]]
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


@pytest.mark.batch_invariant
def test_fan_out_on_one_cached_prompt_is_exact():
    """Requests on one long cached prompt decode together (their tables share its blocks: at AVX-512 BF16 the kernel
    prepares the shared keys once per call and reads them in blocks of rows): every greedy output as the prompt's
    request alone. Head dim 64 and 3 query heads per KV head (SmolLM2's shape), where that path runs."""
    from conveyor.testing import tiny_checkpoint
    checkpoint = tiny_checkpoint(seed=3, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    llm = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512)
    system = "You are a careful agent with tools that read, edit and run code. " * 12
    prompts = [system + f"Task {i}: fix bug {i * 7}." for i in range(7)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    alone = [llm.generate([p], [params])[0].token_ids for p in prompts]
    llm.generate(prompts[:1], [params])
    together = llm.generate(prompts, [params] * len(prompts))
    assert all(t.num_cached_tokens >= 128 for t in together)
    assert [t.token_ids for t in together] == alone
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0
