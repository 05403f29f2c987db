"""The engine on a tiny random model: batching never changes a request's output, nothing leaks."""

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.request import RequestStatus
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: " + "lorem ipsum dolor " * (i % 7 * 3) + f"end {i}" for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=16, prefill_chunk_size=64)


def _assert_pool_clean(llm: LLM) -> None:
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0


@pytest.mark.batch_invariant
def test_batched_greedy_equals_one_at_a_time(llm):
    prompts = _prompts(20)
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * (i % 6), ignore_eos=True) for i in range(20)]
    batched = llm.generate(prompts, params)
    _assert_pool_clean(llm)
    for prompt, p, got in zip(prompts, params, batched):
        alone = llm.generate([prompt], [p])[0]
        assert got.token_ids == alone.token_ids
        assert got.text == alone.text
        assert len(got.token_ids) == p.max_tokens and got.finish_reason == "length"
    _assert_pool_clean(llm)


@pytest.mark.batch_invariant
def test_seeded_sampling_is_batch_independent(llm):
    prompts = _prompts(16)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1000 + i, ignore_eos=True)
              for i in range(16)]
    batched = llm.generate(prompts, params)
    for i in (0, 5, 11):
        alone = llm.generate([prompts[i]], [params[i]])[0]
        assert alone.token_ids == batched[i].token_ids
    # Different seeds give different samples (the test can fail if sampling ignored the seed).
    assert len({tuple(r.token_ids) for r in batched}) > 1
    _assert_pool_clean(llm)


def test_unseeded_sampling_varies(llm):
    p = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)
    outs = {tuple(llm.generate(["same prompt"], [p])[0].token_ids) for _ in range(3)}
    assert len(outs) > 1


def test_stop_string_truncates_and_finishes(llm):
    free = llm.generate(["stop test"], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    stop = free.text[5:8]
    assert stop
    got = llm.generate(["stop test"], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])])[0]
    assert got.finish_reason == "stop"
    assert got.text == free.text[:free.text.find(stop)]
    _assert_pool_clean(llm)


def test_stop_token_ids_and_logprobs(llm):
    free = llm.generate(["tokens"], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)])[0]
    assert len(free.logprobs) == 6
    for token, lp in zip(free.token_ids, free.logprobs):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the top alternative
        assert lp.logprob == pytest.approx(lp.top[0][1])
    got = llm.generate(["tokens"], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   stop_token_ids=[free.token_ids[2]])])[0]
    assert got.token_ids == free.token_ids[:3] and got.finish_reason == "stop"


def test_logit_bias_forces_a_token(llm):
    got = llm.generate(["bias"], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                 logit_bias={42: 100.0})])[0]
    assert got.token_ids == [42, 42, 42]


def test_penalties_change_greedy_output(llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(["repeat repeat repeat"], [base])[0]
    penalized = llm.generate(["repeat repeat repeat"], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                        frequency_penalty=2.0)])[0]
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))
    assert penalized.token_ids != plain.token_ids


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                    dict(min_p=2), dict(logprobs=50)])
def test_invalid_sampling_params_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_prompt_over_context_and_empty_prompt_rejected(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="context window"):
        engine.make_request([1] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.make_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.make_request([10**9], SamplingParams())
    assert not engine.has_work()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    request = engine.make_request(llm.tokenizer.encode("abort me " * 20), SamplingParams(max_tokens=100))
    engine.add_request(request)
    engine.step()
    engine.step()
    assert engine.pool.stats().num_used > 0
    out = engine.abort(request.request_id)
    assert out.finished and out.finish_reason == "abort" and request.status == RequestStatus.FINISHED_CANCELLED
    assert engine.pool.stats().num_used == 0
    engine.step()  # the runner forgets the request
    _assert_pool_clean(llm)


def test_failed_step_finishes_only_its_requests(llm, monkeypatch):
    engine = llm.engine
    request = engine.make_request(llm.tokenizer.encode("boom"), SamplingParams(max_tokens=5))
    engine.add_request(request)

    def explode(plan):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", explode)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"] and "injected fault" in outs[0].error
    monkeypatch.undo()
    ok = llm.generate(["after the fault"], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])[0]
    assert len(ok.token_ids) == 3
    _assert_pool_clean(llm)


@pytest.mark.batch_invariant
def test_chat_batch_equals_single_chats(llm):
    conversations = [[{"role": "user", "content": f"Question {i}: " + "why " * i}] for i in range(6)]
    conversations[2] = [{"role": "system", "content": "Be brief."}, *conversations[2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = llm.chat(conversations, params)
    assert isinstance(batched, list) and len(batched) == len(conversations)
    for messages, got in zip(conversations, batched):
        alone = llm.chat(messages, params)
        assert not isinstance(alone, list)
        assert got.token_ids == alone.token_ids and got.text == alone.text
        # The chat template was applied: the prompt is the rendered conversation, not the raw text.
        rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert alone.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    _assert_pool_clean(llm)
