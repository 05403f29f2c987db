"""Gemma 3n (text) over the paged KV cache: Gemma 4's attention (K/V sharing, q/k/v norms) and per-layer embeddings
(gemma4_model.py), inside AltUp's streams, with LAuReL beside attention and a sparse MLP gate (models/gemma3n.py).

Every step is per token row: the AltUp coefficients are sums over the few streams in a fixed order, transcendental
functions run through the backend's row-invariant kernels (GeGLU; tanh as 2 sigmoid(2x) - 1), and the row
statistics (RMS magnitudes, the gate's mean and std) are reductions along one row.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig
from conveyor.models.gemma4_model import Gemma4Attention, PerLayerInputs, load_attention_mlp_norms, meta_embedding
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.llama import KVCache, Rope
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, load_ends, tensor_getters


def _meta_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def _mix(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (R, k) @ weight (n, k)^T for a handful of k, summed in a fixed order in fp32 (rounded to x's dtype once):
    no GEMM whose kernel choice could depend on R."""
    out = x[:, :1].float() * weight[:, 0].float()
    for k in range(1, weight.shape[1]):
        out = out + x[:, k:k + 1].float() * weight[:, k].float()
    return out.to(x.dtype)  # (R, n)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5  # (R, 1)


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x scaled to the target RMS magnitude per row, as transformers' AltUp embedding / unembedding does."""
    return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


class AltUp(nn.Module):
    """predict: each stream plus a per-token mix of all (coefficients from the active stream through a router);
    correct: each prediction plus the layer's innovation on the active stream, scaled per token and stream."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_streams, self.active = config.altup_num_inputs, config.altup_active_idx
        self.router_scale = config.hidden_size ** -1.0
        self.router_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.modality_router = RowInvariantLinear(config.hidden_size, self.num_streams, False, ops)
        self.prediction_coefs = _meta_param(self.num_streams ** 2, self.num_streams)
        self.correction_coefs = _meta_param(self.num_streams, self.num_streams)
        self.correct_output_scale = _meta_param(config.hidden_size)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * torch.tensor(self.router_scale)).float()
        # tanh through the backend's row-invariant sigmoid (torch's vector body and scalar tail round apart)
        return (2.0 * self.ops.sigmoid(2.0 * routed) - 1.0).to(x.dtype)  # (T, n)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """(n, T, H) -> (n, T, H): stream c + sum_k coef[c, k] * stream k."""
        n = self.num_streams
        coefs = _mix(self._modalities(streams[self.active]), self.prediction_coefs)  # (T, n * n)
        out = []
        for c in range(n):
            mixed = streams[0].float() * coefs[:, c * n:c * n + 1].float()
            for k in range(1, n):
                mixed = mixed + streams[k].float() * coefs[:, c * n + k:c * n + k + 1].float()
            out.append(mixed.to(streams.dtype) + streams[c])
        return torch.stack(out)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """(n, T, H) predictions and the layer's (T, H) output -> (n, T, H)."""
        coefs = _mix(self._modalities(activated), self.correction_coefs) + 1.0  # (T, n)
        innovation = activated - predictions[self.active]
        return torch.stack([innovation * coefs[:, c:c + 1] + predictions[c] for c in range(self.num_streams)])


class Laurel(nn.Module):
    """x + norm(right(left(x))): a low-rank residual branch."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.linear_left = RowInvariantLinear(config.hidden_size, config.laurel_rank, False, ops)
        self.linear_right = RowInvariantLinear(config.laurel_rank, config.hidden_size, False, ops)
        self.post_laurel_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class SparseGeGLU(nn.Module):
    """Gemma's GeGLU, its gate first cut by a gaussian top-k where the layer is sparse: relu(gate - (mean + std *
    Phi^-1(share))) per row, keeping about (1 - share) of the activations."""

    def __init__(self, config: ModelConfig, ops: KernelBackend, width: int, share: float) -> None:
        super().__init__()
        self.ops, self.width = ops, width
        self.gate_up_proj = RowInvariantLinear(config.hidden_size, 2 * width, False, ops)
        self.down_proj = RowInvariantLinear(width, config.hidden_size, False, ops)
        normal = torch.distributions.normal.Normal(0, 1)
        self.std_multiplier = float(normal.icdf(torch.tensor(share, dtype=torch.float32))) if share > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if self.std_multiplier is not None:
            gate, up = gate_up.split([self.width, self.width], dim=-1)
            multiplier = torch.tensor(self.std_multiplier, dtype=torch.float32).to(gate.dtype)
            cutoff = gate.mean(-1, keepdim=True) + gate.std(-1, keepdim=True, unbiased=False) * multiplier
            gate_up = torch.cat([torch.relu(gate - cutoff), up], dim=-1)
        return self.down_proj(self.ops.gelu_tanh_mul(gate_up))


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int) -> None:
        super().__init__()
        self.ops, self.active = ops, config.altup_active_idx
        self.altup = AltUp(config, ops)
        self.correct_scale = config.altup_correct_scale
        self.laurel = Laurel(config, ops)
        self.self_attn = Gemma4Attention(config, ops, layer)
        share = config.activation_sparsity[layer] if config.activation_sparsity else 0.0
        self.mlp = SparseGeGLU(config, ops, config.layer_intermediate_size(layer), share)
        self.norm_names = config.layer_norm_names
        for name in self.norm_names:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, ops))
        width = config.hidden_size_per_layer_input
        self.per_layer_input_gate = RowInvariantLinear(config.hidden_size, width, False, ops)
        self.per_layer_projection = RowInvariantLinear(width, config.hidden_size, False, ops)
        self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, streams: torch.Tensor, per_layer_input: torch.Tensor, rope: Rope, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """AltUp streams (n, T, H) in and out."""
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_layernorm(active)
        attn = self.post_attention_layernorm(self.self_attn(normed, rope, kv_cache, meta))
        x = (active + attn + self.laurel(normed)) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        gated = self.ops.gelu_tanh_mul(torch.cat([self.per_layer_input_gate(first), per_layer_input], dim=-1))
        first = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return torch.cat([corrected[:1], corrected[1:] + first])  # every stream but the first takes the PLE


class Gemma3nForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.embed_tokens: nn.Module = meta_embedding(config.vocab_size, config.hidden_size)
        self.per_layer_inputs = PerLayerInputs(config, ops, round_scales=True)
        n, h = config.altup_num_inputs, config.hidden_size
        self.altup_projections = nn.ModuleList(RowInvariantLinear(h, h, False, ops) for _ in range(n - 1))
        self.altup_unembed_projections = nn.ModuleList(RowInvariantLinear(h, h, False, ops) for _ in range(n - 1))
        self.layers = nn.ModuleList(Gemma3nDecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.lm_head = RowInvariantLinear(h, config.vocab_size, bias=False, ops=ops)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.local_rope_theta or 10000.0, None)
        owners = [i for i in range(config.num_hidden_layers) if config.kv_source(i) == i]
        self.cache_index = [owners.index(config.kv_source(i)) for i in range(config.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> float32 logits (len(logits_indices), vocab)."""
        cfg = self.config
        x = self.embed_tokens(input_ids)  # (T, hidden)
        x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)  # rounded to the dtype first, as transformers
        per_layer = self.per_layer_inputs(input_ids, x)  # (T, L, P)
        target = _rms(x)
        streams = torch.stack([x] + [_rescaled(proj(x), target) for proj in self.altup_projections])  # (n, T, H)
        rope, local_rope = self.rotary.tables(positions, x.dtype), self.local_rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            streams = layer(streams, per_layer[:, i], local_rope if cfg.is_sliding(i) else rope,
                            kv_caches[self.cache_index[i]], meta)
        streams = streams[:, logits_indices]  # only rows that sample need the unembedding and head
        target = _rms(streams[0])
        unembedded = [streams[0]] + [_rescaled(proj(s), target) for proj, s in zip(self.altup_unembed_projections,
                                                                                  streams[1:])]
        # the streams' mean, summed in fp32 in a fixed order (torch.mean over the stacked streams, rounded once)
        mean = sum(s.float() for s in unembedded[1:]) if len(unembedded) > 1 else 0.0
        x = ((unembedded[0].float() + mean) / len(unembedded)).to(x.dtype)
        logits = self.lm_head(self.norm(x)).float()
        if cfg.final_logit_softcapping:
            logits = self.ops.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def cache_specs(self) -> list[CacheSpec]:
        """K/V in the block pool for the layers that compute it; the K/V-sharing layers keep nothing."""
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, cfg.window(i))
                for i in range(cfg.num_hidden_layers) if cfg.kv_source(i) == i]

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """HF-named tensors (models/gemma3n.py weight_names), one at a time; q|k|v and gate|up fused."""
        cfg = self.config
        get, norm = tensor_getters(weights, loader, cfg.norm_weight_offset)
        load_ends(self, weights, loader, get, norm)
        self.per_layer_inputs.load(loader, get, norm)
        for kind in ("altup_projections", "altup_unembed_projections"):
            for i, proj in enumerate(getattr(self, kind)):
                loader.linear(proj, [get(f"model.{kind}.{i}.weight")])
        for i, layer in enumerate(self.layers):
            self._load_layer(layer, f"model.layers.{i}.", get, norm, loader)

    @staticmethod
    def _load_layer(layer: Gemma3nDecoderLayer, p: str, get, norm, loader: WeightLoader) -> None:
        load_attention_mlp_norms(layer, p, get, norm, loader)
        altup = layer.altup
        altup.router_norm.weight = norm(p + "altup.router_norm.weight")
        loader.linear(altup.modality_router, [get(p + "altup.modality_router.weight")])
        altup.prediction_coefs = loader.param(get(p + "altup.prediction_coefs.weight"))
        altup.correction_coefs = loader.param(get(p + "altup.correction_coefs.weight"))
        altup.correct_output_scale = loader.param(get(p + "altup.correct_output_scale"))
        loader.linear(layer.laurel.linear_left, [get(p + "laurel.linear_left.weight")])
        loader.linear(layer.laurel.linear_right, [get(p + "laurel.linear_right.weight")])
        layer.laurel.post_laurel_norm.weight = norm(p + "laurel.post_laurel_norm.weight")
        loader.linear(layer.per_layer_input_gate, [get(p + "per_layer_input_gate.weight")])
        loader.linear(layer.per_layer_projection, [get(p + "per_layer_projection.weight")])
        layer.post_per_layer_input_norm.weight = norm(p + "post_per_layer_input_norm.weight")
