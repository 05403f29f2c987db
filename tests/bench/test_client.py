import asyncio

import pytest

from conveyor.bench.client import (RequestSpec, Target, build_body, card_param_count, fetch_first_model, make_client,
                                   normalize_base_url, send_request)


def _send(url, spec, endpoint="chat", model="fake-model"):
    async def go():
        async with make_client(None, 10.0, 4) as client:
            return await send_request(client, Target(url, endpoint, model), spec)
    return asyncio.run(go())


def test_normalize_base_url():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"


def test_body_fields():
    body = build_body(Target("u", "completions", "m"), RequestSpec("hi", 7, 0.0, ignore_eos=True))
    assert body["prompt"] == "hi" and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    chat = build_body(Target("u", "chat", "m"), RequestSpec("hi", 7))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_timings_and_text(fake_server, endpoint):
    record = _send(fake_server.url, RequestSpec("a b c", 6), endpoint)
    assert record.ok, record.error
    assert record.text == " w0 w1 w2 w3 w4 w5"
    assert record.num_output_tokens == 6 and len(record.chunk_times_s) == 6
    assert 0 < record.ttft_s <= record.e2e_s and len(record.itl_s) == 5


def test_tokens_from_usage_else_chunks(fake_server):
    fake_server.state.tokens_per_chunk = 2
    assert _send(fake_server.url, RequestSpec("p", 8)).num_output_tokens == 8  # usage
    fake_server.state.send_usage = False
    assert _send(fake_server.url, RequestSpec("p", 8)).num_output_tokens == 4  # one per chunk


def test_ignore_eos_reaches_server(fake_server):
    fake_server.state.eos_after = 3
    assert _send(fake_server.url, RequestSpec("p", 8)).num_output_tokens == 3
    assert _send(fake_server.url, RequestSpec("p", 8, ignore_eos=True)).num_output_tokens == 8


def test_errors_are_recorded_not_raised(fake_server):
    fake_server.state.fail_every = 1
    record = _send(fake_server.url, RequestSpec("p", 4))
    assert record.error.startswith("HTTP 503") and "overloaded" in record.error
    fake_server.state.fail_every, fake_server.state.midstream_error_every = 0, 1
    record = _send(fake_server.url, RequestSpec("p", 4))
    assert "engine died" in record.error
    refused = _send("http://127.0.0.1:9", RequestSpec("p", 4))  # discard port: nothing listens
    assert refused.error.startswith("ConnectError")


def test_first_model(fake_server):
    async def go():
        async with make_client(None, 10.0, 1) as client:
            return await fetch_first_model(client, fake_server.url)
    card = asyncio.run(go())
    assert card["id"] == "fake-model" and card_param_count(card) is None  # the fake sends no meta


def test_card_param_count():
    assert card_param_count({"id": "m", "meta": {"n_params": 134515008}}) == 134515008
    assert card_param_count({"id": "m", "meta": {"n_params": "big"}}) is None
    assert card_param_count({"id": "m", "meta": None}) is None
