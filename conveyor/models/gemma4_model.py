"""Gemma 4 (text) over the paged KV cache: the shared decoder's pieces (row-invariant linears, fused RMSNorms,
GeGLU, paged attention, and for 26B-A4B the MoE block) arranged as Gemma 4 arranges them (what differs from
Gemma 3: models/gemma4.py).

K/V sharing: a layer that reads an earlier layer's K/V has no cache of its own; cache_specs() lists only the
layers that compute K/V, and each reader attends over its source's cache (written earlier in the same forward).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models import family as families
from conveyor.models.config import ModelConfig
from conveyor.models.gemma4 import MOE_NORMS, shares_k_as_v
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.llama import KVCache, LlamaMLP, Rope
from conveyor.models.moe import SparseMoeBlock
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, load_ends, tensor_getters


def meta_embedding(rows: int, width: int) -> nn.Embedding:
    """A placeholder (no memory): loading puts an nn.Embedding or a QuantizedEmbedding here."""
    return nn.Embedding(rows, width, _freeze=True, _weight=torch.empty(rows, width, device="meta"))


def ones_param(size: int, loader: WeightLoader) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, dtype=loader.dtype, device=loader.device), requires_grad=False)


class Gemma4Attention(nn.Module):
    """q (and, where the layer owns its K/V, k and v) RMS-normed per head, rotary on q and k, softmax scale 1."""

    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = config.num_attention_heads, config.layer_head_dim(layer)
        self.num_kv_heads = config.layer_num_kv_heads(layer)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.owns_kv = config.kv_source(layer) == layer
        self.k_as_v = shares_k_as_v(config, layer)
        kv_out = 0 if not self.owns_kv else self.kv_size * (1 if self.k_as_v else 2)
        self.qkv_proj = RowInvariantLinear(config.hidden_size, self.q_size + kv_out, False, ops)
        self.o_proj = RowInvariantLinear(self.q_size, config.hidden_size, False, ops)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, ops)
        self.k_norm = RMSNorm(self.head_dim, eps, ops) if self.owns_kv else None
        # v's norm has no weight: one of ones, set at load in the model dtype
        self.v_norm = RMSNorm(self.head_dim, eps, ops) if self.owns_kv and config.v_norm else None
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim ** -0.5
        self.window = config.window(layer)
        self.softcap = config.attn_logit_softcapping or 0.0

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.for_window(self.window)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        q = RotaryEmbedding.apply(self.q_norm(q), *rope)
        if self.owns_kv:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = k if self.k_as_v else qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads,
                                                                              self.head_dim)  # (T, KVH, D)
            if self.v_norm is not None:
                v = self.v_norm(v)
            k = RotaryEmbedding.apply(self.k_norm(k), *rope)
            self.ops.write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.window,
                                       self.softcap)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class PerLayerInputs(nn.Module):
    """Per-layer embeddings (PLE): each token's row of a (vocab, layers x P) table times sqrt(P), plus the
    embeddings projected to layers x P (times hidden^-0.5, RMS-normed per layer), the sum times 1/sqrt(2).
    Every step is per row. `round_scales`: the two scales rounded to the compute dtype first (Gemma 3n's buffers)."""

    def __init__(self, config: ModelConfig, ops: KernelBackend, round_scales: bool = False) -> None:
        super().__init__()
        self.num_layers, self.width = config.num_hidden_layers, config.hidden_size_per_layer_input
        self.vocab_size, self.hidden_size = config.vocab_size_per_layer_input, config.hidden_size
        self.round_scales = round_scales
        self.embed = meta_embedding(self.vocab_size, self.num_layers * self.width)
        self.projection = RowInvariantLinear(config.hidden_size, self.num_layers * self.width, False, ops)
        self.norm = RMSNorm(self.width, config.rms_norm_eps, ops)

    def load(self, loader: WeightLoader, get, norm) -> None:
        self.embed = loader.embedding(get("model.embed_tokens_per_layer.weight"))
        loader.linear(self.projection, [get("model.per_layer_model_projection.weight")])
        self.norm.weight = norm("model.per_layer_projection_norm.weight")

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(T,) ids and (T, hidden) scaled embeddings -> (T, layers, P)."""
        shape, dtype = (input_ids.shape[0], self.num_layers, self.width), embeds.dtype
        # ids past the table (Gemma 3n's multimodal tokens) read row 0, as transformers does
        tokens = self.embed(torch.where(input_ids < self.vocab_size, input_ids, 0)).to(dtype)
        # NOTE: the scale rounded to the dtype first, as transformers' scaled embedding does
        tokens = (tokens * torch.tensor(self.width ** 0.5, dtype=dtype)).reshape(shape)
        projected = self.projection(embeds) * self._scale(self.hidden_size ** -0.5, dtype)
        projected = self.norm(projected.reshape(shape))
        return (projected + tokens) * self._scale(2.0 ** -0.5, dtype)

    def _scale(self, value: float, dtype: torch.dtype) -> float | torch.Tensor:
        return torch.tensor(value, dtype=torch.float32).to(dtype) if self.round_scales else value


class Gemma4Experts(nn.Module):
    """26B-A4B's experts beside the dense MLP: the router reads the layer's input RMS-normed (no weight) times a
    learnt per-channel scale and hidden^-0.5; the experts read it through their own norm. Routing, the per-expert
    weight scale and the batch-invariant expert sum are models/moe.py's."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.root_size = config.hidden_size ** -0.5
        self.router_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)  # weight of ones, set at load
        self.router_scale = nn.Parameter(torch.empty(config.hidden_size, device="meta"), requires_grad=False)
        self.block = SparseMoeBlock(config, ops)

    def forward(self, x: torch.Tensor, expert_input: torch.Tensor) -> torch.Tensor:
        return self.block(expert_input, router_input=self.router_norm(x) * self.router_scale * self.root_size)

    def load(self, get, prefix: str, loader: WeightLoader) -> None:
        self.router_norm.weight = ones_param(self.router_scale.shape[0], loader)
        self.router_scale = loader.param(get(prefix + "moe.router.scale"))
        self.block.load(get, prefix, families.expert_names("gemma4_text"), loader)
        self.block.expert_scale = loader.dense(get(prefix + "moe.router.per_expert_scale"))


def load_attention_mlp_norms(layer: nn.Module, p: str, get: Callable[[str], Weight],
                             norm: Callable[[str], nn.Parameter], loader: WeightLoader) -> None:
    """What Gemma 4's and Gemma 3n's decoder layers load alike: the attention (q, plus k and v where the layer
    owns its K/V; no v_proj where v is k), the GeGLU MLP and the layer's norms."""
    attn = layer.self_attn
    parts = "q" + ("" if not attn.owns_kv else "k" if attn.k_as_v else "kv")
    loader.linear(attn.qkv_proj, [get(f"{p}self_attn.{n}_proj.weight") for n in parts])
    loader.linear(attn.o_proj, [get(p + "self_attn.o_proj.weight")])
    attn.q_norm.weight = norm(p + "self_attn.q_norm.weight")
    if attn.owns_kv:
        attn.k_norm.weight = norm(p + "self_attn.k_norm.weight")
    if attn.v_norm is not None:
        attn.v_norm.weight = ones_param(attn.head_dim, loader)
    loader.linear(layer.mlp.gate_up_proj, [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    loader.linear(layer.mlp.down_proj, [get(p + "mlp.down_proj.weight")])
    for name in layer.norm_names:
        getattr(layer, name).weight = norm(p + name + ".weight")


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = Gemma4Attention(config, ops, layer)
        self.mlp = LlamaMLP(replace(config, intermediate_size=config.layer_intermediate_size(layer),
                                    layer_intermediate_sizes=()), ops)
        self.moe = Gemma4Experts(config, ops) if config.num_experts else None
        self.norm_names = config.layer_norm_names + (MOE_NORMS if self.moe is not None else ())
        for name in self.norm_names:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, ops))
        self.layer_scalar = nn.Parameter(torch.empty(1, device="meta"), requires_grad=False)
        width = config.hidden_size_per_layer_input
        self.per_layer_input_gate = RowInvariantLinear(config.hidden_size, width, False, ops) if width else None
        self.per_layer_projection = RowInvariantLinear(width, config.hidden_size, False, ops) if width else None
        self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops) if width else None

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, rope: Rope, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """The hidden stream in and out (T, hidden): the layer scalar scales all of it, so no residual is held back."""
        attn_out = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(attn_out))
        mlp_out = self.mlp(h)
        if self.moe is not None:  # 26B-A4B: the dense MLP and the experts side by side, each normed, then summed
            experts = self.moe(x, self.pre_feedforward_layernorm_2(x))
            mlp_out = self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(experts)
        x = x + self.post_feedforward_layernorm(mlp_out)
        if per_layer_input is not None:  # PLE: gelu(gate(x)) * this layer's input, projected back, normed
            gated = self.ops.gelu_tanh_mul(torch.cat([self.per_layer_input_gate(x), per_layer_input], dim=-1))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.embed_tokens: nn.Module = meta_embedding(config.vocab_size, config.hidden_size)
        self.per_layer_inputs = PerLayerInputs(config, ops) if config.hidden_size_per_layer_input else None
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False, ops=ops)
        # One rotary table per (head dim, kind): global layers rotate with rope_theta (+ proportional scaling),
        # sliding ones with their own base, unscaled.
        self.rope_keys = [self._rope_key(i) for i in range(config.num_hidden_layers)]
        self.rotaries = nn.ModuleDict({key: self._rotary(key) for key in dict.fromkeys(self.rope_keys)})
        # The layers that own K/V get the caches, in layer order; a reader attends over its source's.
        owners = [i for i in range(config.num_hidden_layers) if config.kv_source(i) == i]
        self.cache_index = [owners.index(config.kv_source(i)) for i in range(config.num_hidden_layers)]

    def _rope_key(self, layer: int) -> str:
        cfg = self.config
        sliding = cfg.local_rope_theta is not None and cfg.is_sliding(layer)
        return f"{'sliding' if sliding else 'full'}_{cfg.layer_head_dim(layer)}"

    def _rotary(self, key: str) -> RotaryEmbedding:
        kind, dim = key.split("_")
        cfg = self.config
        if kind == "sliding":
            return RotaryEmbedding(int(dim), cfg.max_position_embeddings, cfg.local_rope_theta, None)
        return RotaryEmbedding(int(dim), cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> float32 logits (len(logits_indices), vocab)."""
        cfg = self.config
        x = self.embed_tokens(input_ids)  # (T, hidden)
        # NOTE: rounded to the compute dtype first, as transformers' Gemma does
        x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_inputs is not None else None  # (T, L, P)
        ropes = {key: rotary.tables(positions, x.dtype) for key, rotary in self.rotaries.items()}
        for i, layer in enumerate(self.layers):
            x = layer(x, per_layer[:, i] if per_layer is not None else None, ropes[self.rope_keys[i]],
                      kv_caches[self.cache_index[i]], meta)
        logits = self.lm_head(self.norm(x[logits_indices])).float()
        if cfg.final_logit_softcapping:
            logits = self.ops.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def cache_specs(self) -> list[CacheSpec]:
        """K/V in the block pool for the layers that compute it; the K/V-sharing layers keep nothing."""
        cfg = self.config
        return [KVSpec(cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i), cfg.window(i))
                for i in range(cfg.num_hidden_layers) if cfg.kv_source(i) == i]

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """HF-named tensors (models/gemma4.py weight_names), one at a time; q|k|v and gate|up fused."""
        cfg = self.config
        get, norm = tensor_getters(weights, loader, cfg.norm_weight_offset)
        load_ends(self, weights, loader, get, norm)
        if self.per_layer_inputs is not None:
            self.per_layer_inputs.load(loader, get, norm)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            load_attention_mlp_norms(layer, p, get, norm, loader)
            layer.layer_scalar = loader.param(get(p + "layer_scalar"))
            if layer.moe is not None:
                layer.moe.load(get, p, loader)
            if layer.per_layer_input_gate is not None:
                loader.linear(layer.per_layer_input_gate, [get(p + "per_layer_input_gate.weight")])
                loader.linear(layer.per_layer_projection, [get(p + "per_layer_projection.weight")])
                layer.post_per_layer_input_norm.weight = norm(p + "post_per_layer_input_norm.weight")
