"""Architecture description shared by the loaders and the model code."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from conveyor.models import family as families
from conveyor.models.mla_dims import MLADims

# Layer kinds of `layer_types`: attention keeps K/V in the block pool; the recurrent kinds keep a fixed
# state per sequence (models/hybrid.py): LFM2's short convolution, gated DeltaNet, Mamba2.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
RECURRENT_LAYER_TYPES = ("conv", "linear_attention", "mamba")
# Falcon-H1: attention and Mamba2 side by side in one layer, so it keeps both K/V and a state.
PARALLEL_LAYER_TYPES = ("hybrid",)
# Nemotron-H: layers with a channel mixer only (an MLP or experts), keeping nothing between steps.
CHANNEL_LAYER_TYPES = ("mlp", "moe")
# The RMSNorms of a decoder layer in each norm layout, by their Hugging Face names.
LAYOUT_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class ModelConfigError(ValueError):
    """A model's config is missing, malformed or describes something we cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a registered family's model_type (models/family.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # Mistral: each token sees only the last N positions (bidirectional: +-N)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # --- what the other dense families change (defaults: Llama) -------------------------------
    # MLP: "silu" (SwiGLU), "gelu_tanh" (Gemma's GeGLU), "relu2" (Nemotron-H: down(relu(up(x))^2), no gate),
    # "xielu" (Apertus: down(xielu(up(x))), no gate, the activation's four scalars learnt per layer) or "gelu"
    # (the encoders, BERT: down(gelu(up(x))) with the exact, erf GELU, no gate)
    hidden_act: str = "silu"
    attention_out_bias: bool = False  # o_proj bias (SmolLM3, ERNIE 4.5, Hunyuan, Apertus: with attention_bias; Seed-OSS)
    mlp_bias: bool = False  # gate/up/down biases (SmolLM3's mlp_bias, ERNIE 4.5's use_bias, Seed-OSS)
    # Layers attending without rotary (NoPE): SmolLM3's every 4th, EXAONE 4's global layers.
    no_rope_layers: tuple[int, ...] = ()
    qk_norm_after_rope: bool = False  # Hunyuan: q/k RMSNorm after rotary, not before
    # ERNIE 4.5, GLM-4: rotary pairs adjacent dims (2i, 2i+1); q/k rows are permuted at load into the
    # rotate-half order the kernels use (a permutation both q and k share leaves every score as it was).
    rope_interleaved: bool = False
    # Ministral 3 (Llama 4's attention temperature): queries scaled by 1 + beta * log(1 + floor(pos / length)).
    attn_temperature_beta: float = 0.0
    attn_temperature_length: int = 0
    # Llama 4: the temperature on NoPE layers only, by (pos + 1): 1 + beta * log(1 + floor((pos + 1) / length)).
    attn_temperature_nope_only: bool = False
    attn_temperature_offset: int = 0
    # Llama 4: q and k L2-normalised per head (an RMSNorm without weight) after rotary, on rotary layers only.
    qk_l2_norm: bool = False
    # Llama 4's chunked local attention (attention_chunk_size): its rotary layers attend only within their own
    # chunk of this many positions (0: none); its NoPE layers attend globally.
    attention_chunk: int = 0
    # Where the RMSNorms sit: "pre" (Llama), "sandwich" (Gemma 2/3: before and after attention and MLP),
    # "post" (OLMo 2: after attention and MLP only).
    norm_layout: str = "pre"
    qk_norm_scope: str = "head"  # q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2, OLMoE)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w); the 1 is added to w at load
    # Per layer "sliding_attention" or "full_attention" (Gemma 2/3); empty: every layer uses `sliding_window`.
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: rope base of the sliding layers (no scaling there)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden), rounded to the compute dtype; Granite
    residual_multiplier: float = 1.0  # Granite: attention and MLP outputs scaled before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by this
    final_logit_softcapping: float | None = None  # Gemma 2: logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None  # Gemma 2: the same on attention scores (in the kernel)
    attention_sinks: bool = False  # GPT-OSS: a learnt logit per head joins each softmax's denominator (no value)
    # Mixture of experts (models/moe.py); num_experts == 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (Qwen3-MoE)
    # Routing (models/moe.py `route`), one path for every family. Router logits -> expert scores: softmax
    # (Mixtral, Qwen), sigmoid (LFM2-MoE, Nemotron-H), or "topk_softmax": the top k logits, softmaxed over
    # those k only (GPT-OSS).
    moe_scoring: str = "softmax"
    # GPT-OSS: biases on the router and on every expert's gate, up and down projections.
    moe_linear_bias: bool = False
    # The experts' activation: "swiglu" (silu(gate) * up), or "swiglu_oai" (GPT-OSS, models/gpt_oss.py:
    # (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)).
    moe_activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # A per-expert bias added to the scores only to choose the experts (LFM2-MoE's expert_bias, Nemotron-H's
    # e_score_correction_bias); the weights stay the unbiased scores.
    moe_expert_bias: bool = False
    # Group-limited choice (Nemotron-H, as DeepSeek-V3): experts in moe_num_groups groups, only the
    # moe_topk_groups groups whose two best biased scores sum highest are eligible. 1 group: plain top-k.
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_renorm_eps: float = 0.0  # added to the k weights' sum when renormalising (LFM2-MoE 1e-6, Nemotron-H 1e-20)
    routed_scaling_factor: float = 1.0  # the k routing weights scaled after renormalising (LFM2-MoE, Nemotron-H)
    # An always-on expert this wide beside the routed ones (0: none), of the experts' shape; its output times
    # sigmoid(w . x) where shared_expert_gate (Qwen3-Next / Qwen3.5-MoE), plain where not (Nemotron-H).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Llama 4: the routing weight scales each chosen expert's input (rounded to the model dtype), not its output.
    moe_weight_input: bool = False
    # DeepSeek-V3: multi-head latent attention's widths (models/mla.py); None: attention as above.
    mla: MLADims | None = None
    # --- hybrid models (models/hybrid.py): recurrent layers beside attention, named in layer_types --
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims only (Qwen3.5: 0.25)
    # Interleaved multimodal rotary (Qwen3.5 / Qwen3-VL): frequencies per axis (t, h, w); used only where a forward
    # gets rope_positions (image prompts), text positions rotate as plain rope. (): none.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: the DeepStack levels the mmproj must hand (llama.cpp's n_deepstack_layers; its input rows are
    # hidden * (1 + levels) wide). None: not stated (a Hub directory's tower comes from the same config.json).
    num_deepstack_levels: int | None = None
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a gate; attention output * sigmoid(gate)
    conv_kernel_size: int = 0  # the short convolution's width (LFM2's L_cache, DeltaNet's and Mamba2's conv)
    conv_bias: bool = False
    # Gated DeltaNet (Qwen3.5 / Qwen3-Next "linear_attention" layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Mamba2 (models/mamba2_mixer.py): "mamba" layers, and Falcon-H1's "hybrid" ones; its conv is conv_kernel_size
    # wide with conv_bias. Heads of a group share B and C; the gated norm runs per group.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0  # N: the state of one head is (mamba_head_dim, N)
    mamba_num_groups: int = 0
    mamba_proj_bias: bool = False  # in_proj and out_proj biases
    mamba_dt_min: float = 0.0  # dt clamped to [min, max] (transformers' time_step_limit)
    mamba_dt_max: float = math.inf
    mamba_rms_norm: bool = True  # False (a Falcon-H1 option): y * silu(z) without the gated norm
    mamba_norm_before_gate: bool = False  # Falcon-H1's option; Mamba2's norm gates first
    use_rope: bool = True  # False: attention without rotary (NoPE: Granite 4.0-H, Nemotron-H, Mamba2)
    # Falcon-H1's µP multipliers, folded at load into the weights they scale (models/hybrid.py)
    mamba_in_multiplier: float = 1.0  # on the Mamba2 input (in_proj's weight, not its bias)
    mamba_section_multipliers: tuple[float, ...] = ()  # on in_proj's z, x, B, C and dt outputs; empty: all 1
    mamba_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0  # on the attention input (q, k, v weights)
    attention_key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0
    # --- Gemma 4 (models/gemma4.py, gemma4_model.py): per-layer shapes, shared K/V, per-layer embeddings ------
    # Per layer where layers differ (Gemma 4's global layers: wider heads, fewer K/V heads; its K/V-sharing
    # layers: a double-wide MLP); empty: every layer has head_dim, num_key_value_heads, intermediate_size.
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()
    # Per layer, the layer whose K/V it attends over: itself where it computes and caches its own, an earlier
    # layer of the same kind where it only reads that one's cache (Gemma 4's last num_kv_shared_layers). Empty: own.
    kv_source_layers: tuple[int, ...] = ()
    attention_k_eq_v: bool = False  # Gemma 4: full-attention layers take v from k's projection (before k's norm)
    v_norm: bool = False  # Gemma 4: an RMSNorm without weight on each value head
    # Per-layer embeddings (PLE): a (vocab_size_per_layer_input, layers x this) table plus a projection of the
    # embeddings, fed to every layer through a gate after its MLP (0: none).
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    # --- Gemma 3n (models/gemma3n.py, gemma3n_model.py) ------------------------------------------------------
    # AltUp: the hidden state as this many streams (0: one, no AltUp); each layer runs on stream altup_active_idx,
    # predicted from all of them, then corrects all by its output (scaled per channel with altup_correct_scale).
    altup_num_inputs: int = 0
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    laurel_rank: int = 0  # LAuReL: a low-rank residual branch (left then right projection, normed) beside attention
    # Per layer, the share of MLP gate activations a gaussian top-k zeroes (mean + std * Phi^-1(share)); empty: none.
    activation_sparsity: tuple[float, ...] = ()
    # --- pooling models (embedders, rerankers: models/pooling.py) -------------------------------------------
    # Every token of a sequence sees every other (encoders: BERT, XLM-RoBERTa, ModernBERT; EmbeddingGemma): the
    # whole sequence runs in one forward and leaves no K/V behind (engine/scheduler.py, models/encoder_attention.py).
    bidirectional: bool = False
    # BERT-style absolute position embeddings (models/bert.py): a position p reads row p + position_offset of the
    # table (XLM-RoBERTa counts from pad_token_id + 1 = 2); max_position_embeddings is then the longest input, the
    # table's rows less the offset.
    position_offset: int = 0
    type_vocab_size: int = 0  # rows of the token type (segment) table (BERT 2, XLM-R 1); every token is type 0
    layer_norm_eps: float = 1e-12  # the encoders' LayerNorms (mean and variance, with bias); rms_norm_eps is RMSNorm's
    # A cross-encoder's pooled row, which its classifier head reads: "cls" (the first token's) or "mean" (of every
    # token: ModernBertForSequenceClassification's classifier_pooling, as gte-reranker-modernbert's)
    classifier_pooling: str = "cls"

    def __post_init__(self) -> None:
        if families.get(self.architecture) is None:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(families.architectures())}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                   f"{self.num_hidden_layers} layers")
        if set(self.layer_types) - set(ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES + PARALLEL_LAYER_TYPES
                                       + CHANNEL_LAYER_TYPES):
            raise ModelConfigError(f"unsupported layer types {sorted(set(self.layer_types))}")
        if self.is_hybrid and self.conv_kernel_size < 2:
            raise ModelConfigError(f"a recurrent layer needs a convolution width of at least 2, got "
                                   f"{self.conv_kernel_size!r}")
        if "linear_attention" in self.layer_types and (
                min(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                    self.linear_value_head_dim) <= 0 or self.linear_num_value_heads % self.linear_num_key_heads):
            raise ModelConfigError("gated DeltaNet layers need positive linear head counts and dims, with value "
                                   "heads a multiple of key heads")
        self._check_mamba()
        self._check_per_layer()
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty "
                                   f"rotary width")
        if self.norm_layout not in LAYOUT_NORMS:
            raise ModelConfigError(f"unknown norm layout {self.norm_layout!r}")
        if self.hidden_act not in ("silu", "gelu_tanh", "relu2", "xielu", "gelu") or (
                self.hidden_act == "relu2" and not families.is_hybrid(self.architecture)) or (
                self.hidden_act == "xielu" and (families.is_hybrid(self.architecture) or self.num_experts)) or (
                self.hidden_act == "gelu" and not self.bidirectional):
            raise ModelConfigError(f"unsupported hidden activation {self.hidden_act!r} (supported: silu, gelu_tanh; "
                                   f"relu2 in hybrid models; xielu in dense ones; gelu in encoders)")
        if self.position_offset < 0 or self.type_vocab_size < 0:
            raise ModelConfigError(f"position_offset ({self.position_offset}) and type_vocab_size "
                                   f"({self.type_vocab_size}) must be >= 0")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ModelConfigError(f"unsupported classifier pooling {self.classifier_pooling!r} (supported: cls, mean)")
        if self.attn_temperature_beta and self.attn_temperature_length <= 0:
            raise ModelConfigError("an attention temperature needs a positive length (original context)")
        if self.attention_chunk < 0:
            raise ModelConfigError(f"attention_chunk must be >= 0, got {self.attention_chunk!r}")
        if any(not 0 <= i < self.num_hidden_layers for i in self.no_rope_layers):
            raise ModelConfigError(f"no_rope_layers {self.no_rope_layers} names layers past {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                                   f"({self.num_experts})")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelConfigError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")
        if self.moe_scoring not in ("softmax", "sigmoid", "topk_softmax"):
            raise ModelConfigError(f"unsupported MoE router scoring {self.moe_scoring!r} (supported: softmax, sigmoid, "
                                   f"topk_softmax)")
        if self.moe_activation not in ("swiglu", "swiglu_oai"):
            raise ModelConfigError(f"unsupported expert activation {self.moe_activation!r} (supported: swiglu, "
                                   f"swiglu_oai)")
        if self.num_experts and (self.num_experts % self.moe_num_groups
                                 or not 0 < self.moe_topk_groups <= self.moe_num_groups
                                 or (self.moe_num_groups > 1 and self.num_experts // self.moe_num_groups < 2)):
            raise ModelConfigError(f"group-limited routing: {self.num_experts} experts in {self.moe_num_groups} "
                                   f"groups (at least 2 each when grouped), top {self.moe_topk_groups} groups")

    def _check_mamba(self) -> None:
        if not {"mamba", "hybrid"} & set(self.layer_types):
            return
        sizes = (self.mamba_num_heads, self.mamba_head_dim, self.mamba_state_size, self.mamba_num_groups)
        if min(sizes) <= 0 or self.mamba_num_heads % self.mamba_num_groups:
            raise ModelConfigError(f"Mamba2 layers need positive heads, head dim, state size and groups, with heads a "
                                   f"multiple of groups; got {sizes}")
        if not 0.0 <= self.mamba_dt_min <= self.mamba_dt_max:
            raise ModelConfigError(f"Mamba2 dt limits ({self.mamba_dt_min}, {self.mamba_dt_max}) are out of order")
        if self.mamba_section_multipliers and len(self.mamba_section_multipliers) != 5:
            raise ModelConfigError(f"mamba_section_multipliers needs 5 entries (z, x, B, C, dt), got "
                                   f"{len(self.mamba_section_multipliers)}")

    def _check_per_layer(self) -> None:
        for name in ("layer_head_dims", "layer_kv_heads", "layer_intermediate_sizes", "kv_source_layers",
                     "activation_sparsity"):
            values = getattr(self, name)
            if values and len(values) != self.num_hidden_layers:
                raise ModelConfigError(f"{name} has {len(values)} entries for {self.num_hidden_layers} layers")
        if any(not 0.0 <= share < 1.0 for share in self.activation_sparsity):
            raise ModelConfigError(f"activation_sparsity {self.activation_sparsity} must lie in [0, 1)")
        if self.altup_num_inputs and not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise ModelConfigError(f"altup_active_idx {self.altup_active_idx} outside {self.altup_num_inputs} inputs")
        if any(self.num_attention_heads % self.layer_num_kv_heads(i) for i in range(self.num_hidden_layers)):
            raise ModelConfigError(f"layer_kv_heads {self.layer_kv_heads} must divide {self.num_attention_heads} heads")
        for i, src in enumerate(self.kv_source_layers):
            # a reader must find its source's K/V already written, and read them as that layer wrote them
            if not 0 <= src <= i or self.kv_source(src) != src or self.window(src) != self.window(i) or (
                    self.layer_head_dim(src), self.layer_num_kv_heads(src)) != (self.layer_head_dim(i),
                                                                                self.layer_num_kv_heads(i)):
                raise ModelConfigError(f"layer {i} cannot read the K/V of layer {src} (kv_source_layers)")

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def layer_intermediate_size(self, layer: int) -> int:
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def kv_source(self, layer: int) -> int:
        """The layer whose cached K/V `layer` attends over (itself unless it shares an earlier layer's)."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs a sparse mixture-of-experts MLP."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (instead of or beside K/V: models/hybrid.py)."""
        return any(kind in RECURRENT_LAYER_TYPES + PARALLEL_LAYER_TYPES for kind in self.layer_types)

    def layer_kind(self, layer: int) -> str:
        """`full_attention`, `sliding_attention`, a recurrent kind (RECURRENT_LAYER_TYPES), Falcon-H1's
        `hybrid` or a channel-only kind (CHANNEL_LAYER_TYPES)."""
        if self.layer_types:
            return self.layer_types[layer]
        return "sliding_attention" if self.is_sliding(layer) else "full_attention"

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K/V in the block pool (all of them but a hybrid's recurrent and channel-only ones)."""
        return sum(1 for i in range(self.num_hidden_layers)
                   if self.layer_kind(i) in ATTENTION_LAYER_TYPES + PARALLEL_LAYER_TYPES)

    @property
    def rotary_dim(self) -> int:
        """Rotated dims of each attention head (0: no rotary, `use_rope` off)."""
        return int(self.head_dim * self.partial_rotary_factor) if self.use_rope else 0

    def layer_rotary_dim(self, layer: int) -> int:
        """Rotated dims of each head in `layer` (0 on a NoPE layer)."""
        return 0 if layer in self.no_rope_layers else self.rotary_dim

    @property
    def mamba_inner_size(self) -> int:
        """Mamba2's width between in_proj and out_proj: heads x head dim (transformers' intermediate_size)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def layer_norm_names(self) -> tuple[str, ...]:
        return LAYOUT_NORMS[self.norm_layout]

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window (all layers when there are no layer types)."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int:
        """The attention window of `layer` in tokens (0: the whole history)."""
        return int(self.sliding_window) if self.is_sliding(layer) else 0

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict; a family file adds what its config changes (its Family's
        hf_fields, models/family.py)."""
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type is None and archs:
            model_type = str(archs[0]).replace("ForCausalLM", "").lower()
        multimodal = families.multimodal_text_types()
        if model_type in multimodal and "text_config" in raw:
            return cls.from_hf_dict(_text_config(raw, multimodal[model_type]))
        family = families.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} (architectures={archs}); "
                f"supported: {', '.join(families.architectures())}"
            )
        raw = _decode_floats(raw)
        try:
            # transformers >= 5 nests rope settings in rope_parameters; older files keep them top-level.
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            # Qwen3.5's multimodal rope: text positions are the same on all three axes, so its sections
            # rotate exactly as plain rope does; only the rotary width stays.
            partial_rotary = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
            for key in ("mrope_section", "mrope_interleaved"):
                rope.pop(key, None)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            try:
                fields = family.hf_fields(raw) if family.hf_fields is not None else {}
            except NotImplementedError as exc:  # a family file names what it cannot run
                raise ModelConfigError(f"{model_type}: {exc} is not supported") from exc
            # Llama's reading of each field, run only where the family does not set it (Mamba2 has no heads).
            base: dict[str, Callable[[], Any]] = dict(
                architecture=lambda: model_type,
                vocab_size=lambda: int(raw["vocab_size"]),
                hidden_size=lambda: int(raw["hidden_size"]),
                intermediate_size=lambda: int(raw["intermediate_size"]),
                num_hidden_layers=lambda: int(raw["num_hidden_layers"]),
                num_attention_heads=lambda: int(raw["num_attention_heads"]),
                num_key_value_heads=lambda: int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                head_dim=lambda: int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])),
                rms_norm_eps=lambda: float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=lambda: rope_theta,
                rope_scaling=lambda: rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
                max_position_embeddings=lambda: int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=lambda: bool(raw.get("tie_word_embeddings", False)),
                attention_bias=lambda: bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=lambda: model_type == "qwen3",
                mlp_bias=lambda: bool(raw.get("mlp_bias", False)),  # Llama's option, off in every release
                # Qwen2's per-layer windows (use_sliding_window) are not supported; it runs full attention.
                sliding_window=lambda: raw.get("sliding_window") if model_type == "mistral" else None,
                bos_token_id=lambda: raw.get("bos_token_id"),
                eos_token_ids=lambda: eos_ids,
                partial_rotary_factor=lambda: partial_rotary,
            )
            return cls(**{**{name: read() for name, read in base.items() if name not in fields}, **fields})
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"malformed model config: {exc!r}") from exc


def _decode_floats(value: Any) -> Any:
    """transformers 5 writes non-finite floats in config.json as {"__float__": "Infinity"} (Mamba2's dt limit)."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {key: _decode_floats(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value
def _text_config(raw: dict[str, Any], text_type: str) -> dict[str, Any]:
    """A multimodal config's text model: its text_config, with what only the wrapper says."""
    family = families.get(text_type)
    defaults = family.multimodal_text_defaults if family is not None else {}
    text = {**defaults, **raw["text_config"], "model_type": text_type}
    # transformers ties the head by the wrapper's tie_word_embeddings (Qwen3.5's default: untied)
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    return text


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep the sparse MLP: `model.layers.N.{block}.gate.weight` (router) and
    `model.layers.N.{block}.experts.{e}.{gate|up|down}.weight`, as on the Hub (transformers 5 saves them so too),
    unless the fields after `down` say otherwise.

    `prefix` is the layer's, with its dot: `model.layers.N.`."""

    block: str
    gate: str  # "" where the experts have no gate (Nemotron-H's relu^2 experts)
    up: str
    down: str
    router_name: str = "gate"  # Granite 4.0-H: router.layer
    bias: str = "expert_bias"  # the choice-only expert bias (Nemotron-H: gate.e_score_correction_bias)
    shared_block: str = "shared_expert"  # Nemotron-H: shared_experts
    # All experts in one tensor per part, gate|up (E, 2I, H) and down (E, H, I): Qwen3.5-MoE on the Hub, Granite 4.0-H
    stacked_parts: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
    stacked_transposed: bool = False  # Llama 4: gate|up (E, H, 2I) and down (E, I, H), inputs first
    # Qwen3-VL-MoE: the Hub's files are inputs first, transformers 5 saves (E, 2I, H) / (E, H, I): each layer's
    # layout read from its down tensor's shape (stacked_transposed where it is (E, I, H))
    stacked_layout_by_shape: bool = False
    stacked_interleaved: bool = False  # GPT-OSS: gate and up alternate along the 2I axis (gate first)

    def router(self, prefix: str) -> str:
        return f"{prefix}{self.block}.{self.router_name}.weight"

    def router_bias(self, prefix: str) -> str:
        return f"{prefix}{self.block}.{self.router_name}.bias"

    def expert_linear_bias(self, prefix: str, expert: int, part: str) -> str:
        """GPT-OSS: the bias of expert `expert`'s `part` (gate, up or down)."""
        return f"{prefix}{self.block}.experts.{expert}.{getattr(self, part)}.bias"

    def expert(self, prefix: str, expert: int, part: str) -> str:
        """`part`: gate, up or down."""
        return f"{prefix}{self.block}.experts.{expert}.{getattr(self, part)}.weight"

    def stacked(self, prefix: str, part: str) -> str:
        """`part`: `gate_up` or `down` (checkpoint.unstack_experts splits them into the per-expert names)."""
        return f"{prefix}{self.block}.{self.stacked_parts[part == 'down']}"

    def shared(self, prefix: str, part: str) -> str:
        """The shared expert's `part` (gate, up or down) of Qwen3-Next / Qwen3.5-MoE / Nemotron-H."""
        return f"{prefix}{self.block}.{self.shared_block}.{getattr(self, part)}.weight"

    def shared_gate(self, prefix: str) -> str:
        return f"{prefix}{self.block}.shared_expert_gate.weight"

    def expert_bias(self, prefix: str) -> str:
        return f"{prefix}{self.block}.{self.bias}"


