"""MTP drafting (--draft-kind mtp) on tiny random Qwen3.5 / Qwen3-Next checkpoints with a multi-token-prediction
head: greedy output bitwise plain decoding at 1 and 16 concurrent requests, with a random head (drafts rejected),
a head built to agree with the target (drafts accepted) and one that agrees only sometimes (partial acceptance:
the hybrid's state rolled back); sampled rows verified by rejection sampling; every KV block and state slot back.

transformers has no MTP for Qwen3.5, so plain decoding is the reference.
"""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import Checkpoint, LoadError
from conveyor.testing import agreeing_mtp_head, tiny_hybrid_checkpoint

pytestmark = pytest.mark.batch_invariant

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(16)]
FAMILIES = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 3), ignore_eos=True)


def _mtp(checkpoint: Checkpoint, parallel: int, **extra) -> LLM:
    extra.setdefault("speculative_max_rows", 64)
    return LLM(checkpoint=checkpoint, parallel=parallel, draft_kind="mtp", draft_policy="enable", **extra)


def _plain(checkpoint: Checkpoint, prompts: list[str]) -> list[list[int]]:
    llm = LLM(checkpoint=checkpoint, parallel=len(prompts), speculative_ngram=0)
    return [o.token_ids for o in llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])]


def _check_released(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.pool.stats().num_used == 0
    assert llm.engine.states.all_free()


@pytest.fixture(scope="module", params=FAMILIES)
def random_head(request):
    checkpoint = tiny_hybrid_checkpoint(request.param, mtp=True)
    return checkpoint, _plain(checkpoint, PROMPTS)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_random_head_greedy_is_plain_decoding(random_head, concurrency):
    checkpoint, want = random_head
    spec = _mtp(checkpoint, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    report = spec.engine.speculation_report()["draft_model"]
    assert report["kind"] == "mtp" and report["draft_tokens"] > 0
    _check_released(spec)


@pytest.fixture(scope="module")
def bigram():
    checkpoint = agreeing_mtp_head(tiny_hybrid_checkpoint("qwen3_5_text", mtp=True, tie_word_embeddings=False))
    return checkpoint, _plain(checkpoint, PROMPTS)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_an_agreeing_head_has_its_drafts_accepted(bigram, concurrency):
    checkpoint, want = bigram
    assert len({tuple(w) for w in want}) > 1 and len(set(want[0])) > 4  # not stuck on one token
    spec = _mtp(checkpoint, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens >= 0.9 * stats.num_model_draft_tokens
    # k = 4 drafts per verify round: far fewer steps than one token per step.
    plain = LLM(checkpoint=checkpoint, parallel=concurrency, speculative_ngram=0)
    plain.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert spec.engine.counters.num_steps < plain.engine.counters.num_steps / 2
    _check_released(spec)


def test_partial_acceptance_rolls_the_hybrid_state_back_exactly():
    checkpoint = agreeing_mtp_head(tiny_hybrid_checkpoint("qwen3_5_text", mtp=True, tie_word_embeddings=False),
                               noise=0.02)  # measured: ~75 % of the drafts accepted
    want = _plain(checkpoint, PROMPTS)
    spec = _mtp(checkpoint, 16, block_size=4)  # small blocks: drafts cross them
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert 0 < stats.num_model_accepted_tokens < 0.9 * stats.num_model_draft_tokens
    _check_released(spec)


def test_sampled_rows_draft_and_are_verified(bigram):
    checkpoint, _ = bigram
    spec = _mtp(checkpoint, 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens > stats.num_model_draft_tokens / 2  # p ~ q: min(1, p/q) ~ 1
    _check_released(spec)


def test_sampled_rows_with_a_random_head_are_rejected_and_run_on(random_head):
    checkpoint, _ = random_head
    spec = _mtp(checkpoint, 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > stats.num_model_accepted_tokens  # residual draws where q was wrong
    _check_released(spec)


def test_prefix_hits_and_chunked_prefill_keep_greedy_exact(random_head):
    checkpoint, want = random_head
    spec = _mtp(checkpoint, 16, prefill_chunk_size=7)
    params = [_greedy(i) for i in range(len(PROMPTS))]
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want  # the second time from the prefix cache
    _check_released(spec)


def test_a_model_without_an_mtp_head_is_refused():
    with pytest.raises(LoadError, match="no multi-token-prediction head"):
        _mtp(tiny_hybrid_checkpoint("qwen3_5_text"), 1)


def test_preemption_keeps_greedy_exact(random_head):
    checkpoint, _ = random_head
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True) for _ in range(8)]  # ~6 blocks each
    plain = LLM(checkpoint=checkpoint, parallel=8, ctx_size=8 * 512, speculative_ngram=0)
    want = [o.token_ids for o in plain.generate(PROMPTS[:8], params)]
    probe = _mtp(checkpoint, 8, ctx_size=8 * 512, enable_prefix_caching=False)  # a block holds the head's K/V too
    budget = 33 * probe.engine.pool_plan.bytes_per_block + probe.engine.states.total_bytes
    tight = _mtp(checkpoint, 8, ctx_size=8 * 512, kv_cache_budget=str(budget), enable_prefix_caching=False)
    assert [g.token_ids for g in tight.generate(PROMPTS[:8], params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert tight.engine.scheduler.stats.num_model_draft_tokens > 0
    _check_released(tight)


def test_rows_kept_while_a_cold_policy_probes_give_the_same_drafts(random_head, tmp_path, monkeypatch):
    """A cold adaptive policy keeps the head's rows waiting through its classic probe ticks (nothing drafts in them);
    its first draft runs them all, and proposes what a head fed every tick proposes there."""
    from conveyor.engine.spec_policy import SpecPolicy
    from conveyor.runner import mtp_runner

    checkpoint, _ = random_head
    monkeypatch.setattr(mtp_runner, "FLUSH_ROWS", 4)  # fed every tick, the prompt's rows flush at once
    flushes, flush, propose = [], mtp_runner.MTPRunner._flush, mtp_runner.MTPRunner.propose
    monkeypatch.setattr(mtp_runner.MTPRunner, "_flush", lambda self, chunks: (flushes.append(len(chunks)),
                                                                              flush(self, chunks)))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(checkpoint=checkpoint, parallel=1, speculative_ngram=0).generate(PROMPTS[:1], params)[0].token_ids

    def run(name: str) -> dict[int, int]:
        drafts: dict[int, int] = {}  # the decode row's position -> its first draft

        def recording(self, chunks):
            out = propose(self, chunks)
            drafts.update({c.start_position: out[c.request_id].token_ids[0] for c in chunks
                           if out[c.request_id].token_ids})
            return out

        monkeypatch.setattr(mtp_runner.MTPRunner, "propose", recording)
        llm = LLM(checkpoint=checkpoint, parallel=1, draft_kind="mtp", draft_block_size=1,
                  enable_prefix_caching=False, cache_dir=str(tmp_path / name))  # the adaptive policy, cold
        assert llm.generate(PROMPTS[:1], params)[0].token_ids == plain
        _check_released(llm)
        return drafts

    kept = run("kept")
    assert not flushes and kept  # the rows waited through the probe; the profile's first draft ran them
    monkeypatch.setattr(SpecPolicy, "defers_recording", lambda self, batch_size: False)
    fed = run("fed")
    assert flushes  # the prompt's rows went through the head before the first draft
    # The probe is a count of ticks, so both draft first at the same position; the first two draft ticks match
    # (after them the profiles may part: the first tick that ran kept rows is not timed).
    first = sorted(set(kept) & set(fed))
    assert min(kept) == min(fed) and len(first) >= 2
    assert [kept[p] for p in first] == [fed[p] for p in first]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_declining_policy_defers_the_heads_rows_without_prefix_caching(bigram, prefix_caching, monkeypatch):
    """--draft-policy decline: without prefix caching the head's rows wait (no flush: requests end before they would
    draft); with it they still go through the head, since a request's blocks (head K/V included) outlive it."""
    from conveyor.runner import mtp_runner

    monkeypatch.setattr(mtp_runner, "FLUSH_ROWS", 4)
    flushed = []
    original = mtp_runner.MTPRunner._flush
    monkeypatch.setattr(mtp_runner.MTPRunner, "_flush", lambda self, chunks: (flushed.append(len(chunks)),
                                                                              original(self, chunks)))
    checkpoint, want = bigram
    llm = LLM(checkpoint=checkpoint, parallel=16, draft_kind="mtp", draft_policy="decline",
              enable_prefix_caching=prefix_caching)
    got = llm.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    assert llm.engine.scheduler.stats.num_model_draft_tokens == 0
    assert bool(flushed) == prefix_caching
    _check_released(llm)
