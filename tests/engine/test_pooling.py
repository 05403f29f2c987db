"""Pooling requests (embeddings, reranker scores) through the engine: a tiny random Qwen3 embedder saved as
sentence-transformers saves Qwen3-Embedding, checked against sentence-transformers itself, and a text's vector
bitwise the same alone or in a batch of 32."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.errors import InvalidRequestError
from conveyor.testing import tiny_checkpoint
from tests.pooling_models import write_qwen3_embedder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings turn text into vectors.",
         "A", "Continuous batching keeps every slot busy, tick after tick, while requests come and go."]


def sentence_transformers_vectors(path: str, texts: list[str]) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(path, device="cpu")
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True, batch_size=len(texts)))


@pytest.mark.parametrize("pooling,dense", [("lasttoken", False), ("mean_tokens", True), ("cls_token", False)])
def test_vectors_match_sentence_transformers(tmp_path, pooling, dense):
    path = write_qwen3_embedder(tmp_path / "embedder", pooling=pooling, dense=dense)
    llm = LLM(model=path, dtype="float32")
    assert llm.engine.pooling_task == "embedding"
    ours = torch.tensor(llm.embed(TEXTS))
    expected = sentence_transformers_vectors(path, TEXTS)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # the Normalize module
    llm.engine.kv.check_integrity()  # every block back


def test_vector_alone_equals_vector_in_a_batch_of_32(tmp_path):
    path = write_qwen3_embedder(tmp_path / "embedder")
    llm = LLM(model=path)  # bf16, the serving default
    texts = [f"text number {i}: " + "lorem ipsum " * (i % 7) for i in range(32)]
    batched = llm.embed(texts)
    for i in (0, 5, 31):
        assert llm.embed(texts[i]) == [batched[i]]  # bitwise: the same floats
    llm.engine.kv.check_integrity()


def test_long_input_is_chunked_for_last_token_pooling(tmp_path):
    """A causal last-token embedder may prefill a long text in chunks: the same vector as one forward."""
    path = write_qwen3_embedder(tmp_path / "embedder")
    text = "chunked prefill " * 40
    whole = LLM(model=path, prefill_chunk_size=0).embed(text)
    chunked = LLM(model=path, prefill_chunk_size=16).embed(text)
    assert whole == chunked


def test_generating_model_refuses_embeddings_and_embedder_refuses_completions(tmp_path):
    from conveyor.engine.sampling_params import SamplingParams

    generating = LLM(checkpoint=tiny_checkpoint())
    with pytest.raises(InvalidRequestError, match="--embeddings"):
        generating.engine.make_pooling_request([1, 2, 3])
    embedder = LLM(model=write_qwen3_embedder(tmp_path / "embedder"))
    with pytest.raises(InvalidRequestError, match="embedding model"):
        embedder.engine.make_request([1, 2, 3], SamplingParams())


def test_embeddings_flag_pools_a_generating_model():
    """llama-server's --embeddings: a generating model's last-token hidden state, normalised."""
    llm = LLM(checkpoint=tiny_checkpoint(), embeddings=True, dtype="float32")
    (vector,) = llm.embed("hello there")
    assert len(vector) == 64 and abs(torch.tensor(vector).norm().item() - 1) < 1e-5
    mean = LLM(checkpoint=tiny_checkpoint(), embeddings=True, pooling="mean", dtype="float32").embed("hello there")
    assert mean[0] != vector


def test_gguf_pooling_type_makes_an_embedder(tmp_path):
    """A GGUF with llama.cpp's `{arch}.pooling_type` pools by itself; the same weights without it need --embeddings."""
    import gguf

    from conveyor.loading.checkpoint import LoadError
    from conveyor.testing import write_tiny_gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    declared = LLM(model=write_tiny_gguf(tmp_path / "mean.gguf", q8, pooling_type=1))
    assert declared.engine.pooling_task == "embedding" and declared.engine.pooling.pooling == "mean"
    flagged = LLM(model=write_tiny_gguf(tmp_path / "plain.gguf", q8), embeddings=True, pooling="mean")
    assert declared.embed("hello, world") == flagged.embed("hello, world")
    with pytest.raises(LoadError, match="pooling_type"):
        LLM(model=write_tiny_gguf(tmp_path / "bad.gguf", q8, pooling_type=9))


# (the third is longer than ModernBERT's tiny local window)
ENCODER_TEXTS = ["the capital of france is paris.", "a fox and a dog", "vectors of text, 42 of them!", "x"]


@pytest.mark.parametrize("kind,pooling", [("bert", "mean_tokens"), ("xlm-roberta", "cls_token"),
                                          ("modernbert", "mean_tokens"), ("nomic_bert", "mean_tokens")])
def test_encoders_match_sentence_transformers(tmp_path, kind, pooling):
    """BERT with mean pooling (all-MiniLM's recipe) and XLM-R with CLS pooling (BGE's), bidirectional on our
    kernels, against sentence-transformers' encode; bitwise alone vs batched."""
    from tests.pooling_models import write_encoder

    path = write_encoder(tmp_path / kind, kind, pooling)
    llm = LLM(model=path, dtype="float32")
    ours = torch.tensor(llm.embed(ENCODER_TEXTS))
    torch.testing.assert_close(ours, sentence_transformers_vectors(path, ENCODER_TEXTS), atol=2e-5, rtol=1e-4)
    assert llm.embed(ENCODER_TEXTS[0]) == [ours[0].tolist()]
    llm.engine.kv.check_integrity()  # nothing cached: every block back


@pytest.mark.parametrize("kind,classifier_pooling", [("xlm-roberta", "cls"), ("bert", "cls"), ("modernbert", "cls"),
                                                     ("modernbert", "mean")])
def test_cross_encoder_scores_match_transformers(tmp_path, kind, classifier_pooling):
    """Cross-encoders score (query, document) pairs as transformers does: bge-reranker's XLM-R head, a BERT
    (ms-marco MiniLM's head on the pooler) whose second text is token type 1, and ModernBERT's head on the first row
    or the mean of all (gte-reranker-modernbert; no token types: its tokenizer's type 1 is dropped)."""
    transformers = pytest.importorskip("transformers")
    from tests.pooling_models import write_encoder

    path = write_encoder(tmp_path / "reranker", kind, classifier=True, classifier_pooling=classifier_pooling)
    llm = LLM(model=path, dtype="float32")
    assert llm.engine.pooling_task == "reranking" and llm.engine.pooling.pooling == classifier_pooling
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    query, documents = "capital of france", ["paris is the capital of france.", "a dog", "the fox"]
    ours = llm.score(query, documents)
    for score, document in zip(ours, documents):
        encoding = llm.tokenizer.backend.encode(query, pair=document)
        types = {} if kind == "modernbert" else {"token_type_ids": torch.tensor([encoding.type_ids])}
        with torch.no_grad():
            logit = hf(input_ids=torch.tensor([encoding.ids]), **types).logits[0, 0]
        assert abs(score - torch.sigmoid(logit).item()) < 1e-5
    assert llm.score(query, documents[:1]) == ours[:1]  # alone or with others: bitwise
    if kind == "bert":  # the types matter: all type 0 scores differently
        encoding = llm.tokenizer.backend.encode(query, pair=documents[0])
        assert llm.embed([encoding.ids])[0][0] != ours[0]


def test_pooling_engines_take_bf16_weights_on_amx_only():
    """Prefill-only engines run GGUF blocks as bf16 where the AMX tile GEMM is the faster path; elsewhere, and
    for generating models or an explicit --weight-dtype, the blocks stay."""
    from conveyor.config import EngineConfig
    from conveyor.engine.pooling_setup import pooling_weight_dtype
    from conveyor.models.pooling import PoolingConfig

    embedder, generator = tiny_checkpoint(), tiny_checkpoint()
    embedder.pooling = PoolingConfig()
    assert pooling_weight_dtype(EngineConfig(), embedder, "amx") == "bf16"
    assert pooling_weight_dtype(EngineConfig(), embedder, "avx512_bf16") == "auto"
    assert pooling_weight_dtype(EngineConfig(weight_dtype="q8_0"), embedder, "amx") == "q8_0"
    assert pooling_weight_dtype(EngineConfig(dtype="float32"), embedder, "amx") == "auto"
    assert pooling_weight_dtype(EngineConfig(), generator, "amx") == "auto"
    assert pooling_weight_dtype(EngineConfig(embeddings=True), generator, "amx") == "bf16"
