"""Hybrid models (LFM2, Qwen3.5, the Mamba2 families: recurrent layers beside attention, or alone) on the
engine, bf16 on the CPU kernels: concurrent greedy equals one at a time, and chunked prefill, prefix-cache
hits through state snapshots, preemption and speculative decoding (state rolled back on a miss) leave the
tokens exactly as plain decoding makes them; every state slot comes back."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import tiny_hybrid_checkpoint

pytestmark = pytest.mark.batch_invariant

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (2 + i % 4) for i in range(8)]  # 20-40 tokens


DENSE_HYBRIDS = ["lfm2", "qwen3_5_text", "granitemoehybrid"]  # the MoE variants are covered below
# The other Mamba2 families: Nemotron-H (relu^2 MLP, sigmoid-routed experts in groups), Falcon-H1 (Mamba2 and
# attention side by side), Mamba2 alone (no attention layer: no K/V at all).
MAMBA2_HYBRIDS = ["nemotron_h", "falcon_h1", "mamba2"]


# Every family of the list (#24) through chunking, prefix hits, preemption and speculation.
EVERY_HYBRID = DENSE_HYBRIDS + MAMBA2_HYBRIDS + ["qwen3_next", "qwen3_5_moe_text", "lfm2_moe"]


@pytest.fixture(scope="module", params=EVERY_HYBRID)
def hybrid(request):
    return tiny_hybrid_checkpoint(request.param)


def _check_released(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.states.all_free()


@pytest.mark.parametrize("architecture", DENSE_HYBRIDS + MAMBA2_HYBRIDS)
def test_concurrent_greedy_equals_one_at_a_time(architecture):
    llm = LLM(checkpoint=tiny_hybrid_checkpoint(architecture), parallel=8, prefill_chunk_size=16, speculative_ngram=0)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 3), **GREEDY) for i in range(8)]
    batched = llm.generate(PROMPTS, params)
    assert len({tuple(b.token_ids) for b in batched}) > 1  # the model is not degenerate
    for prompt, p, got in zip(PROMPTS, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    _check_released(llm)


def test_chunking_prefix_hits_preemption_and_speculation_stay_exact(hybrid):
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in range(8)]
    plain = LLM(checkpoint=hybrid, parallel=8, ctx_size=8 * 512, kv_cache_budget="none",
                enable_prefix_caching=False, speculative_ngram=0, prefill_chunk_size=0)
    want = [w.token_ids for w in plain.generate(PROMPTS, params)]
    # Chunked prefill: 5-token chunks split every prompt mid-way through the recurrent layers.
    chunked = LLM(checkpoint=hybrid, parallel=8, ctx_size=8 * 512, enable_prefix_caching=False,
                  speculative_ngram=0, prefill_chunk_size=5)
    assert [g.token_ids for g in chunked.generate(PROMPTS, params)] == want
    # Prefix hits: a shared system text; the first request snapshots the state where the cache matched it,
    # later ones resume from that snapshot.
    system = "You are a helpful assistant. " * 6
    cold = [w.token_ids for w in plain.generate([system + p for p in PROMPTS[:4]], params[:4])]
    cached = LLM(checkpoint=hybrid, parallel=8, ctx_size=8 * 512, speculative_ngram=0)
    cached.generate([system + PROMPTS[0]], params[:1])
    cached.generate([system + PROMPTS[1]], params[1:2])  # snapshots the shared system prefix
    warm = cached.generate([system + p for p in PROMPTS[:4]], params[:4])
    assert all(w.num_cached_tokens >= 32 for w in warm)
    assert [w.token_ids for w in warm] == cold
    assert cached.engine.states.num_snapshot_hits >= 4
    if not plain.engine.pool_plan.bytes_per_block:  # Mamba2 alone: blocks cost nothing, no budget preempts
        for llm in (chunked, cached):
            _check_released(llm)
        return
    # Preemption: 33 blocks for 8 requests growing to ~5 blocks each; victims re-prefill from a zero state.
    tight = LLM(checkpoint=hybrid, parallel=8, ctx_size=8 * 512, enable_prefix_caching=False, speculative_ngram=0,
                kv_cache_budget=str(33 * plain.engine.pool_plan.bytes_per_block + plain.engine.states.total_bytes))
    assert [g.token_ids for g in tight.generate(PROMPTS, params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for llm in (chunked, cached, tight):
        _check_released(llm)


def test_attention_free_mamba2_keeps_no_kv():
    """Mamba2 alone: blocks only count positions (zero bytes), the runner allocates no K/V, the states do it all."""
    checkpoint = tiny_hybrid_checkpoint("mamba2")
    llm = LLM(checkpoint=checkpoint, parallel=4, kv_cache_budget=str(2**20))
    assert llm.engine.pool_plan.bytes_per_block == 0 and llm.engine.runner.kv_layers() == []
    assert len(llm.engine.runner.state_layers()) == 3
    with pytest.raises(ValueError, match="recurrent state"):  # an explicit budget still has to hold the states
        LLM(checkpoint=checkpoint, parallel=4, kv_cache_budget=str(llm.engine.states.total_bytes - 1))
    params = [SamplingParams(max_tokens=8, **GREEDY) for _ in range(4)]
    batched = llm.generate(PROMPTS[:4], params)
    assert [g.token_ids for g in llm.generate(PROMPTS[:4], params)] == [b.token_ids for b in batched]
    _check_released(llm)


# Mixer outputs scaled down so the tiny model half repeats itself: prompt-lookup drafts then both hit and miss.
# (Granite's residual multiplier already does it.)
REPEATING = {"lfm2": 0.3, "qwen3_5_text": 0.15, "granitemoehybrid": 1.0}


@pytest.mark.parametrize("architecture", EVERY_HYBRID)
def test_speculation_rolls_the_state_back_exactly(architecture):
    checkpoint = tiny_hybrid_checkpoint(architecture)
    for name, weight in checkpoint.weights.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2.weight", "output_linear.weight")):
            weight.mul_(REPEATING.get(architecture, 1.0))
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in range(8)]
    plain = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=0)
    want = [w.token_ids for w in plain.generate(PROMPTS, params)]
    spec = LLM(checkpoint=checkpoint, parallel=8, speculative_ngram=4, speculative_max_rows=40)
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want
    stats = spec.engine.scheduler.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # drafts missed: the state was rolled back
    if architecture in REPEATING:  # tuned to repeat itself: drafts hit too
        assert stats.num_accepted_tokens > 0
    _check_released(spec)


def test_structured_output_on_a_hybrid_is_valid_and_batch_invariant():
    """Grammar masks never look at the cache: a JSON schema holds on a hybrid, alone and beside other rows."""
    import json

    from conveyor.structured.grammar import GrammarSpec

    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
              "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["kind", "n"],
              "additionalProperties": False}
    llm = LLM(checkpoint=tiny_hybrid_checkpoint("lfm2"), parallel=4)
    params = SamplingParams(temperature=0, max_tokens=40, structured=GrammarSpec.json_schema(schema))
    free = SamplingParams(max_tokens=20, **GREEDY)
    alone = llm.generate([PROMPTS[0]], [params])[0]
    beside = llm.generate(PROMPTS[:3], [params, free, free])[0]
    assert set(json.loads(alone.text)) == {"kind", "n"}
    assert beside.token_ids == alone.token_ids
    _check_released(llm)


# Granite 4.0-H with experts beside its shared MLP (the tiny one is dense); Nemotron-H's tiny has an MoE layer.
MOE_HYBRIDS = [("qwen3_next", {}), ("qwen3_5_moe_text", {}), ("lfm2_moe", {}), ("nemotron_h", {}),
               ("granitemoehybrid", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))]


@pytest.mark.parametrize(("architecture", "overrides"), MOE_HYBRIDS, ids=[a for a, _ in MOE_HYBRIDS])
def test_moe_hybrids_16_concurrent_equal_one_at_a_time(architecture, overrides):
    """Sparse MLPs beside recurrent layers: 16 greedy requests in one batch, each equal to its run alone."""
    llm = LLM(checkpoint=tiny_hybrid_checkpoint(architecture, **overrides), parallel=16, prefill_chunk_size=16)
    prompts = [PROMPTS[i % 8] + f" {i}" for i in range(16)]
    params = [SamplingParams(max_tokens=5 + i % 4, **GREEDY) for i in range(16)]
    batched = llm.generate(prompts, params)
    assert len({tuple(b.token_ids) for b in batched}) > 1
    for prompt, p, got in zip(prompts, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    _check_released(llm)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("architecture", ["qwen3_5_text", "lfm2"])
def test_a_hybrid_draft_model_rolls_its_own_state_back_exactly(architecture):
    """A hybrid draft for a hybrid target (issue #44): its recurrent state goes back to the history's end after
    every proposal, so greedy output is bitwise plain decoding, with a draft that agrees (itself: every draft
    accepted) and one that mostly does not (other weights: rejections roll back)."""
    target = tiny_hybrid_checkpoint(architecture)
    other = tiny_hybrid_checkpoint(architecture, seed=3)
    for checkpoint in (target, other):
        for name, weight in checkpoint.weights.items():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2.weight")):
                weight.mul_(REPEATING[architecture])
    params = [SamplingParams(max_tokens=32, **GREEDY) for _ in range(6)]
    want = [w.token_ids for w in LLM(checkpoint=target, parallel=8, speculative_ngram=0).generate(PROMPTS[:6], params)]
    for draft, agrees in ((target, True), (other, False)):
        spec = LLM(checkpoint=target, draft_checkpoint=draft, parallel=8, speculative_ngram=0, draft_policy="enable",
                   speculative_max_rows=64)
        assert spec.engine.runner.drafter.recurrent
        assert [g.token_ids for g in spec.generate(PROMPTS[:6], params)] == want
        stats = spec.engine.scheduler.stats
        assert stats.num_model_draft_tokens > 0
        if agrees:
            assert stats.num_model_accepted_tokens == stats.num_model_draft_tokens
        else:
            assert stats.num_model_accepted_tokens < stats.num_model_draft_tokens  # rolled back
        _check_released(spec)


def test_a_hybrid_draft_for_an_attention_only_target_is_refused_with_the_reason(tiny_checkpoint):
    from conveyor.models.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="a hybrid \\(recurrent\\) draft model needs a hybrid target"):
        LLM(checkpoint=tiny_checkpoint, draft_checkpoint=tiny_hybrid_checkpoint("qwen3_5_text"), draft_policy="enable")


@pytest.mark.parametrize("interval, hit", [(32, 96), (0, 0)])
def test_snapshots_every_interval_let_the_second_prompt_on_a_shared_prefix_hit(interval, hit):
    """--state-snapshot-interval: the first prompt leaves snapshots at 64 and 96 tokens, so a second prompt that
    parts from it after ~110 shared tokens resumes at 96 (bitwise), instead of from zero as without them
    (its K/V matched further, but no state was kept there)."""
    checkpoint = tiny_hybrid_checkpoint("qwen3_5_text")
    shared = "You are a careful assistant who answers in one short sentence. " * 9  # ~108 tokens
    prompts = [shared + "What is the capital of France?", shared + "Name a prime number."]
    params = SamplingParams(max_tokens=8, **GREEDY)
    plain = LLM(checkpoint=checkpoint, parallel=2, enable_prefix_caching=False)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    llm = LLM(checkpoint=checkpoint, parallel=2, state_snapshot_interval=interval)
    first = llm.generate(prompts[:1], params)[0]
    # The prompt's end, and (with the interval) its last two multiples of 32 before it, not all three.
    assert llm.engine.states.stats().num_snapshots == (3 if interval else 1)
    second = llm.generate(prompts[1:], params)[0]
    assert [first.token_ids, second.token_ids] == want
    assert second.num_cached_tokens == hit
    _check_released(llm)
