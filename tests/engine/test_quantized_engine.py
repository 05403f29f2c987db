"""The engine on a tiny GGUF kept as GGML blocks: batching, chunked prefill and preemption never change output."""

import gguf
import pytest

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.loading import load_checkpoint
from conveyor.models.layers import QuantizedEmbedding
from conveyor.testing import write_tiny_gguf

Q = gguf.GGMLQuantizationType
# Under CONVEYOR_REQUIRE_KERNELS=1 (make test) a missing kernel raises here instead of skipping.
_RUNS_BLOCKS = cpu_backend(kernel_settings_from_env()).runs_quantized(Q.Q4_K)
pytestmark = [pytest.mark.batch_invariant, pytest.mark.skipif(not _RUNS_BLOCKS, reason="no quantized kernel here")]
# Q4_K_M's layout (v and down in Q6_K), a Q5_0 o_proj, a Q8_0 embedding the tied head reads.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0, "ffn_gate": Q.Q4_K,
         "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:  # token ids: the tiny vocabulary is 97 byte-level tokens
    return [[3 + (7 * i + 5 * j) % 90 for j in range(6 + 5 * (i % 6))] for i in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(write_tiny_gguf(tmp_path_factory.mktemp("q") / "tiny-q4_k_m.gguf", TYPES, embed_type=Q.Q8_0))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=8, kv_cache_budget="none")


def test_runs_on_blocks(llm):
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.segments[0].packed is model.embed_tokens.segment.packed
    assert set(llm.engine.weight_formats) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "BF16"}


def test_16_concurrent_equal_one_at_a_time_with_chunked_prefill(llm):
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=3 + 2 * (i % 5), **GREEDY) for i in range(16)]
    batched = llm.generate(prompts, params)
    assert llm.engine.scheduler.stats.num_preemptions == 0
    for prompt, p, got in zip(prompts, params, batched):
        assert len(got.token_ids) == p.max_tokens
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    assert len({tuple(r.token_ids) for r in batched}) > 1  # not a degenerate model
    llm.engine.pool.check_integrity()


def test_preemption_keeps_outputs_exact(checkpoint, llm):
    bytes_per_block = llm.engine.pool_plan.bytes_per_block
    tight = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, max_batch_prefill=8, enable_prefix_caching=False,
                kv_cache_budget=str(36 * bytes_per_block))
    params = [SamplingParams(max_tokens=80, **GREEDY) for _ in range(8)]  # ~7 blocks each, 36 in the pool
    want = llm.generate(_prompts(8), params)
    got = tight.generate(_prompts(8), params)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert tight.engine.pool.all_free()


def test_prompt_lookup_speculation_equals_plain_decoding(checkpoint, llm):
    """Drafts are verified as a prefill chunk: with quantized weights too, verified rows are the decoded rows."""
    plain = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=0, kv_cache_budget="none")
    spec = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=4, speculative_max_rows=40,
               kv_cache_budget="none")
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in range(8)]
    want = plain.generate(_prompts(8), params)
    got = spec.generate(_prompts(8), params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0  # random weights repeat themselves: drafts land
    spec.engine.pool.check_integrity()
