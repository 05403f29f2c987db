"""Pooling requests (embeddings, reranker scores) through the engine: a tiny random Qwen3 embedder saved as
sentence-transformers saves Qwen3-Embedding, checked against sentence-transformers itself, and a text's vector
bitwise the same alone or in a batch of 32."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.errors import InvalidRequestError
from conveyor.testing import smollm_tokenizer, tiny_checkpoint

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings turn text into vectors.",
         "A", "Continuous batching keeps every slot busy, tick after tick, while requests come and go."]


def write_qwen3_embedder(path, pooling: str = "lasttoken", normalize: bool = True, dense: bool = False) -> str:
    """A tiny random Qwen3 saved as transformers' Qwen3Model (no head, no `model.` prefix, as Qwen3-Embedding
    ships), with sentence-transformers' modules.json, pooling config and prompts."""
    transformers = pytest.importorskip("transformers")
    tokenizer = smollm_tokenizer()
    config = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config)
    with torch.no_grad():  # random weights large enough that texts differ visibly
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path)
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "model_max_length": 512}, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}, f)
    if dense:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(path, "2_Dense"))
        with open(os.path.join(path, "2_Dense", "config.json"), "w") as f:
            json.dump({"in_features": 64, "out_features": 32, "bias": True,
                       "activation_function": "torch.nn.modules.activation.Tanh"}, f)
        gen = torch.Generator().manual_seed(1)
        save_file({"linear.weight": torch.randn(32, 64, generator=gen) * 0.2,
                   "linear.bias": torch.randn(32, generator=gen) * 0.2},
                  os.path.join(path, "2_Dense", "model.safetensors"))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
        json.dump({"prompts": {"query": "Instruct: find the passage\nQuery:", "document": ""},
                   "default_prompt_name": None, "similarity_fn_name": "cosine"}, f)
    return str(path)


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
