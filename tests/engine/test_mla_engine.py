"""DeepSeek-V3's latent attention on the engine (tiny random weights, bf16 on the CPU kernels): 16 concurrent
greedy requests == one at a time, also through chunked prefill, a prefix-cache hit, preemption and speculation;
the KV pool is sized by the latent row, which a q8_0 cache quantizes; the features that move K and V as two
per-layer tensors refuse the model at startup."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.models.cache_specs import KVSpec
from conveyor.models.config import ModelConfigError
from conveyor.models.mla_dims import MLADims
from conveyor.runner.model_runner import kv_group_bytes_per_block
from conveyor.testing import tiny_mla_checkpoint

pytestmark = pytest.mark.batch_invariant
GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: " + "lorem ipsum dolor " * (i % 5 * 2) + f"end {i}" for i in range(n)]


@pytest.fixture(scope="module", params=["q_lora", "no_q_lora"])
def checkpoint(request):
    if request.param == "q_lora":
        return tiny_mla_checkpoint()
    return tiny_mla_checkpoint(mla=MLADims(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                           v_head_dim=24))


def test_16_concurrent_equal_one_at_a_time_chunked_and_after_a_prefix_hit(checkpoint):
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=3 + 2 * (i % 5), **GREEDY) for i in range(16)]
    llm = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, kv_cache_budget="none",
              enable_prefix_caching=False)
    batched = llm.generate(prompts, params)
    assert len({tuple(r.token_ids) for r in batched}) > 1  # not a degenerate model
    for prompt, p, got in zip(prompts, params, batched):
        assert len(got.token_ids) == p.max_tokens
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    # Prefill in chunks of 5 tokens (each chunk attends the latent rows the earlier ones wrote), 16 at once.
    chunked = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=5, kv_cache_budget="none",
                  enable_prefix_caching=False)
    assert [r.token_ids for r in chunked.generate(prompts, params)] == [r.token_ids for r in batched]
    # A shared system text: cached latent blocks adopted by later requests give the cold prefill's tokens.
    system = "You are a helpful assistant. " * 6
    cold = [r.token_ids for r in llm.generate([system + p for p in prompts[:4]], params[:4])]
    cached = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=16, kv_cache_budget="none")
    cached.generate([system + prompts[0]], params[:1])
    warm = cached.generate([system + p for p in prompts[:4]], params[:4])
    assert all(w.num_cached_tokens >= 32 for w in warm)
    assert [w.token_ids for w in warm] == cold
    for engine in (llm, chunked, cached):
        engine.engine.pool.check_integrity()
        assert engine.engine.pool.stats().num_used == 0


def test_preemption_and_speculation_leave_the_tokens_as_plain_decoding_makes_them():
    """Latent blocks given back under pressure and re-prefilled, and drafts verified as prefill rows: bitwise the
    tokens of plain decoding (36 blocks of 16 tokens for 8 requests growing to ~6 blocks each)."""
    checkpoint = tiny_mla_checkpoint()
    prompts = [f"Echo {i}: " + "alpha beta gamma delta " * (2 + i % 4) for i in range(8)]
    params = [SamplingParams(max_tokens=64, **GREEDY) for _ in range(8)]
    plain = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, kv_cache_budget="none",
                enable_prefix_caching=False, speculative_ngram=0)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    tight = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, enable_prefix_caching=False, speculative_ngram=0,
                kv_cache_budget=str(36 * plain.engine.pool_plan.bytes_per_block))
    assert [r.token_ids for r in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    spec = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, speculative_ngram=4, speculative_max_rows=40)
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    # drafts were verified as prefill rows; whether a random model's output ever repeats its prompt is luck (the
    # amx build's tile attention, other bits, accepts none of its 18 drafts here)
    assert spec.engine.scheduler.stats.num_draft_tokens > 0
    for llm in (tight, spec):
        llm.engine.pool.check_integrity()


def test_kv_bytes_per_token_are_the_latent_rows():
    """bf16, 3 layers: one (kv_lora_rank 48 + rope 16) row = 128 bytes per layer, against 4 heads x (K 32 + V 16)
    x 2 bytes = 384 per layer were K and V expanded per head: 3x smaller here, 71x at DeepSeek-V3's widths."""
    llm = LLM(checkpoint=tiny_mla_checkpoint(), parallel=2, kv_cache_budget="none")
    core = llm.engine
    cfg = core.model_config
    layers, heads, dims = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.mla
    latent = layers * dims.cache_width * 2
    full = layers * heads * (dims.qk_head_dim + dims.v_head_dim) * 2
    assert (latent, full) == (384, 1152)
    assert core.pool_plan.bytes_per_block == latent * core.kv.block_size
    assert core.layers_report()["kv_bytes_per_token"] == latent and core.layers_report()["latent_kv"]
    # the pool's tensors hold exactly that: one tensor per layer, shared as K and V
    tensors = {id(t): t for layer in core.runner.kv_layers() for t in layer}
    assert len(tensors) == layers
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == core.pool_plan.pool_bytes
    # the same accounting for full K/V layers (heads x qk_head_dim, V as wide as K) counts two rows per head
    specs = [KVSpec(heads, dims.qk_head_dim)] * layers
    assert kv_group_bytes_per_block(specs, 16, core.dtype)[0] // 16 == layers * heads * 2 * dims.qk_head_dim * 2
    # DeepSeek-V3 itself: 61 layers x (512 + 64) x 2 bytes against 128 heads x (192 + 128) x 2
    assert 61 * 576 * 2 == 70272 and 61 * 128 * (192 + 128) * 2 // (61 * 576 * 2) == 71


@pytest.mark.parametrize("flags, named", [
    (dict(cache_type_k="q8_0"), "give both the same type"), (dict(cache_type_v="q8_0"), "give both the same type")])
def test_k_and_v_cache_types_must_agree_on_a_latent_cache(flags, named):
    with pytest.raises(ModelConfigError, match=named):
        LLM(checkpoint=tiny_mla_checkpoint(), parallel=2, kv_cache_budget="none", **flags)


def test_a_q8_0_cache_quantizes_the_latent_row_and_stays_exact_across_batches():
    """--cache-type-k/-v q8_0 on MLA (issue #44 item 2): one uint8 row of Q8_0 blocks per token and layer (K and V
    the same tensor), 0.53x the bytes; 16 concurrent == one at a time through chunked prefill, and a prefix hit
    gives the cold tokens."""
    import torch

    checkpoint = tiny_mla_checkpoint()  # cache row 48 + 16 = 64 values: two Q8_0 blocks
    q8 = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=8, kv_cache_budget="none",
             cache_type_k="q8_0", cache_type_v="q8_0")
    bf16 = LLM(checkpoint=checkpoint, parallel=16, kv_cache_budget="none")
    for key_cache, value_cache in q8.engine.runner.kv_layers():
        assert key_cache is value_cache and key_cache.dtype == torch.uint8 and key_cache.shape[-1] == 2 * 34
    assert q8.engine.pool_plan.bytes_per_block * 128 == bf16.engine.pool_plan.bytes_per_block * 68
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=4 + 3 * (i % 5), **GREEDY) for i in range(16)]
    batched = q8.generate(prompts, params)
    assert [q8.generate([p], [s])[0].token_ids for p, s in zip(prompts[:6], params[:6])] == \
        [b.token_ids for b in batched[:6]]
    warm = q8.generate(prompts[:1], params[:1])[0]  # its blocks cached by the runs above
    assert warm.num_cached_tokens > 0 and warm.token_ids == batched[0].token_ids
    q8.engine.pool.check_integrity()
