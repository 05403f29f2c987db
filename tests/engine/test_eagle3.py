"""EAGLE3 drafting (--draft-kind eagle3 --draft-model PATH) on a tiny random Llama target with tiny EAGLE3
drafters written as Hugging Face directories (EAGLE3's layout and speculators'): greedy output bitwise plain
decoding at 1 and 16 concurrent requests with a random drafter (drafts rejected, a draft vocabulary through d2t),
one built to agree with a bigram target (drafts accepted) and one that agrees only sometimes; sampled rows verified
by rejection sampling; chunked prefill, prefix hits and preemption; every KV block back; the refusals.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import ConfigError, EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import LoadError
from conveyor.testing import bigram_target, tiny_checkpoint, tiny_hybrid_checkpoint, write_tiny_eagle3

pytestmark = pytest.mark.batch_invariant

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(16)]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 3), ignore_eos=True)


def _eagle3(checkpoint, drafter: str, parallel: int, **extra) -> LLM:
    extra.setdefault("speculative_max_rows", 64)
    return LLM(checkpoint=checkpoint, parallel=parallel, draft_kind="eagle3", draft_model=drafter,
               draft_policy="enable", **extra)


def _plain(checkpoint, prompts: list[str]) -> list[list[int]]:
    llm = LLM(checkpoint=checkpoint, parallel=len(prompts), speculative_ngram=0)
    return [o.token_ids for o in llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])]


def _check_released(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    target = tiny_checkpoint(0, num_hidden_layers=4)  # vLLM's default aux layers: 2, 2, 1
    return target, write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target), _plain(target, PROMPTS)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_random_drafter_greedy_is_plain_decoding(random_drafter, concurrency):
    target, drafter, want = random_drafter
    spec = _eagle3(target, drafter, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    report = spec.engine.speculation_report()["draft_model"]
    assert report["kind"] == "eagle3" and report["draft_tokens"] > 0
    assert spec.engine.runner.drafter.aux_layers == (2, 2, 1)
    _check_released(spec)


def test_speculators_layout_and_its_layer_ids(tmp_path):
    target = tiny_checkpoint(1, num_hidden_layers=6)
    drafter = write_tiny_eagle3(tmp_path, target, seed=3, speculators=True, aux_layer_ids=[0, 3, 6],
                                draft_vocab_size=None)  # the embedding, a middle stream, the stream before the norm
    spec = _eagle3(target, drafter, 16)
    assert spec.engine.runner.drafter.aux_layers == (0, 3, 6)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == _plain(target, PROMPTS)
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    _check_released(spec)


def _agreeing(tmp_path_factory, noise: float = 0.0):
    target = bigram_target(tiny_checkpoint(0, num_hidden_layers=4))
    ids = sorted({t for p in PROMPTS for t in target.tokenizer.encode(p)})
    drafter = write_tiny_eagle3(tmp_path_factory.mktemp("agreeing"), target, agreeing=ids, noise=noise)
    return target, drafter, _plain(target, PROMPTS)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    return _agreeing(tmp_path_factory)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_an_agreeing_drafter_has_its_drafts_accepted(agreeing, concurrency):
    target, drafter, want = agreeing
    assert len(set(want[0])) > 4  # not stuck on one token
    spec = _eagle3(target, drafter, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens >= 0.9 * stats.num_model_draft_tokens
    plain = LLM(checkpoint=target, parallel=concurrency, speculative_ngram=0)
    plain.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert spec.engine.counters.num_steps < plain.engine.counters.num_steps / 2  # k = 4 drafts per round
    _check_released(spec)


def test_partial_acceptance_stays_exact(tmp_path_factory):
    target, drafter, want = _agreeing(tmp_path_factory, noise=0.2)  # measured: ~55 % accepted
    spec = _eagle3(target, drafter, 16, block_size=4)  # small blocks: drafts cross them
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert 0 < stats.num_model_accepted_tokens < 0.9 * stats.num_model_draft_tokens
    _check_released(spec)


def test_sampled_rows_draft_and_are_verified(agreeing):
    target, drafter, _ = agreeing
    spec = _eagle3(target, drafter, 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens > 0
    _check_released(spec)


def test_sampled_rows_with_a_random_drafter_are_rejected_and_run_on(random_drafter):
    target, drafter, _ = random_drafter
    spec = _eagle3(target, drafter, 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > stats.num_model_accepted_tokens
    _check_released(spec)


def test_prefix_hits_and_chunked_prefill_keep_greedy_exact(random_drafter):
    target, drafter, want = random_drafter
    spec = _eagle3(target, drafter, 16, prefill_chunk_size=7)
    params = [_greedy(i) for i in range(len(PROMPTS))]
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want  # the second time from the prefix cache
    _check_released(spec)


def test_preemption_keeps_greedy_exact(random_drafter):
    target, drafter, _ = random_drafter
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True) for _ in range(8)]
    plain = LLM(checkpoint=target, parallel=8, ctx_size=8 * 512, speculative_ngram=0)
    want = [o.token_ids for o in plain.generate(PROMPTS[:8], params)]
    probe = _eagle3(target, drafter, 8, ctx_size=8 * 512, enable_prefix_caching=False)
    budget = 33 * probe.engine.pool_plan.bytes_per_block  # a block holds the drafter's K/V too
    tight = _eagle3(target, drafter, 8, ctx_size=8 * 512, kv_cache_budget=str(budget), enable_prefix_caching=False)
    assert [g.token_ids for g in tight.generate(PROMPTS[:8], params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert tight.engine.scheduler.stats.num_model_draft_tokens > 0
    _check_released(tight)


def test_eagle3_needs_a_draft_model():
    with pytest.raises(ConfigError, match="--draft-kind eagle3 needs --draft-model PATH"):
        EngineConfig(draft_kind="eagle3")


def test_a_drafter_of_another_hidden_size_is_refused(random_drafter):
    _, drafter, _ = random_drafter
    with pytest.raises(LoadError, match="hidden size 64 does not match"):
        _eagle3(tiny_checkpoint(0, hidden_size=32, num_hidden_layers=4), drafter, 1)


def test_a_target_that_is_not_a_dense_decoder_is_refused(random_drafter):
    _, drafter, _ = random_drafter
    with pytest.raises(LoadError, match="not a dense decoder"):
        _eagle3(tiny_hybrid_checkpoint("qwen3_5_text"), drafter, 1)


def test_aux_layers_past_the_target_are_refused(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=4)
    drafter = write_tiny_eagle3(tmp_path, target, aux_layer_ids=[1, 2, 9])
    with pytest.raises(LoadError, match=r"aux hidden state layers \[1, 2, 9\] do not fit"):
        _eagle3(target, drafter, 1)


def test_eagle3s_own_pytorch_model_bin_loads(random_drafter, tmp_path):
    """EAGLE3's own releases (yuhuili/EAGLE3-*) ship pytorch_model.bin, not safetensors."""
    target, drafter, want = random_drafter
    shutil.copy(f"{drafter}/config.json", tmp_path / "config.json")
    torch.save(load_file(f"{drafter}/model.safetensors"), tmp_path / "pytorch_model.bin")
    spec = _eagle3(target, str(tmp_path), 16)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
