"""/v1/embeddings, /embedding, /v1/rerank and /v1/score over a real socket, driven by the official openai SDK
(embeddings.create, float and base64) and httpx, on tiny random embedder / reranker checkpoints."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.loading.hf_loader import load_hf_dir
from tests.pooling_models import write_qwen3_embedder, write_qwen3_reranker
from tests.server.conftest import serve

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings turn text into vectors.", "A"]


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory) -> str:
    return write_qwen3_embedder(tmp_path_factory.mktemp("embedder") / "tiny-embedder")


@pytest.fixture(scope="module")
def embedder(embedder_dir):
    with serve(load_hf_dir(embedder_dir), EngineConfig(parallel=4, dtype="float32")) as served:
        yield served


def test_openai_sdk_embeddings_float_and_base64(embedder, embedder_dir):
    client = embedder.client()
    floats = client.embeddings.create(model=embedder.model, input=TEXTS, encoding_format="float")
    # The SDK's default asks for base64 and decodes it (numpy): the same vectors, bit for bit.
    b64 = client.embeddings.create(model=embedder.model, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2]
    for a, b in zip(floats.data, b64.data):
        assert np.array_equal(np.asarray(a.embedding, dtype=np.float32), np.asarray(b.embedding, dtype=np.float32))
    st = pytest.importorskip("sentence_transformers")
    expected = st.SentenceTransformer(embedder_dir, device="cpu").encode(TEXTS, batch_size=len(TEXTS))
    torch.testing.assert_close(torch.tensor([d.embedding for d in floats.data]), torch.as_tensor(expected),
                               atol=2e-5, rtol=1e-4)
    assert floats.usage.prompt_tokens == sum(len(embedder.core.tokenizer.encode(t)) for t in TEXTS)
    one = client.embeddings.create(model=embedder.model, input=TEXTS[0], encoding_format="float")
    assert one.data[0].embedding == floats.data[0].embedding  # alone or with others: bitwise


def test_dimensions_token_arrays_and_prompt_name(embedder):
    client = embedder.client()
    full = client.embeddings.create(model=embedder.model, input=TEXTS[1], encoding_format="float").data[0].embedding
    cut = client.embeddings.create(model=embedder.model, input=TEXTS[1], dimensions=16,
                                   encoding_format="float").data[0].embedding
    expected = np.asarray(full[:16], dtype=np.float32)
    np.testing.assert_allclose(cut, expected / np.linalg.norm(expected), rtol=1e-6)
    ids = embedder.core.tokenizer.encode(TEXTS[1])
    by_ids = client.embeddings.create(model=embedder.model, input=[ids], encoding_format="float").data[0].embedding
    assert by_ids == full
    query = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": TEXTS[1], "prompt_name": "query"}).json()
    assert query["data"][0]["embedding"] != full  # the instruction was prepended
    bad = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": TEXTS[1], "prompt_name": "nope"})
    assert bad.status_code == 400 and "query" in bad.json()["error"]["message"]


def test_llama_server_embedding_route(embedder):
    reply = httpx.post(f"{embedder.url}/embedding", json={"content": TEXTS[:2]})
    assert reply.status_code == 200
    body = reply.json()
    full = embedder.client().embeddings.create(model=embedder.model, input=TEXTS[:2], encoding_format="float")
    assert [item["embedding"][0] for item in body] == [d.embedding for d in full.data]


def test_bad_inputs_are_400s_and_nothing_leaks(embedder):
    client = embedder.client()
    long_text = "word " * 2000  # past the 512-token context
    for kwargs, param in [(dict(input=""), "input"), (dict(input=[]), "input"), (dict(input=[[10**9]]), "input"),
                          (dict(input=long_text), "input"), (dict(input="x", dimensions=100000), "dimensions")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=embedder.model, encoding_format="float", **kwargs)
        assert info.value.body["param"] == param, kwargs
    cut = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": 100})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 100
    chat = httpx.post(f"{embedder.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    rerank = httpx.post(f"{embedder.url}/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert rerank.status_code == 400
    embedder.wait_until(lambda: embedder.engine.num_in_flight == 0, what="requests to finish")
    embedder.core.kv.check_integrity()


def test_a_generating_model_refuses_embeddings(tiny):
    with serve(tiny) as served:
        with pytest.raises(openai.BadRequestError, match="--embeddings"):
            served.client().embeddings.create(model=served.model, input="hello")


def test_rerank_and_score_on_a_yes_no_reranker(tmp_path):
    transformers = pytest.importorskip("transformers")
    from conveyor.engine.rerank_prompt import pair_tokens

    path = write_qwen3_reranker(tmp_path / "tiny-reranker")
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "The capital of France is Paris."]
    with serve(load_hf_dir(path), EngineConfig(parallel=4, dtype="float32", reranking=True)) as served:
        reply = httpx.post(f"{served.url}/v1/rerank", json={"query": "capital of France?", "documents": documents,
                                                            "top_n": 2})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
        scores = httpx.post(f"{served.url}/v1/score", json={"text_1": "capital of France?", "text_2": documents})
        by_index = [d["score"] for d in scores.json()["data"]]
        assert {r["index"]: r["relevance_score"] for r in results} == {r["index"]: by_index[r["index"]]
                                                                      for r in results}
        # transformers' reading of the same prompt: P(yes) over {yes, no} at the last position
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        tokenizer = served.core.tokenizer
        yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        for i, document in enumerate(documents):
            ids, _ = pair_tokens(served.core.tokenizer, served.core.pooling, "capital of France?", document)
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1]
            expected = torch.sigmoid(logits[yes] - logits[no]).item()
            assert abs(by_index[i] - expected) < 1e-4
        embeddings = httpx.post(f"{served.url}/v1/embeddings", json={"input": "x"})
        assert embeddings.status_code == 400


def test_rerank_on_a_bert_cross_encoder(tmp_path):
    """A cross-encoder's /v1/rerank: each (query, document) pair with its second text as token type 1, scored as
    transformers' BertForSequenceClassification scores it; Cohere's {"text": ...} documents accepted."""
    transformers = pytest.importorskip("transformers")
    from tests.pooling_models import write_encoder

    path = write_encoder(tmp_path / "tiny-cross-encoder", "bert", classifier=True)
    documents = ["paris is the capital of france.", {"text": "a dog"}, "the fox"]
    with serve(load_hf_dir(path), EngineConfig(parallel=4, dtype="float32")) as served:
        reply = httpx.post(f"{served.url}/v1/rerank", json={"query": "capital of france", "documents": documents})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
        backend = served.core.tokenizer.backend
        for result in results:
            document = documents[result["index"]]
            encoding = backend.encode("capital of france", pair=document if isinstance(document, str)
                                      else document["text"])
            with torch.no_grad():
                logit = hf(input_ids=torch.tensor([encoding.ids]),
                           token_type_ids=torch.tensor([encoding.type_ids])).logits[0, 0]
            assert abs(result["relevance_score"] - torch.sigmoid(logit).item()) < 1e-5
        assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
        served.wait_until(lambda: served.engine.num_in_flight == 0, what="requests to finish")
        served.core.kv.check_integrity()


def test_rerank_on_a_modernbert_cross_encoder(tmp_path):
    """gte-reranker-modernbert's shape: ModernBertForSequenceClassification pooling the mean of every row. /v1/rerank
    and /v1/score give transformers' sigmoid(logit) for each pair (its tokenizer's type-1 second text read as type 0,
    as transformers' ModernBERT takes no token types)."""
    transformers = pytest.importorskip("transformers")
    from tests.pooling_models import write_encoder

    path = write_encoder(tmp_path / "tiny-modernbert-reranker", "modernbert", classifier=True,
                         classifier_pooling="mean")
    query, documents = "capital of france", ["paris is the capital of france.", {"text": "a dog"}, "the fox"]
    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    with serve(load_hf_dir(path), EngineConfig(parallel=4, dtype="float32")) as served:
        reply = httpx.post(f"{served.url}/v1/rerank", json={"query": query, "documents": documents})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        scores = httpx.post(f"{served.url}/v1/score", json={"text_1": query, "text_2": texts})
        assert scores.status_code == 200, scores.text
        by_index = [d["score"] for d in scores.json()["data"]]
        assert {r["index"]: r["relevance_score"] for r in results} == dict(enumerate(by_index))
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
        backend = served.core.tokenizer.backend
        for i, text in enumerate(texts):
            with torch.no_grad():
                logit = hf(input_ids=torch.tensor([backend.encode(query, pair=text).ids])).logits[0, 0]
            assert abs(by_index[i] - torch.sigmoid(logit).item()) < 1e-5
        assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
        served.wait_until(lambda: served.engine.num_in_flight == 0, what="requests to finish")
        served.core.kv.check_integrity()


def test_the_dashboard_names_the_task(embedder, tiny):
    assert httpx.get(f"{embedder.url}/v1/dashboard").json()["task"] == "embedding"
    with serve(tiny) as served:
        assert httpx.get(f"{served.url}/v1/dashboard").json()["task"] == "generation"
