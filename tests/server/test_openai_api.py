"""The API over a real socket, driven by the official openai client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

CHAT = [{"role": "user", "content": "Tell me about continuous batching."}]


def test_models_lists_the_served_model(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert served.client().models.retrieve(served.model).id == served.model
    # llama-server's meta block; the tied head is the embedding, so it is counted once.
    meta = httpx.get(f"{served.url}/v1/models").json()["data"][0]["meta"]
    cfg = served.core.model_config
    embedding = cfg.vocab_size * cfg.hidden_size
    assert meta["n_params"] == served.core.num_params and meta["n_vocab"] == cfg.vocab_size
    assert meta["architecture"] == "llama"
    assert embedding < meta["n_params"] < (2 if cfg.tie_word_embeddings else 3) * embedding + 10**9


def test_chat_completion(served):
    r = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == served.model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 10  # the chat template's system prompt is in there
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_with_text_and_token_prompts(served):
    client = served.client()
    ids = httpx.post(f"{served.url}/tokenize", json={"content": "The quick brown fox"}).json()["tokens"]
    by_text = client.completions.create(model=served.model, prompt="The quick brown fox", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text != ""
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6


def test_completion_batch_of_prompts_and_n(served):
    r = served.client().completions.create(model=served.model, prompt=["one", "two three"], n=2, max_tokens=4,
                                           temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of a prompt agree
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == 1 + 2  # each prompt counted once, not once per choice


def test_chat_streaming_matches_non_streaming(served):
    client = served.client()
    full = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stream_include_usage(served):
    chunks = list(served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_streaming_with_n(served):
    chunks = list(served.client().completions.create(model=served.model, prompt="Hello", n=2, max_tokens=6,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts[0] == texts[1] != "" and finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_n_choices_with_sampling(served):
    r = served.client().chat.completions.create(model=served.model, messages=CHAT, n=2, max_tokens=6, seed=7,
                                                temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12


def test_stop_string_truncates(served):
    client = served.client()
    base = client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=24,
                                     temperature=0).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), f"degenerate stop string from {base!r}"
    r = client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                  stop=[stop, "\u2603never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.find(stop)]
    streamed = client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=24,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == base[:base.find(stop)]


def test_chat_logprobs_shape(served):
    r = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and bytes(token.bytes).decode(errors="replace")
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.top_logprobs[0].token == token.token  # greedy picks the best


def test_completion_logprobs_shape(served):
    r = served.client().completions.create(model=served.model, prompt="Hello", max_tokens=4, temperature=0,
                                           logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_streaming_chat_logprobs(served):
    chunks = list(served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=4,
                                                          temperature=0, logprobs=True, top_logprobs=1,
                                                          stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 4 and all(len(t.top_logprobs) == 1 for t in tokens)


def test_seed_reproducibility(served):
    client = served.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=10, temperature=1.0,
                                              seed=seed).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_extra_fields_and_priority_header(served):
    client = served.client(default_headers={"X-Priority": "5"})
    r = client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=3, temperature=0.5, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.2, logit_bias={"42": -100}, user="me", response_format={"type": "text"},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "priority": 3,
                    "cache_prompt": False})
    assert r.usage.completion_tokens == 3
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # cache_prompt false: nothing adopted


def test_llama_server_slot_pin_is_accepted_and_range_checked(served):
    """id_slot (llama-server) pins nothing here (every slot shares the prefix cache) but is not an unknown field."""
    client = served.client()
    r = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"id_slot": 0})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, extra_body={"id_slot": -2})
    assert "id_slot" in str(err.value)


def test_prefix_cache_reports_cached_tokens(served):
    client = served.client()
    long_chat = [{"role": "user", "content": "word " * 80}]
    client.chat.completions.create(model=served.model, messages=long_chat, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=served.model, messages=long_chat, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64


@pytest.mark.batch_invariant
def test_concurrent_streams_equal_sequential(served):
    """Batched greedy output is the same text as one request at a time."""
    prompts = [("Hello", 12), ("The weather today", 20), ("1 2 3 4", 8), ("Write a poem", 16),
               ("Why is the sky blue?", 24), ("Once", 10), ("Continuous batching keeps slots busy", 18),
               ("a b c", 14), ("Tell me a story about a robot", 22), ("zzz", 6)]

    async def one(client, prompt: str, max_tokens: int) -> str:
        stream = await client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run(concurrent: bool) -> list[str]:
        async with served.async_client() as client:
            if concurrent:
                return list(await asyncio.gather(*(one(client, p, m) for p, m in prompts)))
            return [await one(client, p, m) for p, m in prompts]

    sequential = asyncio.run(run(concurrent=False))
    concurrent = asyncio.run(run(concurrent=True))
    assert all(sequential)
    assert concurrent == sequential


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize"])
def test_tokenize_roundtrip(served, route):
    ids = httpx.post(f"{served.url}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    if route == "/tokenize":
        pieces = httpx.post(f"{served.url}/tokenize", json={"prompt": "Hello world", "with_pieces": True}).json()
        assert [p["id"] for p in pieces["tokens"]] == ids
        assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    else:
        assert httpx.post(f"{served.url}/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}
