"""Hybrid decoders: each layer is a list of pre-norm residual steps, x + mixer(norm(x)), with the mixers
chosen per layer from `layer_types`: attention, LFM2's short convolution, gated DeltaNet, Mamba2
(mamba2_mixer.py), MLPs and sparse mixtures of experts (hybrid_mlp.py, models/moe.py). A step may run
several mixers side by side on its normed input and add their outputs (Falcon-H1's Mamba2 beside
attention, Granite's experts beside its shared MLP). Which mixers a layer holds and their tensor names
are in hybrid_layout.py; a new kind of layer is a new mixer, not a branch in the forward.

Attention mixers keep K/V in the block pool; recurrent mixers keep a fixed state per sequence in
state slots (kernels/recurrent.py), named by the step's StateMetadata. Each stateful mixer owns one
entry of the caches list the runner allocates from `cache_specs()`.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec, StateSpec
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid_base import Getter, LayerContext, NormGetter, conv_weight, fp32_param, scaled
from conveyor.models.hybrid_layout import MixerSpec, embedding_name, final_norm_name, layer_prefix, sublayers
from conveyor.models.hybrid_mlp import GatedMLP, MoEMixer, SquaredReluMixer
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.llama import Embeds, LlamaAttention
from conveyor.models.mamba2_mixer import Mamba2Mixer
from conveyor.models.mrope import mrope_tables
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, load_ends, tensor_getters


class AttentionMixer(LlamaAttention):
    cache_index: int = -1

    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int) -> None:
        super().__init__(config, ops, layer)
        # Falcon-H1: q, k, v of (m_in * x), keys times m_key, output times m_out; all folded into the weights
        self.in_scale, self.key_scale = config.attention_in_multiplier, config.attention_key_multiplier
        self.out_scale = config.attention_out_multiplier

    def cache_spec(self) -> CacheSpec:
        return KVSpec(self.num_kv_heads, self.head_dim, self.window)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, ctx.rope, ctx.caches[self.cache_index], ctx.meta)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        q, k, v = (get(f"{prefix}{names[p]}.weight") for p in "qkv")
        weights = [scaled(q, self.in_scale), scaled(k, self.in_scale * self.key_scale), scaled(v, self.in_scale)]
        bias = None
        if self.qkv_proj.bias is not None:
            q_b, k_b, v_b = (get(f"{prefix}{names[p]}.bias") for p in "qkv")
            bias = [q_b, scaled(k_b, self.key_scale), v_b]
        loader.linear(self.qkv_proj, weights, bias)
        loader.linear(self.o_proj, [scaled(get(f"{prefix}{names['o']}.weight"), self.out_scale)])
        if self.q_norm is not None:
            self.q_norm.weight = norm(f"{prefix}{names['q_norm']}.weight")
            self.k_norm.weight = norm(f"{prefix}{names['k_norm']}.weight")


class ShortConvMixer(nn.Module):
    """LFM2: B, C, x = in_proj(h); y = C * causal_conv(B * x); out_proj(y). No activation."""

    cache_index: int = -1

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops, self.hidden, self.width = ops, config.hidden_size, config.conv_kernel_size
        self.in_proj = RowInvariantLinear(config.hidden_size, 3 * config.hidden_size, config.conv_bias, ops)
        self.out_proj = RowInvariantLinear(config.hidden_size, config.hidden_size, config.conv_bias, ops)
        self.conv_weight: torch.Tensor | None = None  # (C, K) fp32
        self.conv_bias: torch.Tensor | None = None

    def cache_spec(self) -> CacheSpec:
        return StateSpec(((self.hidden, self.width - 1),))

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        b, c, h = self.in_proj(x).split(self.hidden, dim=-1)  # (T, H) each
        (state,) = ctx.caches[self.cache_index]
        conv = self.ops.short_conv((b * h).contiguous(), self.conv_weight, self.conv_bias, state, ctx.meta.state,
                                   apply_silu=False)
        return self.out_proj(c * conv)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        bias = self.in_proj.bias is not None
        loader.linear(self.in_proj, [get(f"{prefix}{names['in']}.weight")],
                      [get(f"{prefix}{names['in']}.bias")] if bias else None)
        loader.linear(self.out_proj, [get(f"{prefix}{names['out']}.weight")],
                      [get(f"{prefix}{names['out']}.bias")] if bias else None)
        self.conv_weight = conv_weight(loader, get(f"{prefix}{names['conv']}.weight"))
        if bias:
            self.conv_bias = fp32_param(loader, get(f"{prefix}{names['conv']}.bias"))


class GatedDeltaNetMixer(nn.Module):
    """Qwen3.5's and Qwen3-Next's linear attention: q|k|v through a SiLU short conv, the gated delta rule
    per value head (l2-normed q/k, decay exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b)), then
    RMSNorm(o) * silu(z) per head and out_proj. The four input projections run as one GEMM."""

    cache_index: int = -1

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size = 2 * self.key_size + self.value_size
        self.width = config.conv_kernel_size
        self.eps = config.rms_norm_eps
        # in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
        self.in_proj = RowInvariantLinear(config.hidden_size, self.conv_size + self.value_size + 2 * self.num_v_heads,
                                          False, ops)
        self.out_proj = RowInvariantLinear(self.value_size, config.hidden_size, False, ops)
        self.norm_weight = nn.Parameter(torch.empty(self.v_dim, device="meta"), requires_grad=False)
        self.conv_weight: torch.Tensor | None = None
        self.A_log: torch.Tensor | None = None  # (Hv,) fp32 of the model-dtype parameter
        self.dt_bias: torch.Tensor | None = None

    def cache_spec(self) -> CacheSpec:
        return StateSpec(((self.conv_size, self.width - 1), (self.num_v_heads, self.k_dim, self.v_dim)))

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        # Every part below is a view of the projection's output, read in place by the kernels (rows apart), so
        # the glue copies nothing: at decode sizes each torch copy is a parallel region of its own.
        T = x.shape[0]
        qkv, z, b, a = self.in_proj.forward_split(
            x, [self.conv_size, self.value_size, self.num_v_heads, self.num_v_heads])
        conv_state, ssm_state = ctx.caches[self.cache_index]
        mixed = self.ops.short_conv(qkv, self.conv_weight, None, conv_state, ctx.meta.state, apply_silu=True)
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        core = self.ops.gated_delta_rule(q.view(T, self.num_k_heads, self.k_dim),
                                         k.view(T, self.num_k_heads, self.k_dim),
                                         v.view(T, self.num_v_heads, self.v_dim), a, b,
                                         self.A_log, self.dt_bias, ssm_state, ctx.meta.state)  # (T, Hv, dv)
        normed = self.ops.gated_rms_norm(core, z.view(T, self.num_v_heads, self.v_dim), self.norm_weight,
                                         self.eps, self.v_dim, norm_before_gate=True)  # (T, Hv, dv)
        return self.out_proj(normed.view(T, self.value_size))

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        try:  # Qwen3.5, and Qwen3-Next from GGUF
            parts = [get(f"{prefix}{names[p]}.weight") for p in ("qkv", "z", "b", "a")]
        except KeyError:
            if "qkvz" not in names:
                raise
            parts = self._from_key_head_groups(get(f"{prefix}{names['qkvz']}.weight"),  # Qwen3-Next's HF layout
                                               get(f"{prefix}{names['ba']}.weight"))
        loader.linear(self.in_proj, parts)
        loader.linear(self.out_proj, [get(f"{prefix}{names['out']}.weight")])
        self.conv_weight = conv_weight(loader, get(f"{prefix}{names['conv']}.weight"))
        self.norm_weight = loader.param(get(f"{prefix}{names['norm']}.weight"))  # plain w, no (1 + w)
        self.A_log = fp32_param(loader, get(f"{prefix}A_log"))
        self.dt_bias = fp32_param(loader, get(f"{prefix}dt_bias"))

    def _from_key_head_groups(self, qkvz: torch.Tensor, ba: torch.Tensor) -> list[torch.Tensor]:
        """Qwen3-Next's projections, rows grouped by key head g (v_g, z_g, b_g, a_g: its value heads'),

            in_proj_qkvz: | q_0 k_0 v_0 z_0 | q_1 k_1 v_1 z_1 | ...     in_proj_ba: | b_0 a_0 | b_1 a_1 | ...

        as the q, k, v, z, b, a row blocks of the fused in_proj (value heads in order g * group + j)."""
        hidden, group = qkvz.shape[1], self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(self.num_k_heads, -1, hidden).split(
            [self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim], dim=1)
        b, a = ba.view(self.num_k_heads, 2 * group, hidden).split([group, group], dim=1)
        return [part.reshape(-1, hidden) for part in (q, k, v, z, b, a)]


MIXERS = {"attention": AttentionMixer, "short_conv": ShortConvMixer, "gated_deltanet": GatedDeltaNetMixer,
          "mamba2": Mamba2Mixer, "moe": MoEMixer}


def build_mixer(config: ModelConfig, ops: KernelBackend, layer: int, spec: MixerSpec) -> nn.Module:
    if spec.kind == "attention":
        return AttentionMixer(config, ops, layer)
    if spec.kind == "mlp":  # the MLP's shape follows the activation: gated, or relu^2 without a gate
        return SquaredReluMixer(config, ops) if config.hidden_act == "relu2" else GatedMLP(config, ops)
    if spec.kind not in MIXERS:
        raise ValueError(f"unknown mixer kind {spec.kind!r}")
    return MIXERS[spec.kind](config, ops)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int) -> None:
        super().__init__()
        self.plan = sublayers(config, layer)
        self.norms = nn.ModuleList(RMSNorm(config.hidden_size, config.rms_norm_eps, ops) for _ in self.plan)
        # every step's mixers in order (the last is the layer's channel mixer); plan[s].mixers says how many per step
        self.mixers = nn.ModuleList(build_mixer(config, ops, layer, spec) for sub in self.plan for spec in sub.mixers)
        self.residual_multiplier = config.residual_multiplier  # Granite: every branch scaled before its add

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None,
                ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous step's output, residual stream) -> (this layer's last output, residual stream);
        each residual add is fused into the norm after it, as in models/llama.py."""
        mixers = iter(self.mixers)
        for norm, sub in zip(self.norms, self.plan):
            if residual is None:
                residual, h = delta, norm(delta)
            else:
                residual, h = norm.add_and_norm(residual, delta)
            delta = next(mixers)(h, ctx)
            for _ in sub.mixers[1:]:  # side by side on the same input, added in the layout's order
                delta = delta + next(mixers)(h, ctx)
            if self.residual_multiplier != 1.0:
                delta = delta * self.residual_multiplier
        return delta, residual


class HybridForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, _freeze=True,
                                                    _weight=torch.empty(config.vocab_size, config.hidden_size,
                                                                        device="meta"))
        self.layers = nn.ModuleList(HybridDecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False, ops=ops)
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.max_position_embeddings, config.rope_theta,
                                       config.rope_scaling) if config.rotary_dim else None)
        self._specs: list[CacheSpec] = []
        for mixer in self._mixers():
            spec = mixer.cache_spec()
            if spec is not None:
                mixer.cache_index = len(self._specs)
                self._specs.append(spec)

    def _mixers(self) -> Iterator[nn.Module]:
        for layer in self.layers:
            yield from layer.mixers

    def cache_specs(self) -> list[CacheSpec]:
        """One entry per stateful mixer, in order: the runner allocates the caches list from these."""
        return list(self._specs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list, meta: AttentionMetadata,
                logits_indices: torch.Tensor, embeds: Embeds | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (T,) -> float32 logits (len(logits_indices), vocab). `embeds`: (rows, values) put in
        place of those rows' token embeddings (image rows); `rope_positions` (3, T): multimodal rotary positions
        (Qwen3.5's interleaved M-RoPE), None: `positions`."""
        return self.compute_logits(self.hidden_states(input_ids, positions, caches, meta, logits_indices, embeds,
                                                      rope_positions))

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list, meta: AttentionMetadata,
                      rows: torch.Tensor, embeds: Embeds | None = None,
                      rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (T,) -> the final-normed hidden states (len(rows), hidden) of the token rows `rows`:
        what the head reads, and what an MTP head (models/mtp.py) drafts from."""
        cfg = self.config
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier  # a Python float, as transformers' Granite and Falcon-H1 scale
        if embeds is not None:  # image rows: the tower's output as is
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        if self.rotary is None:
            rope = None
        elif rope_positions is not None and cfg.mrope_section:
            rope = mrope_tables(self.rotary, rope_positions, cfg.mrope_section, x.dtype)
        else:
            rope = self.rotary.tables(positions, x.dtype)
        ctx = LayerContext(rope, caches, meta)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        _, x = self.norm.add_and_norm(residual[rows], x[rows])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states (R, hidden) -> float32 logits (R, vocab)."""
        return self.scale_logits(self.lm_head(hidden).float())

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's float32 output (R, any columns) -> logits (an MTP head's draft vocabulary reads it too)."""
        if self.config.logits_scaling != 1.0:  # Granite divides; Falcon-H1's lm_head_multiplier m is 1 / m here
            logits = logits / self.config.logits_scaling
        return logits

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        cfg = self.config

        get, norm = tensor_getters(weights, loader, cfg.norm_weight_offset)

        load_ends(self, weights, loader, get, norm, embedding_name(cfg), final_norm_name(cfg))
        for i, layer in enumerate(self.layers):
            prefix = layer_prefix(cfg, i)
            for sub, layer_norm in zip(layer.plan, layer.norms):
                layer_norm.weight = norm(f"{prefix}{sub.norm}.weight")
            specs = [spec for sub in layer.plan for spec in sub.mixers]
            for spec, mixer in zip(specs, layer.mixers, strict=True):
                mixer.load(get, prefix + spec.prefix, spec.names, loader, norm)
