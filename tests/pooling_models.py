"""Tiny pooling checkpoints for tests, written as the Hub ships them (transformers is the test oracle, so
these live beside the tests, not in conveyor.testing)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conveyor.testing import smollm_tokenizer


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


def write_qwen3_reranker(path) -> str:
    """A tiny random Qwen3ForCausalLM as Qwen3-Reranker ships (a causal LM read by its "yes" / "no" logits)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = smollm_tokenizer()
    config = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path)
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    return str(path)
