"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Inputs are flattened across sequences ("varlen"): T token rows from any mix of prefill
chunks and decode steps run through one forward; only attention looks at sequence
boundaries, through AttentionMetadata.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.loading.checkpoint import Weight
from conveyor.models.config import ModelConfig
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.weights import WeightLoader

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, kv_heads, head_dim) each


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one GEMM at load time.
        self.qkv_proj = RowInvariantLinear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, ops)
        self.o_proj = RowInvariantLinear(self.q_size, config.hidden_size, bias=False, ops=ops)
        # QK-norm per head (Qwen3) or over the whole q / k projection (OLMoE).
        self.full_qk_norm = config.qk_norm and config.qk_norm_scope == "full"
        q_dim, k_dim = (self.q_size, self.kv_size) if self.full_qk_norm else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.window = config.sliding_window or 0

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.ops.fuses_rope and self.q_norm is None:  # rotary + cache write fused into one pass
            q = self.ops.rope_write_kv(qkv, rope[0].squeeze(1), rope[1].squeeze(1), kv_cache[0], kv_cache[1],
                                      meta.slot_mapping, self.num_heads)
            out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.window)  # (T, H, D)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.full_qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # (T, H + KVH, D)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k sit side by side in the fused output, so one rotary pass covers both.
        qk = RotaryEmbedding.apply(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        self.ops.write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.window)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = RowInvariantLinear(config.hidden_size, 2 * config.intermediate_size, bias=False, ops=ops)
        self.down_proj = RowInvariantLinear(config.intermediate_size, config.hidden_size, bias=False, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's MLP output, residual stream) -> (this layer's MLP output, residual stream).

        Each residual add is fused into the norm after it (vLLM's scheme); the first layer
        gets the embeddings as `delta` and no residual yet.
        """
        if residual is None:
            residual, h = delta, self.input_layernorm(delta)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, delta)
        attn_out = self.self_attn(h, rope, kv_cache, meta)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, attn_out)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        # A meta placeholder (no memory, no init): loading puts an nn.Embedding or a QuantizedEmbedding here.
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, _freeze=True,
                                                    _weight=torch.empty(config.vocab_size, config.hidden_size,
                                                                        device="meta"))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False, ops=ops)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> float32 logits (len(logits_indices), vocab)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        rope = self.rotary.tables(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        # Only rows that sample need the last add, the final norm and the head.
        _, x = self.norm.add_and_norm(residual[logits_indices], x[logits_indices])
        return self.lm_head(x).float()

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """Fill the model from HF-named tensors (built on the meta device), fusing q/k/v and gate/up.

        One tensor at a time: the loader converts each (blocks kept, packed or dequantized) and releases it.
        """
        cfg = self.config

        def get(name: str) -> Weight:
            if name not in weights:
                raise KeyError(f"checkpoint is missing tensor {name}")
            return weights[name]

        self.embed_tokens = loader.embedding(get("model.embed_tokens.weight"))
        self.norm.weight = loader.param(get("model.norm.weight"))
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.embed_tokens = loader.tie(self.lm_head, self.embed_tokens)
        else:
            loader.linear(self.lm_head, [get("lm_head.weight")])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            bias = [get(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if cfg.attention_bias else None
            loader.linear(attn.qkv_proj, [get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], bias)
            loader.linear(attn.o_proj, [get(p + "self_attn.o_proj.weight")])
            if cfg.qk_norm:
                attn.q_norm.weight = loader.param(get(p + "self_attn.q_norm.weight"))
                attn.k_norm.weight = loader.param(get(p + "self_attn.k_norm.weight"))
            self._load_mlp(layer.mlp, get, p, loader)
            layer.input_layernorm.weight = loader.param(get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight = loader.param(get(p + "post_attention_layernorm.weight"))

    def _load_mlp(self, mlp: nn.Module, get: Callable[[str], Weight], prefix: str, loader: WeightLoader) -> None:
        """One layer's MLP from HF names under `prefix` (`model.layers.N.`); MoE families load experts here."""
        loader.linear(mlp.gate_up_proj, [get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")])
        loader.linear(mlp.down_proj, [get(prefix + "mlp.down_proj.weight")])
