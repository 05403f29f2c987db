"""Sliding layers in their own K/V block group on the engine (tiny Gemma 3, window 8; a tiny LFM2 whose
attention layers slide): each sequence holds only its window there while prompts run to hundreds of
tokens, and the tokens are bitwise those of one block table for every layer, with prefix hits (limited
to what the window group still holds), preemption, speculation, a draft model and the KV handoff."""

import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.llm import LLM
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.runner.model_runner import ModelRunner
from conveyor.testing import FAMILY_OVERRIDES, tiny_checkpoint, tiny_hybrid_checkpoint

pytestmark = pytest.mark.batch_invariant

GREEDY = dict(temperature=0, ignore_eos=True)
SYSTEM = "You are a careful assistant who answers in full sentences. " * 6  # ~70 tokens: past the window
PROMPTS = [SYSTEM + f"Question {i}: " + "alpha beta gamma delta " * (6 + 5 * i) for i in range(6)]  # ~100-220


@pytest.fixture(scope="module")
def gemma3():
    # NOTE: with the family's 8x embedding multiplier a tiny random Gemma 3 repeats one token on long prompts;
    # at 1x its tokens vary, so they show what the K/V holds.
    return tiny_checkpoint(**{**FAMILY_OVERRIDES["gemma3"], "embedding_multiplier": 1.0})


@pytest.fixture(scope="module")
def traces(gemma3):
    """(token, logprob) of every greedy step with prefix caching off (the window group still gives blocks back)."""
    plain = LLM(checkpoint=gemma3, parallel=4, enable_prefix_caching=False, speculative_ngram=0)
    return [_trace(w.logprobs) for w in plain.generate(PROMPTS, _params(logprobs=0))]


@pytest.fixture(scope="module")
def want(traces):
    return [[token for token, _ in trace] for trace in traces]


def _params(max_tokens: int = 24, logprobs: int | None = None) -> list[SamplingParams]:
    """Greedy; with logprobs (which turn speculation off) the logits are compared too, bit for bit."""
    return [SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **GREEDY) for _ in PROMPTS]


def _trace(logprobs) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in logprobs]


def _one_group_greedy(core: EngineCore, prompt: str, max_tokens: int) -> list[int]:
    """Today's layout as the oracle: the engine's model on a runner with one block table for every layer."""
    num_blocks = 64
    runner = ModelRunner(core.runner.model, core.model_config, num_blocks, core.config.block_size, core.dtype,
                         core.device, core.backend, num_state_slots=1)
    assert not runner.has_window_group
    slot = 0 if core.states is not None else None
    tokens, out, start = core.tokenizer.encode(prompt), [], 0
    while len(out) < max_tokens:
        chunk = ScheduledChunk("r", tokens[start:], start, tuple(range(num_blocks)), True,
                               SamplingParams(temperature=0, logprobs=0), state_slot=slot)
        result = runner.execute(SchedulerOutput(chunks=[chunk]))
        start = len(tokens)
        tokens.append(result.sampled_token_ids["r"])
        out.append((result.sampled_token_ids["r"], result.logprobs["r"].logprob))
    return out


def test_sequences_hold_only_their_window_and_logits_match_one_block_table(gemma3, traces):
    core = EngineCore(EngineConfig(parallel=4, prefill_chunk_size=16, speculative_ngram=0), checkpoint=gemma3)
    assert core.sliding_window == 8 and core.kv.window is not None
    requests = [core.make_request(core.tokenizer.encode(p), sp) for p, sp in zip(PROMPTS, _params(logprobs=0))]
    for request in requests:
        core.add_request(request)
    got = {r.request_id: [] for r in requests}
    max_window_held = max_full_held = 0
    while core.has_work():
        for out in core.step():
            got[out.request_id] += _trace(out.logprobs)
        for request in core.scheduler.running:
            # A 16-token chunk or a decode reads at most 8 keys back: at most 3 blocks of 16 after the grow.
            max_window_held = max(max_window_held, core.kv.num_window_blocks_held(request.request_id))
            max_full_held = max(max_full_held, core.kv.num_blocks_held(request.request_id))
        core.kv.check_integrity()
    assert max_window_held <= 3 < 12 <= max_full_held  # the full group holds every position, ~240 tokens
    assert [got[r.request_id] for r in requests] == traces
    assert len({tuple(t) for t in traces}) == len(PROMPTS)  # not degenerate
    assert core.kv.window.pool.all_free() and core.pool.all_free()
    report = core.window_report()  # /v1/cache/stats' "sliding_window_group"
    assert (report["window"], report["allocated"], report["live"]) == (8, core.pool_plan.window_blocks, 0)
    assert report["bytes_reserved"] == core.pool_plan.window_pool_bytes
    for i in (0, 5):
        assert _one_group_greedy(core, PROMPTS[i], 24) == traces[i]


def test_prefix_hits_are_exact_and_limited_to_what_the_window_group_holds(gemma3, traces):
    cached = LLM(checkpoint=gemma3, parallel=4, speculative_ngram=0)
    params = _params(logprobs=0)
    cached.generate(PROMPTS[:1], params[:1])
    warm = cached.generate(PROMPTS, params)
    assert all(w.num_cached_tokens >= 64 for w in warm[1:])  # the shared system text, past the window
    assert warm[0].num_cached_tokens == len(warm[0].prompt_token_ids) // 16 * 16  # every whole block
    assert [_trace(w.logprobs) for w in warm] == traces
    # Without the window group's blocks, the full group's prefix alone is no hit.
    kv = cached.engine.kv
    kv.window.pool.reset_cache()
    assert kv.pool.stats().num_cached_free > 0
    again = cached.generate(PROMPTS[:2], params[:2])
    assert [a.num_cached_tokens for a in again] == [0, 0]  # admitted in one tick: neither sees the other's
    assert [_trace(a.logprobs) for a in again] == traces[:2]
    kv.check_integrity()


def test_preemption_and_speculation_stay_exact(gemma3, traces, want):
    plan = LLM(checkpoint=gemma3, parallel=4, enable_prefix_caching=False, speculative_ngram=0,
               ctx_size=4 * 512).engine.pool_plan
    tight = LLM(checkpoint=gemma3, parallel=4, ctx_size=4 * 512, enable_prefix_caching=False, speculative_ngram=0,
                kv_cache_budget=str(plan.window_pool_bytes + 34 * plan.bytes_per_block))
    assert tight.engine.pool.num_blocks == 34  # the full group: 4 prompts of 6-11 blocks, growing by 2 each
    assert [_trace(g.logprobs) for g in tight.generate(PROMPTS, _params(logprobs=0))] == traces
    assert tight.engine.scheduler.stats.num_preemptions > 0
    spec = LLM(checkpoint=gemma3, parallel=4, speculative_ngram=4, speculative_max_rows=40)
    assert [g.token_ids for g in spec.generate(PROMPTS, _params())] == want
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    for llm in (tight, spec):
        llm.engine.kv.check_integrity()


def test_a_draft_model_follows_the_full_groups_table(gemma3, want):
    spec = LLM(checkpoint=gemma3, draft_checkpoint=tiny_checkpoint(seed=7), parallel=4, draft_policy="enable",
               speculative_ngram=0, speculative_max_rows=64, block_size=4)  # small blocks: drafts cross blocks
    assert spec.engine.kv.window is not None and not spec.engine.runner.drafter.runner.has_window_group
    assert [g.token_ids for g in spec.generate(PROMPTS, _params())] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    spec.engine.kv.check_integrity()


def test_kv_handoff_sends_zeros_for_what_the_sender_gave_back(gemma3, want):
    prefill = EngineCore(EngineConfig(parallel=4, prefill_chunk_size=32), checkpoint=gemma3)
    decode = EngineCore(EngineConfig(parallel=4), checkpoint=gemma3)
    params = _params()[5]
    ids = prefill.tokenizer.encode(PROMPTS[5])
    request = prefill.make_request(ids, params, "r")
    prefill.kv_transfer.mark_for_handoff("r")
    prefill.add_request(request)
    outs = []
    while prefill.has_work():
        outs += prefill.step()
    handoff = outs[-1].kv_handoff
    assert handoff is not None and handoff.kv.num_tokens == len(ids)
    blob = handoff.kv
    kv = torch.frombuffer(bytearray(blob.data), dtype=torch.bfloat16).view(blob.num_layers, 2, blob.num_tokens, -1)
    assert not kv[0, :, :16].any() and kv[0, :, -8:].all(dim=-1).any()  # layer 0 slides: block 0 was given back
    assert kv[1, :, :16].any()  # layer 1 attends to everything: all there
    moved = decode.make_request(ids, params, "r")
    moved.output_token_ids = list(handoff.request.output_token_ids)
    decode.kv_transfer.stage_import(moved, handoff.kv, handoff.rng_state)
    decode.add_request(moved)
    assert decode.kv_transfer.stats.num_imported == 1
    assert decode.kv.num_window_blocks_held("r") <= 2 < decode.kv.num_blocks_held("r")
    tokens = list(moved.output_token_ids)
    while decode.has_work():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == want[5]  # (seeded and greedy continuations are bitwise: tests/engine/test_kv_transfer.py)
    decode.kv.check_integrity()


def test_a_hybrid_whose_attention_slides():
    layers = ("conv", "sliding_attention", "conv", "full_attention")
    hybrid = tiny_hybrid_checkpoint("lfm2", layer_types=layers, sliding_window=8)
    prompts = [SYSTEM + p for p in ("One two three four " * 8, "Five six seven eight " * 12)]
    params = [SamplingParams(max_tokens=20, logprobs=0, **GREEDY)] * 2
    plain = LLM(checkpoint=hybrid, parallel=2, enable_prefix_caching=False, speculative_ngram=0)
    assert plain.engine.kv.window is not None and plain.engine.states is not None
    want_hybrid = [_trace(w.logprobs) for w in plain.generate(prompts, params)]
    assert len({t for trace in want_hybrid for t, _ in trace}) > 2  # not degenerate
    for i, prompt in enumerate(prompts):
        assert _one_group_greedy(plain.engine, prompt, 20) == want_hybrid[i]
    # Hits resume where a state snapshot and the window group's blocks both are.
    cached = LLM(checkpoint=hybrid, parallel=2, speculative_ngram=0, prefill_chunk_size=16)
    cached.generate(prompts[:1], params[:1])
    warm = cached.generate(prompts, params)
    assert warm[0].num_cached_tokens > 0
    assert [_trace(w.logprobs) for w in warm] == want_hybrid
    cached.engine.kv.check_integrity()


def test_the_torch_reference_path_reads_zeros_where_blocks_were_given_back(gemma3):
    """The gather-and-mask attention (no C++ kernel; CUDA's path) gathers the NULL block's zeros for given-back
    positions and masks them: the same bits as one block table, in the same batch shapes (it is not row-invariant)."""
    llm = LLM(checkpoint=gemma3, parallel=1, prefill_chunk_size=0, disable_kernel=True, dtype="float32")
    assert llm.engine.backend.name == "torch" and llm.engine.kv.window is not None
    got = llm.generate(PROMPTS[5:], _params(logprobs=0)[5:])
    assert _trace(got[0].logprobs) == _one_group_greedy(llm.engine, PROMPTS[5], 24)
