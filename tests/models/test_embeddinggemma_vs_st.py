"""EmbeddingGemma (google/embeddinggemma-300m's recipe on a tiny random checkpoint): Gemma 3 run bidirectionally, its
sliding layers a band of +-sliding_window // 2, then mean pooling, two Dense layers and Normalize. Checked against
sentence-transformers' encode, a text alone against the same text in a batch (bitwise), and a GGUF as llama.cpp's
converter writes it (`gemma-embedding`, --sentence-transformers-dense-modules) against the directory."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conveyor.engine.llm import LLM
from tests.pooling_models import write_embeddinggemma

# The first three run past the tiny window (8 tokens: +-4) many times over; "A" is one token.
TEXTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the green hills.",
         "Embeddings turn text into vectors: every token sees its neighbours on both sides.",
         "Continuous batching keeps every slot busy, tick after tick, while requests come and go.", "A"]


def _sentence_transformer(path: str):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(path, device="cpu")


def _encode(model, texts: list[str], **kwargs) -> torch.Tensor:
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True, batch_size=len(texts), **kwargs))


@pytest.mark.parametrize("window", [8, 7])  # (an odd window: transformers' and llama.cpp's halves round down)
def test_vectors_match_sentence_transformers(tmp_path, window):
    path = write_embeddinggemma(tmp_path / "embeddinggemma", sliding_window=window)
    llm = LLM(model=path, dtype="float32")
    config, pooling = llm.engine.model_config, llm.engine.pooling
    assert config.bidirectional and config.sliding_window == window // 2
    assert pooling.pooling == "mean" and pooling.normalize and pooling.dimensions == 64 and len(pooling.dense) == 2
    reference = _sentence_transformer(path)
    ours = torch.tensor(llm.embed(TEXTS))
    torch.testing.assert_close(ours, _encode(reference, TEXTS), atol=2e-5, rtol=1e-4)
    # a named prompt is its text in front (include_prompt: the mean takes its tokens too)
    query = pooling.prompts["query"]
    torch.testing.assert_close(torch.tensor(llm.embed([query + TEXTS[0]])),
                               _encode(reference, TEXTS[:1], prompt_name="query"), atol=2e-5, rtol=1e-4)
    llm.engine.kv.check_integrity()  # nothing cached: every block back


def test_directory_saved_by_sentence_transformers_loads(tmp_path):
    """sentence-transformers >= 5 saves each module under its own module path (base.modules.dense.Dense, ...)."""
    reference = _sentence_transformer(write_embeddinggemma(tmp_path / "hub"))
    reference.save(str(tmp_path / "resaved"))
    with open(tmp_path / "resaved" / "modules.json") as f:
        assert any(not m["type"].startswith("sentence_transformers.models.") for m in json.load(f))
    ours = torch.tensor(LLM(model=str(tmp_path / "resaved"), dtype="float32").embed(TEXTS))
    torch.testing.assert_close(ours, _encode(reference, TEXTS), atol=2e-5, rtol=1e-4)


def test_vector_alone_equals_vector_in_a_batch(tmp_path):
    path = write_embeddinggemma(tmp_path / "embeddinggemma")
    llm = LLM(model=path)  # bf16, the serving default
    texts = [f"text number {i}: " + "lorem ipsum " * (i % 7) for i in range(32)]
    batched = llm.embed(texts)
    for i in (0, 5, 31):
        assert llm.embed(texts[i]) == [batched[i]]  # bitwise: the same floats
    # a text past the prefill chunk still runs whole, in one forward
    assert LLM(model=path, prefill_chunk_size=16).embed(texts[6]) == [batched[6]]
    llm.engine.kv.check_integrity()


def test_gguf_matches_the_directory(tmp_path):
    hf_dir = write_embeddinggemma(tmp_path / "embeddinggemma")
    from_hf = LLM(model=hf_dir, dtype="float32")
    from_gguf = LLM(model=write_embeddinggemma_gguf(tmp_path / "embeddinggemma-f32.gguf", hf_dir), dtype="float32")
    config = from_gguf.engine.model_config
    assert config.architecture == "gemma3_text" and config.bidirectional and config.sliding_window == 4
    assert config.layer_types == from_hf.engine.model_config.layer_types  # five sliding, then one global
    pooling = from_gguf.engine.pooling
    assert pooling.pooling == "mean" and pooling.normalize
    assert [tuple(d.weight.shape) for d in pooling.dense] == [(128, 64), (64, 128)]
    for text in TEXTS:
        assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    torch.testing.assert_close(torch.tensor(from_gguf.embed(TEXTS)), torch.tensor(from_hf.embed(TEXTS)),
                               atol=1e-6, rtol=1e-5)


def test_gguf_dense_layers_in_blocks_are_dequantized(tmp_path):
    """A file quantized whole (--outtype q8_0) has its Dense layers in blocks too: read back as llama.cpp reads them."""
    gguf = pytest.importorskip("gguf")
    from conveyor.loading.gguf_loader import load_gguf

    hf_dir = write_embeddinggemma(tmp_path / "embeddinggemma")
    q8 = gguf.GGMLQuantizationType.Q8_0
    checkpoint = load_gguf(write_embeddinggemma_gguf(tmp_path / "dense-q8_0.gguf", hf_dir, dense_type=q8))
    for spec, folder in zip(checkpoint.pooling.dense, ("2_Dense", "3_Dense"), strict=True):
        weight = load_file(os.path.join(hf_dir, folder, "model.safetensors"))["linear.weight"].numpy()
        expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, q8), q8))
        assert spec.bias is None and spec.activation == "identity" and torch.equal(spec.weight, expected)


def write_embeddinggemma_gguf(path, hf_dir: str, dense_type=None) -> str:
    """`hf_dir` (write_embeddinggemma's) as convert_hf_to_gguf's EmbeddingGemma writes it with
    --sentence-transformers-dense-modules, in F32: arch `gemma-embedding`, config.json's own sliding_window (the whole
    window; no pattern: llama.cpp assumes Gemma's every sixth layer global), both rope bases, norms stored as 1 + w,
    2_Dense and 3_Dense as `dense_2` / `dense_3` with their features (in `dense_type` blocks if given), the pooling
    type, and the directory's byte-level vocabulary (pre-tokenizer `smollm`). Checked once against the vendored
    convert_hf_to_gguf.py on the same directory: the same tensors to the byte, the same keys but general.*."""
    gguf = pytest.importorskip("gguf")
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), "gemma-embedding")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    _add_vocab(writer, hf_dir, cfg["bos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA_EMBEDDING, cfg["num_hidden_layers"])
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        base, _, suffix = f"model.{name}".rpartition(".")
        if name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma3RMSNorm's (1 + w)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    for folder, dense in (("2_Dense", "dense_2"), ("3_Dense", "dense_3")):
        weight = load_file(os.path.join(hf_dir, folder, "model.safetensors"))["linear.weight"]  # (out, in)
        writer.add_dense_features_dims(dense, weight.shape[1], weight.shape[0])
        if dense_type is None:
            writer.add_tensor(f"{dense}.weight", weight.float().numpy())
        else:
            writer.add_tensor(f"{dense}.weight", gguf.quants.quantize(weight.float().numpy(), dense_type),
                              raw_dtype=dense_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _add_vocab(writer, hf_dir: str, bos: int) -> None:
    """TextModel._set_vocab_gpt2: the tokens in id order, the added special ones CONTROL, the merges."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        data = json.load(f)
    special = {t["content"]: t["id"] for t in data["added_tokens"] if t.get("special")}
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        eos = json.load(f)["eos_token"]
    writer.add_eos_token_id(vocab[eos])
    writer.add_pad_token_id(vocab[eos])
    writer.add_bos_token_id(bos)  # (gguf-py's SpecialVocab takes config.json's)
