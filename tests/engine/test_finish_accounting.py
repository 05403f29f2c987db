"""One truth for every count: the finish reason is decided once, the counters agree with the outputs,
and what the scheduler hands the runner is a snapshot."""

import pytest

from conveyor.engine.block_pool import BlockPool
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.llm import LLM
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.scheduling_policy import SchedulerConfig


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=4, speculative_ngram=4)


def _totals(llm: LLM) -> dict:
    stats = llm.engine.scheduler.stats
    return {"reasons": dict(stats.finished_by_reason), "generated": stats.num_generated_tokens,
            "by_reason": dict(stats.generation_tokens_by_reason), "prompt": dict(stats.prompt_tokens_by_reason)}


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if after.get(k, 0) != before.get(k, 0)}


def _last_token_stop_case(llm: LLM) -> tuple[str, int, object, str]:
    """A prompt whose greedy max_tokens-th token completes a stop string found nowhere earlier."""
    for prompt in ("Once upon a time there was a robot", "The capital of France is", "1, 2, 3, 4,", "Hello"):
        for max_tokens in (12, 9, 15, 7):
            reference = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              ignore_eos=True))[0]
            assert reference.finish_reason == "length" and len(reference.token_ids) == max_tokens
            before_text = llm.tokenizer.decode(reference.token_ids[:-1])
            assert reference.text.startswith(before_text)
            stop = reference.text[len(before_text):]
            if stop.strip() and reference.text.find(stop) == len(before_text):
                return prompt, max_tokens, reference, stop
    raise AssertionError("no candidate prompt gives a fresh stop string on its last token: add candidates")


def test_stop_string_on_the_last_allowed_token_is_stop_and_counted_once(llm):
    # A stop string that completes exactly with the max_tokens-th token: the text is cut, so "stop".
    prompt, max_tokens, reference, stop = _last_token_stop_case(llm)
    before = _totals(llm)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=[stop]))[0]
    after = _totals(llm)
    assert got.finish_reason == "stop"
    assert got.token_ids == reference.token_ids
    assert _delta(after["reasons"], before["reasons"]) == {"stop": 1}  # never "length" as well, never relabelled
    assert after["generated"] - before["generated"] == len(got.token_ids)
    assert _delta(after["by_reason"], before["by_reason"]) == {"stop": len(got.token_ids)}
    assert _delta(after["prompt"], before["prompt"]) == {"stop": len(got.prompt_token_ids)}


def test_counters_equal_sums_over_outputs_with_stops_inside_drafts(llm):
    # Repetitive prompts make prompt-lookup drafts accepted; stop strings then land inside them.
    prompts = ["one two three four one two three four one two three four " * 2 + str(i) for i in range(6)]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = []
    for ref in plain:
        middle = ref.text[len(ref.text) // 2:][:4]
        params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                     stop=[middle] if middle.strip() else []))
    before = _totals(llm)
    got = llm.generate(prompts, params)
    after = _totals(llm)
    reasons = {}
    for out in got:
        reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
    assert _delta(after["reasons"], before["reasons"]) == reasons
    assert after["generated"] - before["generated"] == sum(len(o.token_ids) for o in got)
    by_reason = {}
    for out in got:
        by_reason[out.finish_reason] = by_reason.get(out.finish_reason, 0) + len(out.token_ids)
    assert _delta(after["by_reason"], before["by_reason"]) == {k: v for k, v in by_reason.items() if v}
    for out, ref in zip(got, plain):  # stopping is exact: a prefix of the plain greedy text
        assert ref.token_ids[:len(out.token_ids)] == out.token_ids
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


def test_scheduled_block_table_is_a_snapshot():
    kv = KVCacheManager(BlockPool(32, enable_caching=False), 4)
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_model_len=128, prefill_chunk_size=8), kv)
    s.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5)))
    plan = s.schedule()
    (chunk,) = plan.chunks
    table = chunk.block_table
    assert isinstance(table, tuple) and len(table) == 2  # 8 tokens in blocks of 4
    request = s.requests["a"]
    assert kv.grow(request, 16)  # the request's own table grows (next chunk) ...
    assert chunk.block_table == table and len(kv.block_table("a")) == 4  # ... the chunk's does not
    assert chunk.output_token_ids == () and chunk.prompt_token_ids == tuple(range(20))  # penalty history
    request.append_output_token(7)
    assert chunk.output_token_ids == ()
