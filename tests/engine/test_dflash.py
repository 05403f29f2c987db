"""DFlash drafting (--draft-kind dflash --draft-model PATH) on a tiny random Llama target with tiny DFlash drafters
written as z-lab's Hugging Face directories: greedy output bitwise plain decoding at 1 and 16 concurrent requests
with a random drafter (drafts rejected) and one whose first mask row agrees with a bigram target (block 2: all
accepted; block 4: one in three); sampled rows verified by rejection sampling; chunked prefill, prefix hits and
preemption; every KV block back; the refusals.
"""

import json
import shutil

import pytest

from conveyor.config import ConfigError, EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import LoadError
from conveyor.testing import dflash_target, tiny_checkpoint, tiny_hybrid_checkpoint, write_tiny_dflash

pytestmark = pytest.mark.batch_invariant

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(16)]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 3), ignore_eos=True)


def _dflash(checkpoint, drafter: str, parallel: int, **extra) -> LLM:
    extra.setdefault("speculative_max_rows", 64)
    return LLM(checkpoint=checkpoint, parallel=parallel, draft_kind="dflash", draft_model=drafter,
               draft_policy="enable", **extra)


def _plain(checkpoint, prompts: list[str]) -> list[list[int]]:
    llm = LLM(checkpoint=checkpoint, parallel=len(prompts), speculative_ngram=0)
    return [o.token_ids for o in llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])]


def _check_released(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    target = tiny_checkpoint(0, num_hidden_layers=4)
    return target, write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target), _plain(target, PROMPTS)


@pytest.fixture(scope="module")
def agreeing_target():
    target = dflash_target(tiny_checkpoint(0, num_hidden_layers=4))
    return target, _plain(target, PROMPTS)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_random_drafter_greedy_is_plain_decoding(random_drafter, concurrency):
    target, drafter, want = random_drafter
    spec = _dflash(target, drafter, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    report = spec.engine.speculation_report()["draft_model"]
    assert report["kind"] == "dflash" and report["draft_tokens"] > 0
    assert report["block_size"] == 3  # --draft-block-size 4, capped by the drafter's block of 4: 3 drafts
    assert spec.engine.runner.drafter.aux_layers == (1, 3)  # the outputs of target layers 0 and 2
    _check_released(spec)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_an_agreeing_drafter_has_its_drafts_accepted(agreeing_target, tmp_path, concurrency):
    target, want = agreeing_target
    assert len(set(want[0])) > 4  # not stuck on one token
    drafter = write_tiny_dflash(tmp_path, target, block_size=2, agreeing=True)
    spec = _dflash(target, drafter, concurrency)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0
    assert stats.num_model_accepted_tokens >= 0.9 * stats.num_model_draft_tokens
    _check_released(spec)


def test_partial_acceptance_stays_exact(agreeing_target, tmp_path):
    target, want = agreeing_target
    drafter = write_tiny_dflash(tmp_path, target, block_size=4, agreeing=True)  # only the first of 3 drafts agrees
    spec = _dflash(target, drafter, 16, block_size=4)  # small KV blocks: drafts cross them
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    stats = spec.engine.scheduler.stats
    assert 0.2 * stats.num_model_draft_tokens < stats.num_model_accepted_tokens < 0.5 * stats.num_model_draft_tokens
    _check_released(spec)


def test_sampled_rows_draft_and_are_verified(agreeing_target, tmp_path):
    target, _ = agreeing_target
    spec = _dflash(target, write_tiny_dflash(tmp_path, target, block_size=2, agreeing=True), 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_accepted_tokens > 0
    _check_released(spec)


def test_sampled_rows_with_a_random_drafter_are_rejected_and_run_on(random_drafter):
    target, drafter, _ = random_drafter
    spec = _dflash(target, drafter, 8)
    outs = spec.generate(PROMPTS[:8], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = spec.engine.scheduler.stats
    assert stats.num_model_draft_tokens > stats.num_model_accepted_tokens
    _check_released(spec)


def test_prefix_hits_and_chunked_prefill_keep_greedy_exact(random_drafter):
    target, drafter, want = random_drafter
    spec = _dflash(target, drafter, 16, prefill_chunk_size=7)
    params = [_greedy(i) for i in range(len(PROMPTS))]
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want
    assert [g.token_ids for g in spec.generate(PROMPTS, params)] == want  # the second time from the prefix cache
    _check_released(spec)


def test_preemption_keeps_greedy_exact(random_drafter):
    target, drafter, _ = random_drafter
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True) for _ in range(8)]
    plain = LLM(checkpoint=target, parallel=8, ctx_size=8 * 512, speculative_ngram=0)
    want = [o.token_ids for o in plain.generate(PROMPTS[:8], params)]
    probe = _dflash(target, drafter, 8, ctx_size=8 * 512, enable_prefix_caching=False)
    budget = 33 * probe.engine.pool_plan.bytes_per_block  # a block holds the drafter's K/V too
    tight = _dflash(target, drafter, 8, ctx_size=8 * 512, kv_cache_budget=str(budget), enable_prefix_caching=False)
    assert [g.token_ids for g in tight.generate(PROMPTS[:8], params)] == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert tight.engine.scheduler.stats.num_model_draft_tokens > 0
    _check_released(tight)


def test_without_target_layer_ids_the_reference_default_is_read(random_drafter, tmp_path):
    target, _, want = random_drafter
    drafter = write_tiny_dflash(tmp_path, target, target_layer_ids=[1, 1])
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]  # 2 drafter layers over 4 target layers: 1 .. N-3 = [1, 1]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = _dflash(target, drafter, 16)
    assert spec.engine.runner.drafter.aux_layers == (2, 2)
    assert [g.token_ids for g in spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])] == want
    _check_released(spec)


def test_a_q8_0_kv_cache_keeps_greedy_exact(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    drafter = write_tiny_dflash(tmp_path, target, layer_shape=dict(num_attention_heads=2, num_key_value_heads=1,
                                                                   head_dim=32))  # q8_0 rows: 32 values
    q8 = dict(cache_type_k="q8_0", cache_type_v="q8_0")  # the drafter's K/V too
    plain = LLM(checkpoint=target, parallel=16, speculative_ngram=0, **q8)
    want = [o.token_ids for o in plain.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])]
    spec = _dflash(target, drafter, 16, **q8)
    assert [g.token_ids for g in spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    _check_released(spec)


def test_the_adaptive_policy_covers_the_drafter(random_drafter, tmp_path):
    target, drafter, want = random_drafter
    spec = LLM(checkpoint=target, parallel=16, draft_kind="dflash", draft_model=drafter, cache_dir=str(tmp_path),
               speculative_max_rows=64)  # draft_policy adaptive (the default)
    got = spec.generate(PROMPTS, [_greedy(i) for i in range(len(PROMPTS))])
    assert [g.token_ids for g in got] == want
    report = spec.engine.speculation_report()  # what /v1/internal/spec-policy serves
    assert report["draft_model"]["kind"] == "dflash"
    policy = report["policy"]
    assert policy["mode"] == "adaptive" and policy["block_size"] == 3 and policy["lengths"] == [1, 2, 3]
    assert policy["key"]["draft"].endswith(":dflash:" + drafter.rsplit("/", 1)[-1])
    _check_released(spec)


def test_dflash_needs_a_draft_model():
    with pytest.raises(ConfigError, match="--draft-kind dflash needs --draft-model PATH"):
        EngineConfig(draft_kind="dflash")


def test_a_drafter_of_another_hidden_size_is_refused(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=4)
    drafter = write_tiny_dflash(tmp_path, target, hidden_size=32)
    with pytest.raises(LoadError, match="the drafter's hidden size 32 does not match .* 64"):
        _dflash(target, drafter, 1)


def test_a_target_layer_the_target_lacks_is_refused(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=4)
    drafter = write_tiny_dflash(tmp_path, target, target_layer_ids=[1, 4])
    with pytest.raises(LoadError, match=r"target layers \[1, 4\] do not fit .* 4 layers"):
        _dflash(target, drafter, 1)


def test_a_target_that_is_not_a_dense_decoder_is_refused(random_drafter):
    _, drafter, _ = random_drafter
    with pytest.raises(LoadError, match="not a dense decoder"):
        _dflash(tiny_hybrid_checkpoint("qwen3_5_text"), drafter, 1)


def test_dflash2_and_causal_drafters_are_refused(random_drafter, tmp_path):
    target, drafter, _ = random_drafter
    raw = json.loads(open(f"{drafter}/config.json").read())
    shutil.copy(f"{drafter}/model.safetensors", tmp_path / "model.safetensors")
    for change, message in (({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel is not a DFlash"),
                            ({"is_causal": True}, "causal or sliding-window")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(LoadError, match=message):
            _dflash(target, str(tmp_path), 1)
