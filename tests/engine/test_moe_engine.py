"""The engine on tiny random Mixtral, Qwen3-MoE, Llama 4 (text) and GPT-OSS (sliding and full layers with attention
sinks): 16 concurrent greedy requests == one at a time (bf16), Llama 4's over prompts several attention chunks long."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import tiny_moe_checkpoint

pytestmark = pytest.mark.batch_invariant
GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: " + "lorem ipsum dolor " * (i % 5 * 2) + f"end {i}" for i in range(n)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "llama4_text", "gpt_oss"])
def llm(request):
    return LLM(checkpoint=tiny_moe_checkpoint(request.param), parallel=16, prefill_chunk_size=16,
               kv_cache_budget="none")


def test_16_concurrent_equal_one_at_a_time(llm):
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=3 + 2 * (i % 5), **GREEDY) for i in range(16)]
    batched = llm.generate(prompts, params)
    for prompt, p, got in zip(prompts, params, batched):
        assert len(got.token_ids) == p.max_tokens
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    assert len({tuple(r.token_ids) for r in batched}) > 1  # not a degenerate model
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


def test_llama4_serves_its_whole_context_in_chunks():
    """Its rotary layers attend in 16-token chunks (the tiny one's attention_chunk): the context is the model's,
    and prompts of several chunks, chunked prefill and decode across chunk borders stay batch-invariant."""
    llm = LLM(checkpoint=tiny_moe_checkpoint("llama4_text"), parallel=4, kv_cache_budget="none", prefill_chunk_size=7)
    assert llm.engine.max_model_len == llm.engine.model_config.max_position_embeddings
    prompts = ["chunk " * (20 + 9 * i) for i in range(4)]  # 40-90 tokens: 3-6 chunks
    params = [SamplingParams(max_tokens=24, **GREEDY) for _ in prompts]
    batched = llm.generate(prompts, params)
    assert [llm.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)] == [b.token_ids for b in batched]
    llm.engine.pool.check_integrity()
