"""The shared decoder over a paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, and the
dense families that differ from Llama only in config (models/gemma.py, olmo2.py, granite.py, phi3.py,
smollm3.py, ministral3.py, glm4.py, exaone4.py, ernie4_5.py, seed_oss.py, hunyuan_dense.py, apertus.py):
where the norms sit, the MLP gate (or Apertus' ungated xIELU), biases, QK-norm (before or after rotary),
per-layer sliding windows, rope bases and NoPE layers, interleaved rotary, multipliers, an attention
temperature, soft-capping and attention sinks (GPT-OSS), all read from ModelConfig.

Inputs are flattened across sequences ("varlen"): T token rows from any mix of prefill
chunks and decode steps run through one forward; only attention looks at sequence
boundaries, through AttentionMetadata.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.apertus import XIELU_PARAMS
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig
from conveyor.models.encoder_attention import sequence_attention
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.tensors import QuantizedTensor, Weight
from conveyor.models.weights import WeightLoader, load_ends, tensor_getters

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, kv_heads, head_dim) each
Rope = tuple[torch.Tensor, torch.Tensor]  # (T, 1, D) cos and signed sin


# (row indices (E,), embeddings (E, hidden)): rows whose input is not their token's embedding (an image's).
Embeds = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # the first rotary_dim dims of each head rotate (Qwen3.5: a quarter; 0: none, NoPE)
        self.rotary_dim = config.layer_rotary_dim(layer)
        # Qwen3.5: q_proj yields each head's query and an output gate side by side.
        self.output_gate = config.attn_output_gate
        q_out = 2 * self.q_size if self.output_gate else self.q_size
        # q, k and v projections fused into one GEMM at load time.
        self.qkv_proj = RowInvariantLinear(config.hidden_size, q_out + 2 * self.kv_size, config.attention_bias, ops)
        self.o_proj = RowInvariantLinear(self.q_size, config.hidden_size, config.attention_out_bias, ops)
        # QK-norm per head (Qwen3, Gemma 3) or over the whole q / k projection (OLMo 2, OLMoE).
        self.full_qk_norm = config.qk_norm and config.qk_norm_scope == "full"
        q_dim, k_dim = (self.q_size, self.kv_size) if self.full_qk_norm else (self.head_dim, self.head_dim)
        # Llama 4's L2-norm is an RMSNorm of weight 1 (set at load), on the rotary layers only.
        l2_norm = config.qk_l2_norm and self.rotary_dim > 0
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, ops) if config.qk_norm or l2_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, ops) if config.qk_norm or l2_norm else None
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim ** -0.5
        self.window = config.window(layer)
        # EmbeddingGemma: every row attends its whole text (a sliding layer: +-window) from this forward's q, k, v.
        self.bidirectional = config.bidirectional
        # Llama 4's rotary layers attend within chunks (the kernels' negative window); its K/V is kept whole.
        self.attend_window = -config.attention_chunk if config.attention_chunk and self.rotary_dim else self.window
        self.softcap = config.attn_logit_softcapping or 0.0
        self.sinks: torch.Tensor | None = None  # (H,) fp32, loaded (GPT-OSS's attention sinks)
        self.norm_after_rope = config.qk_norm_after_rope or l2_norm  # Hunyuan, Llama 4
        # Ministral 3 (every layer), Llama 4 (NoPE layers, by pos + 1)
        beta = 0.0 if config.attn_temperature_nope_only and self.rotary_dim else config.attn_temperature_beta
        self.temperature = (beta, config.attn_temperature_length, config.attn_temperature_offset)

    def forward(self, x: torch.Tensor, rope: Rope | None, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.for_window(self.window)  # a sliding layer's K/V may sit in the sliding group's blocks
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            query_gate, kv = qkv.split([2 * self.q_size, 2 * self.kv_size], dim=-1)
            query_gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)  # (T, H, 2D)
            gate = query_gate[..., self.head_dim:].reshape(num_tokens, self.q_size)
            qkv = torch.cat([query_gate[..., :self.head_dim].reshape(num_tokens, self.q_size), kv], dim=-1)
        elif (self.ops.fuses_rope and self.q_norm is None and self.rotary_dim == self.head_dim
              and not self.temperature[0] and not self.bidirectional):
            # rotary + cache write fused into one pass
            q = self.ops.rope_write_kv(qkv, rope[0].squeeze(1), rope[1].squeeze(1), kv_cache[0], kv_cache[1],
                                      meta.slot_mapping, self.num_heads)
            return self._attend(q, kv_cache, meta)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.full_qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # (T, H + KVH, D)
        head_norm = self.q_norm is not None and not self.full_qk_norm
        if head_norm and not self.norm_after_rope:
            qk = self._head_norm(qk)
        qk = self._rotate(qk, rope)
        if head_norm and self.norm_after_rope:
            qk = self._head_norm(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.temperature[0]:
            q = _scale_queries(q, meta.token_pos, *self.temperature)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        if self.bidirectional:  # the whole text is in this forward; nothing is kept (models/encoder_attention.py)
            out = sequence_attention(q, k, v, meta.seq_token_counts, self.scale, self.window)  # (T, H, D)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        self.ops.write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, gate)

    def _head_norm(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)

    def _rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Rotary on q|k side by side (one pass for both): whole heads, their first rotary_dim dims, or none (NoPE)."""
        if self.rotary_dim == self.head_dim:
            return RotaryEmbedding.apply(qk, *rope)
        if not self.rotary_dim:
            return qk
        rotated, rest = qk.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([RotaryEmbedding.apply(rotated, *rope), rest], dim=-1)

    def _attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.attend_window,
                                       self.softcap, self.sinks)  # (T, H, D)
        out = out.reshape(q.shape[0], self.q_size)
        if gate is not None:
            out = self.ops.sigmoid_mul(out, gate)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """Gated MLP: SwiGLU (silu) or GeGLU (tanh-GELU, Gemma), gate and up fused into one GEMM."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = RowInvariantLinear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, ops)
        self.down_proj = RowInvariantLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, ops)
        self.act_mul = ops.gelu_tanh_mul if config.hidden_act == "gelu_tanh" else ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))


class XIELUMLP(nn.Module):
    """Apertus: down(xielu(up(x))), no gate; the activation's four scalars (after softplus) are set at load."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.up_proj = RowInvariantLinear(config.hidden_size, config.intermediate_size, config.mlp_bias, ops)
        self.down_proj = RowInvariantLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, ops)
        self.alpha_p = self.alpha_n = self.beta = self.eps = 0.0

    def set_activation(self, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
                       eps: torch.Tensor) -> None:
        """From the checkpoint's tensors in the model dtype, as transformers' XIELUActivation computes them."""
        softplus = nn.functional.softplus
        self.alpha_p = float(softplus(alpha_p).reshape(()))
        self.alpha_n = float((beta + softplus(alpha_n)).reshape(()))
        self.beta, self.eps = float(beta.reshape(())), float(eps.reshape(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.xielu(self.up_proj(x), self.alpha_p, self.alpha_n, self.beta, self.eps))


class RotaryPairsToHalves(Mapping):
    """Checkpoint tensors with q/k rows in interleaved-rotary order (pairs 2i, 2i+1 of each head's first
    rotary_dim dims) read back in rotate-half order (i, i + rotary_dim / 2), the one our rotary runs.

    Both q and k move the same way, so every score q.k is the same sum (in another order); v and o are not
    touched. A quantized row is a whole output feature, so blocks move as rows.
    """

    _HEAD_ROWS = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.qkv_proj.")

    def __init__(self, weights: Mapping[str, Weight], config: ModelConfig,
                 release: Callable[[torch.Tensor], None]) -> None:
        self.weights, self.config, self.release = weights, config, release

    def __getitem__(self, name: str) -> Weight:
        weight = self.weights[name]
        cfg = self.config
        if any(part in name for part in self._HEAD_ROWS):
            # fused q|k|v: the q and k heads sit first, side by side; v's rows stay
            heads = (cfg.num_key_value_heads if "k_proj" in name else cfg.num_attention_heads
                     + (cfg.num_key_value_heads if "qkv_proj" in name else 0))
        elif name.endswith(("q_norm.weight", "k_norm.weight")) and cfg.qk_norm_scope == "head":
            heads = 1
        else:
            return weight
        order = _halves_order(heads, cfg.head_dim, cfg.rotary_dim, weight.shape[0])
        rows = weight.raw if isinstance(weight, QuantizedTensor) else weight
        moved = rows[order]
        self.release(rows)
        return QuantizedTensor(weight.qtype, weight.shape, moved) if isinstance(weight, QuantizedTensor) else moved

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def _halves_order(heads: int, head_dim: int, rotary_dim: int, rows: int) -> torch.Tensor:
    """Row order taking each of the first `heads` heads' rotary pairs to halves: [0, 2, 4, .., 1, 3, 5, .., rest]."""
    within = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                        torch.arange(rotary_dim, head_dim)])
    moved = (torch.arange(heads)[:, None] * head_dim + within).reshape(-1)
    return torch.cat([moved, torch.arange(heads * head_dim, rows)])


def _scale_queries(q: torch.Tensor, positions: torch.Tensor, beta: float, length: int, offset: int) -> torch.Tensor:
    """Llama 4's query temperature per row, by absolute position, as transformers writes each family's:
    Ministral 3: q * (1 + beta * log(1 + floor(pos / length))) with the scale rounded to q's dtype;
    Llama 4 (offset 1): q * (log1p(floor((pos + 1) / length)) * beta + 1), the product in fp32."""
    if not offset:
        return q * (1 + beta * torch.log(1 + torch.floor(positions / length))).to(q.dtype)[:, None, None]
    scale = torch.log1p(torch.floor((positions.float() + offset) / length)) * beta + 1.0  # (T,) fp32
    return (q * scale[:, None, None]).to(q.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, layer)
        self.mlp = XIELUMLP(config, ops) if config.hidden_act == "xielu" else LlamaMLP(config, ops)
        self.layout = config.norm_layout
        self.norm_names = config.layer_norm_names
        for name in self.norm_names:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, ops))
        self.residual_multiplier = config.residual_multiplier

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's MLP output, residual stream) -> (this layer's MLP output, residual stream).

        Each residual add is fused into the norm after it (vLLM's scheme) where one follows; the
        first layer gets the embeddings as `delta` and no residual yet.
        """
        if self.layout == "post":  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x))
            residual = delta if residual is None else residual + delta
            attn_out = self.self_attn(residual, rope, kv_cache, meta)
            residual = residual + self._scaled(self.post_attention_layernorm(attn_out))
            return self._scaled(self.post_feedforward_layernorm(self.mlp(residual))), residual
        if residual is None:
            residual, h = delta, self.input_layernorm(delta)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, delta)
        attn_out = self.self_attn(h, rope, kv_cache, meta)
        if self.layout == "sandwich":  # Gemma: norms after attention and MLP too
            residual, h = self.pre_feedforward_layernorm.add_and_norm(residual, self.post_attention_layernorm(attn_out))
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        residual, h = self.post_attention_layernorm.add_and_norm(residual, self._scaled(attn_out))
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier  # Granite


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        # A meta placeholder (no memory, no init): loading puts an nn.Embedding or a QuantizedEmbedding here.
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, _freeze=True,
                                                    _weight=torch.empty(config.vocab_size, config.hidden_size,
                                                                        device="meta"))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False, ops=ops)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        # Gemma 3: sliding layers rotate with their own base, unscaled.
        self.local_rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                             config.local_rope_theta, None)
                             if config.local_rope_theta is not None else None)
        self.local_rope = [self.local_rotary is not None and config.is_sliding(i)
                           for i in range(config.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor, embeds: Embeds | None = None) -> torch.Tensor:
        """input_ids, positions (T,) -> float32 logits (len(logits_indices), vocab). `embeds`: (rows, values) put in
        place of those rows' token embeddings (a vision tower's output, runner/model_runner.py)."""
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices, embeds))

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor, embeds: Embeds | None = None) -> torch.Tensor:
        """input_ids, positions (T,) -> the final-normed hidden states (len(rows), hidden) of the token rows
        `rows`: what the head reads, and what a pooling model (an embedder) pools."""
        x, residual = self._layers(input_ids, positions, kv_caches, meta, embeds=embeds)
        # Only rows that sample (or pool) need the last add and the final norm.
        _, x = self.norm.add_and_norm(residual[rows], x[rows])
        return x

    @torch.inference_mode()
    def aux_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                          meta: AttentionMetadata, rows: torch.Tensor,
                          layer_ids: tuple[int, ...], embeds: Embeds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states(rows), and every row's residual stream entering each layer of `layer_ids` side by side
        (T, len(layer_ids) * hidden): what an EAGLE3 drafter reads (vLLM's aux hidden states: id 0 the embedding,
        id L the stream into layer L, id num_hidden_layers the stream before the final norm)."""
        aux: dict[int, torch.Tensor] = {}
        x, residual = self._layers(input_ids, positions, kv_caches, meta, set(layer_ids), aux, embeds)
        if self.config.num_hidden_layers in layer_ids:
            aux[self.config.num_hidden_layers] = residual + x
        _, out = self.norm.add_and_norm(residual[rows], x[rows])
        return out, torch.cat([aux[i] for i in layer_ids], dim=-1)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, capture: set[int] = frozenset(),
                aux: dict[int, torch.Tensor] | None = None,
                embeds: Embeds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the rows -> (the last layer's output, the residual stream); the stream entering each
        layer in `capture` goes into `aux`."""
        cfg = self.config
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if cfg.embedding_multiplier != 1.0:
            # NOTE: rounded to the compute dtype first, as transformers' Gemma does (sqrt(640) -> 25.25 in bf16).
            x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
        if embeds is not None:  # image rows: the tower's output as is (transformers scales only token embeddings)
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        rope = self.rotary.tables(positions, x.dtype)
        local_rope = self.local_rotary.tables(positions, x.dtype) if self.local_rotary is not None else rope
        residual = None
        for i, (layer, kv_cache, local) in enumerate(zip(self.layers, kv_caches, self.local_rope)):
            if i in capture:
                aux[i] = x if residual is None else residual + x
            x, residual = layer(x, residual, local_rope if local else rope, kv_cache, meta)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states (R, hidden) -> float32 logits (R, vocab)."""
        cfg = self.config
        logits = self.lm_head(hidden).float()
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcapping:
            logits = self.ops.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """Fill the model from HF-named tensors (built on the meta device), fusing q/k/v and gate/up.

        One tensor at a time: the loader converts each (blocks kept, packed or dequantized) and releases it.
        """
        cfg = self.config
        if cfg.rope_interleaved:  # ERNIE 4.5, GLM-4
            weights = RotaryPairsToHalves(weights, cfg, loader.release)
        get, norm = tensor_getters(weights, loader, cfg.norm_weight_offset)

        def fused(prefix: str, fused_name: str, names: list[str]) -> list[Weight]:
            # Phi-3 ships q|k|v and gate|up already fused, in the order our linears use.
            if prefix + fused_name in weights:
                return [get(prefix + fused_name)]
            return [get(prefix + n) for n in names]

        load_ends(self, weights, loader, get, norm)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            self._load_attention(layer.self_attn, get, norm, p, loader, fused)
            self._load_mlp(layer.mlp, get, p, loader, fused)
            for name in layer.norm_names:
                getattr(layer, name).weight = norm(p + name + ".weight")

    def _load_attention(self, attn: nn.Module, get: Callable[[str], Weight], norm: Callable[[str], nn.Parameter],
                        p: str, loader: WeightLoader, fused: Callable[[str, str, list[str]], list[Weight]]) -> None:
        """One layer's attention from HF names under `p` (`model.layers.N.`); MLA loads its own (models/mla.py)."""
        cfg = self.config
        bias = [get(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if cfg.attention_bias else None
        loader.linear(attn.qkv_proj, fused(p, "self_attn.qkv_proj.weight",
                                           [f"self_attn.{n}_proj.weight" for n in "qkv"]), bias)
        out_bias = [get(p + "self_attn.o_proj.bias")] if cfg.attention_out_bias else None
        loader.linear(attn.o_proj, [get(p + "self_attn.o_proj.weight")], out_bias)
        if cfg.qk_norm:
            attn.q_norm.weight = norm(p + "self_attn.q_norm.weight")
            attn.k_norm.weight = norm(p + "self_attn.k_norm.weight")
        elif attn.q_norm is not None:  # Llama 4's L2-norm: no weight in the checkpoint
            ones = nn.Parameter(torch.ones(cfg.head_dim, dtype=loader.dtype, device=loader.device),
                                requires_grad=False)
            attn.q_norm.weight = attn.k_norm.weight = ones
        if cfg.attention_sinks:  # in the model dtype, as transformers holds them; the kernel reads fp32
            attn.sinks = loader.dense(get(p + "self_attn.sinks")).float()

    def cache_specs(self) -> list[CacheSpec]:
        """What each layer keeps per token (the runner allocates it): K/V in the block pool, every layer (a
        bidirectional model's blocks only hold its text's place while it runs: one group, no window)."""
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, 0 if cfg.bidirectional else cfg.window(i))
                for i in range(cfg.num_hidden_layers)]

    def _load_mlp(self, mlp: nn.Module, get: Callable[[str], Weight], prefix: str, loader: WeightLoader,
                  fused: Callable[[str, str, list[str]], list[Weight]]) -> None:
        """One layer's MLP from HF names under `prefix` (`model.layers.N.`); MoE families load experts here."""
        def bias(*parts: str) -> list[Weight] | None:
            return [get(f"{prefix}mlp.{part}_proj.bias") for part in parts] if self.config.mlp_bias else None

        if isinstance(mlp, XIELUMLP):  # Apertus
            loader.linear(mlp.up_proj, [get(prefix + "mlp.up_proj.weight")], bias("up"))
            mlp.set_activation(*(loader.dense(get(f"{prefix}mlp.act_fn.{name}")) for name in XIELU_PARAMS))
        else:
            loader.linear(mlp.gate_up_proj, fused(prefix, "mlp.gate_up_proj.weight",
                                                  ["mlp.gate_proj.weight", "mlp.up_proj.weight"]), bias("gate", "up"))
        loader.linear(mlp.down_proj, [get(prefix + "mlp.down_proj.weight")], bias("down"))
