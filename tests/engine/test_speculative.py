"""Speculative decoding by prompt lookup on a tiny random model: same tokens as plain decoding, fewer steps."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(8)]


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=8, speculative_ngram=0)


@pytest.fixture(scope="module")
def spec(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=8, speculative_ngram=4, speculative_max_rows=40)


def _params(i: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20 + 7 * (i % 3), ignore_eos=True, **extra)


@pytest.mark.batch_invariant
def test_batched_greedy_outputs_match_plain_decoding(plain, spec):
    params = [_params(i) for i in range(len(PROMPTS))]
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    stats = spec.engine.scheduler.stats
    assert stats.num_accepted_tokens > 0  # the tiny model repeats itself, so drafts land
    spec.engine.pool.check_integrity()
    assert spec.engine.pool.stats().num_used == 0


def _repeats(tokens: list[int], n: int = 4) -> int:
    """How many n-grams of tokens occurred earlier in it (what prompt lookup can draft)."""
    seen, count = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        count += gram in seen
        seen.add(gram)
    return count


@pytest.mark.batch_invariant
def test_a_looping_request_takes_fewer_steps(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # The request whose greedy text loops the most (which one does depends on the kernel level's rounding).
    outs = plain.generate(PROMPTS, [params] * len(PROMPTS))
    prompt = max(range(len(PROMPTS)), key=lambda i: _repeats(outs[i].prompt_token_ids + outs[i].token_ids))
    assert _repeats(outs[prompt].prompt_token_ids + outs[prompt].token_ids) > 8  # there is a loop to draft from
    steps = []
    for llm in (plain, spec):
        before = llm.engine.counters.num_steps
        out = llm.generate([PROMPTS[prompt]], params)[0]
        steps.append(llm.engine.counters.num_steps - before)
    assert len(out.token_ids) == 48 and out.token_ids == outs[prompt].token_ids
    assert steps[1] < steps[0]


@pytest.mark.batch_invariant
def test_stops_inside_an_accepted_draft_end_exactly_where_plain_decoding_does(plain, spec):
    base = plain.generate(PROMPTS[:4], [_params(i) for i in range(4)])
    for i, reference in enumerate(base):
        # Stop on a token (and a text) from the middle of the plain output: a draft may run past it.
        stop_token = reference.token_ids[len(reference.token_ids) // 2]
        by_token = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])
        stop_text = reference.text[len(reference.text) // 2:][:3]
        by_text = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_text]) if stop_text.strip() else by_token
        for params in (by_token, by_text):
            want, got = plain.generate([PROMPTS[i]], params)[0], spec.generate([PROMPTS[i]], params)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert spec.engine.pool.stats().num_used == 0


def test_sampled_and_logprob_requests_are_left_alone(plain, spec):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12) for i in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=12, logprobs=2))
    want = plain.generate(PROMPTS[:4], params)
    drafted = spec.engine.scheduler.stats.num_draft_tokens
    got = spec.generate(PROMPTS[:4], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.stats.num_draft_tokens == drafted


def test_speculation_is_off_where_rows_are_not_invariant(tiny_checkpoint, spec):
    """Without batch invariance a verified row may differ from a decoded one, and whether a row
    drafts depends on its batch-mates: the engine refuses to speculate there."""
    loose = LLM(checkpoint=tiny_checkpoint, parallel=2, speculative_ngram=4, batch_invariant=False)
    assert loose.engine.scheduler.config.speculative_ngram == 0
    assert spec.engine.scheduler.config.speculative_ngram == 4
