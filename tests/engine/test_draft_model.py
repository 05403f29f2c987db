"""Draft-model speculation on tiny random pairs: greedy output bitwise equal to plain decoding, sampled
output distributed as plain sampling (rejection sampling), tokenizer mismatches refused."""

import json

import pytest
import tokenizers
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.spec_policy import (EARLY_CUT, EARLY_TICKS, PROBE_TICKS, PROFILE_TICKS, SpecPolicy, bucket_of,
                                         draft_lengths)
from conveyor.loading import Checkpoint, LoadError
from conveyor.loading.pairing import check_draft_pairing
from conveyor.loading.tokenizer import Tokenizer
from conveyor.runner.rejection import rejection_sample
from conveyor.testing import random_weights, tiny_checkpoint as make_tiny, tiny_config

PROMPTS = [f"Story {i}: the quick brown fox " * (1 + i % 3) for i in range(8)]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16 + 5 * (i % 3), ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=8, speculative_ngram=0)
    return llm.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))]), llm.engine.counters.num_steps


def _speculative(target, draft, **extra) -> LLM:
    extra.setdefault("speculative_ngram", 0)
    return LLM(checkpoint=target, draft_checkpoint=draft, parallel=8, draft_policy="enable",
               speculative_max_rows=64, **extra)


@pytest.mark.batch_invariant
def test_self_draft_accepts_everything_and_matches_plain_decoding(tiny_checkpoint, plain_outputs):
    want, plain_steps = plain_outputs
    spec = _speculative(tiny_checkpoint, tiny_checkpoint)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens == stats.num_model_draft_tokens  # same weights, same bits
    assert spec.engine.counters.num_steps < plain_steps / 2
    spec.engine.pool.check_integrity()
    assert spec.engine.pool.stats().num_used == 0


@pytest.mark.batch_invariant
def test_a_different_draft_changes_nothing_but_the_step_count(tiny_checkpoint, plain_outputs):
    want, _ = plain_outputs
    spec = _speculative(tiny_checkpoint, make_tiny(seed=7), block_size=4)  # small blocks: drafts cross blocks
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    spec.engine.pool.check_integrity()


@pytest.mark.batch_invariant
def test_prompt_lookup_and_the_draft_model_share_a_batch(tiny_checkpoint, plain_outputs):
    want, _ = plain_outputs
    spec = _speculative(tiny_checkpoint, tiny_checkpoint, speculative_ngram=4)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.scheduler.stats
    # Rows the prompt-lookup proposer matched used it; the others asked the draft model.
    assert stats.num_draft_tokens > stats.num_model_draft_tokens > 0


def test_sampled_rows_speculate_and_self_draft_accepts_all(tiny_checkpoint):
    spec = _speculative(tiny_checkpoint, tiny_checkpoint)
    params = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    outs = spec.generate(PROMPTS[:4], params)
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    # p == q bit for bit (same model, row-invariant kernels): min(1, p/q) = 1, every draft accepted.
    assert stats.num_model_accepted_tokens == stats.num_model_draft_tokens
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=6)
    before = stats.num_model_draft_tokens
    spec.generate(PROMPTS[:2], seeded)  # seeded rows never speculate: their draws stay batch-independent
    assert stats.num_model_draft_tokens == before
    spec.engine.pool.check_integrity()


def test_rejection_sampling_reproduces_the_target_distribution():
    """Chi-square over a 6-token vocabulary: emitted tokens follow p, acceptance is sum(min(p, q))."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 6, 2, 60_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=gen) for i in range(k)], dim=1)
    tokens, accepted = rejection_sample(p.expand(rows, -1, -1), q.expand(rows, -1, -1), drafts, gen)
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert _chi_square(first, p[0]) < 20.5  # df 5, p = 0.001
    # Where the first draft was accepted, the second emitted token is a draw from p[1].
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=vocab).float()
    assert _chi_square(second, p[1]) < 20.5
    expected_accept = torch.minimum(p[0], q[0]).sum().item()
    assert abs((accepted >= 1).float().mean().item() - expected_accept) < 0.01
    # A rejected draft is never emitted at its own position.
    rejected = accepted == 0
    assert not bool((tokens[rejected, 0] == drafts[rejected, 0]).any())


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_draft_with_another_tokenizer_is_refused(tiny_checkpoint):
    backend = tiny_checkpoint.tokenizer.backend
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different ids
    other = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), tiny_checkpoint.tokenizer.bos_token_id,
                      tiny_checkpoint.tokenizer.eos_token_ids)
    swapped = Checkpoint(tiny_checkpoint.config, tiny_checkpoint.weights, other, "<swapped>", "swapped-draft")
    with pytest.raises(LoadError, match="does not share the tokenizer"):
        check_draft_pairing(tiny_checkpoint, swapped)
    config = tiny_config(1000)
    small = Checkpoint(config, random_weights(config), tiny_checkpoint.tokenizer, "<small>", "small-draft")
    with pytest.raises(LoadError, match="1000-token vocabulary"):
        LLM(checkpoint=tiny_checkpoint, draft_checkpoint=small)


def _settle(policy: SpecPolicy, batch: int, by_length: dict[int, float]) -> list[int]:
    """Ticks at `batch` until its bucket settles, each at the rate `by_length` gives the length handed."""
    handed = []
    while bucket_of(batch) not in policy.verdicts:
        length = policy.draft_length(batch)
        handed.append(length)
        policy.observe(batch, length > 0, int(by_length[length]), 1.0)
    return handed


def test_adaptive_policy_measures_settles_and_persists(tmp_path):
    key = {"target": "t", "draft": "d"}
    policy = SpecPolicy("adaptive", key, str(tmp_path))
    # Batch 1: drafts double the tokens per second -> enable. Batch 8: they halve it -> decline.
    assert _settle(policy, 1, {1: 200.0, 0: 100.0}) == [0] * PROBE_TICKS + [1] * PROFILE_TICKS
    # Classic steps first; length 1 runs at half the classic rate, so it stops after EARLY_TICKS.
    assert _settle(policy, 8, {1: 50.0, 0: 100.0}) == [0] * PROBE_TICKS + [1] * EARLY_TICKS
    assert policy.measures[1].spec[1].ticks == PROFILE_TICKS
    assert policy.allows(1) and not policy.allows(8) and not policy.allows(5)  # 5 falls in the batch-8 bucket
    report = policy.report()
    assert report["verdicts"]["1"]["verdict"] == "enable" and report["verdicts"]["8"]["verdict"] == "decline"
    restarted = SpecPolicy("adaptive", key, str(tmp_path))  # a restart skips profiling
    assert restarted.allows(1) and not restarted.allows(8)
    assert not SpecPolicy("adaptive", {"target": "t", "draft": "other"}, str(tmp_path)).verdicts
    assert SpecPolicy("decline", key, str(tmp_path)).allows(1) is False


def test_an_mtp_head_defers_its_rows_only_where_nothing_drafts(tmp_path):
    key = {"target": "t", "draft": "d"}
    policy = SpecPolicy("adaptive", key, str(tmp_path))
    assert policy.defers_recording(8)  # no verdict yet, probing classic steps: no draft comes in them
    for _ in range(PROBE_TICKS):
        policy.observe(8, False, 100, 1.0)
    assert policy.draft_length(8) == 1 and not policy.defers_recording(8)  # profiling: drafts read the head's K/V
    _settle(policy, 1, {1: 200.0, 0: 100.0})
    _settle(policy, 8, {1: 50.0, 0: 100.0})
    assert policy.defers_recording(8) and policy.defers_recording(5) and not policy.defers_recording(1)
    assert policy.defers_recording(16) and policy.verdicts[16].inferred_from == 8  # above a decline
    assert SpecPolicy("decline", key, str(tmp_path)).defers_recording(1)
    assert not SpecPolicy("enable", key, str(tmp_path)).defers_recording(16)


def test_a_tick_the_policy_will_not_measure_runs_classic_while_it_profiles(tmp_path):
    """A tick with prefill rows in it is not observed, so a bucket still profiling does not draft in it; once the
    bucket has its verdict, such ticks follow the verdict."""
    policy = SpecPolicy("adaptive", {"target": "t", "draft": "d"}, str(tmp_path), block_size=2)
    for _ in range(PROBE_TICKS):
        policy.observe(4, False, 100, 1.0)
    assert policy.draft_length(4) == 1  # profiling its shortest length now
    assert policy.draft_length(4, measured=False) == 0
    _settle(policy, 4, {2: 300.0, 1: 200.0, 0: 100.0})
    assert policy.verdicts[4].verdict == "enable"
    assert policy.draft_length(4, measured=False) == policy.draft_length(4) == 2


def test_adaptive_policy_picks_the_fastest_draft_length(tmp_path):
    assert draft_lengths(4) == [1, 2, 4] and draft_lengths(6) == [1, 2, 4, 6] and draft_lengths(1) == [1]
    key = {"target": "t", "draft": "d", "draft_block_size": "4"}
    policy = SpecPolicy("adaptive", key, str(tmp_path), block_size=4)
    # Batch 1: length 2 is fastest (length 4's later drafts are mostly rejected: below EARLY_CUT of length 2's
    # rate, so it is cut after EARLY_TICKS). Batch 4: length 1 narrowly loses to classic steps, so no longer
    # length is tried (each would lose more).
    rates = {1: {4: 150.0, 2: 220.0, 1: 180.0, 0: 100.0}, 4: {4: 60.0, 2: 97.0, 1: 98.0, 0: 100.0}}
    assert EARLY_CUT * 100.0 < 98.0 and 150.0 < EARLY_CUT * 220.0
    assert _settle(policy, 1, rates[1]) == [0] * PROBE_TICKS + [1] * PROFILE_TICKS + [2] * PROFILE_TICKS + \
        [4] * EARLY_TICKS
    assert _settle(policy, 4, rates[4]) == [0] * PROBE_TICKS + [1] * PROFILE_TICKS
    assert policy.draft_length(1) == 2 and policy.draft_length(3) == 0  # 3 falls in the batch-4 bucket
    report = policy.report()
    assert report["verdicts"]["1"]["length"] == 2 and report["verdicts"]["1"]["by_length"]["4"] == 150.0
    assert report["verdicts"]["4"]["verdict"] == "decline" and report["lengths"] == [1, 2, 4]
    assert report["verdicts"]["4"]["by_length"] == {"1": 98.0}
    restarted = SpecPolicy("adaptive", key, str(tmp_path), block_size=4)
    assert restarted.draft_length(1) == 2 and restarted.draft_length(4) == 0
    assert SpecPolicy("enable", key, str(tmp_path), block_size=4).draft_length(8) == 4


def test_profiling_goes_on_while_a_longer_draft_raises_the_rate(tmp_path):
    """Every length is profiled where each beats the shorter ones (the longest wins); a length that does not stops
    the profile even when it still beats classic steps."""
    policy = SpecPolicy("adaptive", {"target": "t", "draft": "d"}, str(tmp_path), block_size=4)
    assert _settle(policy, 1, {1: 150.0, 2: 190.0, 4: 230.0, 0: 100.0}) == \
        [0] * PROBE_TICKS + [1] * PROFILE_TICKS + [2] * PROFILE_TICKS + [4] * PROFILE_TICKS
    assert policy.verdicts[1].length == 4
    # Length 2 beats classic steps but not length 1 (within EARLY_CUT of it, so measured in full): 4 is skipped.
    assert 140.0 > EARLY_CUT * 145.0
    assert _settle(policy, 2, {1: 145.0, 2: 140.0, 4: 500.0, 0: 100.0}) == \
        [0] * PROBE_TICKS + [1] * PROFILE_TICKS + [2] * PROFILE_TICKS
    assert policy.verdicts[2].length == 1 and policy.verdicts[2].by_length == {"1": 145.0, "2": 140.0}


def test_a_decline_holds_for_every_larger_batch_without_profiling(tmp_path):
    key = {"target": "t", "draft": "d"}
    policy = SpecPolicy("adaptive", key, str(tmp_path))
    _settle(policy, 2, {1: 80.0, 0: 100.0})
    assert policy.verdicts[2].verdict == "decline" and policy.verdicts[2].inferred_from == 0
    # Batch 16 and 5 (bucket 8): no tick drafts, the verdict says where it comes from and persists.
    assert policy.draft_length(16) == 0 and policy.draft_length(5) == 0
    assert policy.verdicts[16].inferred_from == 2 and policy.verdicts[8].inferred_from == 2
    assert 16 not in policy.measures and policy.report()["verdicts"]["16"]["verdict"] == "decline"
    assert SpecPolicy("adaptive", key, str(tmp_path)).verdicts[16].inferred_from == 2
    # A smaller batch is still measured: drafts may pay where the verify forward is not compute-bound.
    assert _settle(policy, 1, {1: 200.0, 0: 100.0})[:PROBE_TICKS] == [0] * PROBE_TICKS
    assert policy.allows(1) and not policy.allows(2)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("length", [1, 2])
def test_the_scheduler_drafts_the_length_the_policy_gives(tiny_checkpoint, plain_outputs, length):
    want, _ = plain_outputs
    spec = _speculative(tiny_checkpoint, make_tiny(seed=7), draft_block_size=4)
    scheduler = spec.engine.scheduler
    scheduler.draft_length = lambda batch, measured=True: length
    drafted = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        drafted.extend(c.draft.num_tokens for c in out.chunks if c.draft is not None)
        return out

    scheduler.schedule = recording_schedule
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert drafted and max(drafted) == length  # never the block size of 4
    spec.engine.pool.check_integrity()
