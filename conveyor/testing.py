"""Tiny random-weight checkpoints for tests and examples (no downloads, built in milliseconds).

They reuse the bundled SmolLM2 tokenizer so prompts, chat templates and detokenization are real.
"""

from __future__ import annotations

from functools import lru_cache

import gguf
import torch

from conveyor.loading import Checkpoint, Tokenizer, default_model_path
from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
from conveyor.models.config import ModelConfig


@lru_cache(maxsize=1)
def smollm_tokenizer() -> Tokenizer:
    path = default_model_path()
    return tokenizer_from_gguf(gguf.GGUFReader(path), path)


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, tie_word_embeddings=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """HF-named random weights; a large scale keeps logits spread out so greedy text varies."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h) * 5,
               "model.norm.weight": 1 + rand(h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
        })
    return weights


def tiny_checkpoint(seed: int = 0, **overrides) -> Checkpoint:
    tokenizer = smollm_tokenizer()
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids), **overrides)
    return Checkpoint(config=config, weights=random_weights(config, seed), tokenizer=tokenizer,
                      source="<tiny random>", name="tiny-random-llama")


def write_tiny_model_dir(path, seed: int = 0, **overrides) -> str:
    """The tiny random model as a Hugging Face directory, for tests that start real server processes."""
    import json
    import os

    from safetensors.torch import save_file

    checkpoint = tiny_checkpoint(seed, **overrides)
    cfg, tokenizer = checkpoint.config, checkpoint.tokenizer
    os.makedirs(path, exist_ok=True)
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
                 "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                 "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                 "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                 "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
                 "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
                 "eos_token_id": list(cfg.eos_token_ids)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    save_file({k: v.contiguous() for k, v in checkpoint.weights.items()}, os.path.join(path, "model.safetensors"))
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    settings = {"chat_template": tokenizer.chat_template, **tokenizer.special_tokens}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return str(path)
