"""DeepSeek-V3 (and checkpoints of its shape: Kimi K2, Moonlight): multi-head latent attention (models/mla.py) and
sparse MoE layers after the first `first_k_dense_replace` dense ones, routed by sigmoid scores with a choice-only
correction bias, group-limited (`n_group`, `topk_group`), renormalised and scaled by `routed_scaling_factor`,
beside `n_shared_experts` always-on experts (one ungated MLP of their summed width).
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register
from conveyor.models.mla_dims import MLADims, softmax_scale


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r}")
    if raw.get("attention_bias"):  # off in every release (q_a / kv_a / o biases)
        raise NotImplementedError("attention_bias")
    if raw.get("quantization_config"):  # the released V3 / R1 weights are block-fp8 with weight_scale_inv
        raise NotImplementedError(f"quantization_config {raw['quantization_config'].get('quant_method')!r} "
                                  f"(convert to bf16, or use a GGUF)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":  # V3's config says sigmoid; transformers assumes it
        raise NotImplementedError(f"scoring_func {raw['scoring_func']!r}")
    dims = MLADims(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                   qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                   v_head_dim=int(raw["v_head_dim"]), rope_interleave=bool(raw.get("rope_interleave", True)))
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    layers = int(raw["num_hidden_layers"])
    num_experts = int(raw.get("n_routed_experts") or 0)
    moe_width = int(raw.get("moe_intermediate_size") or 0)
    dense = layers if not num_experts else int(raw.get("first_k_dense_replace") or 0)
    return dict(
        mla=dims,
        # The paged cache keeps one "KV head" per token ([latent ; rotary key]); head_dim is the rotary width,
        # as transformers sets it, so the shared rotary table turns exactly the rope dims.
        num_key_value_heads=1, head_dim=dims.qk_rope_head_dim,
        attention_scale=softmax_scale(dims.qk_head_dim, rope),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=moe_width, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_scoring="sigmoid", moe_expert_bias=bool(num_experts), moe_renorm_eps=1e-20,
        moe_num_groups=int(raw.get("n_group") or 1), moe_topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_expert_intermediate_size=moe_width * int(raw.get("n_shared_experts") or 0) if num_experts else 0,
        dense_mlp_layers=tuple(range(min(dense, layers))),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", bias="gate.e_score_correction_bias",
                           shared_block="shared_experts")

def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """llama.cpp's `deepseek2` (src/models/deepseek2.cpp) as DeepSeek-V3: MLA widths from the lora ranks,
    key_length_mla / value_length_mla (older files: key_length / value_length) and rope.dimension_count; the
    rotary pairs stay interleaved in the file (llama.cpp's NORM rope, no permute); experts after
    leading_dense_block_count layers, routed by sigmoid (expert_gating_func 2) only."""
    rope_dim = int(meta("rope.dimension_count"))
    key_mla = meta("attention.key_length_mla")
    key_mla, value_mla = ((int(key_mla), int(meta("attention.value_length_mla"))) if key_mla is not None
                          else (base["head_dim"], int(meta("attention.value_length"))))
    dims = MLADims(q_lora_rank=int(meta("attention.q_lora_rank", 0)), kv_lora_rank=int(meta("attention.kv_lora_rank")),
                   qk_nope_head_dim=key_mla - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=value_mla)
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn" and meta("rope.scaling.yarn_log_multiplier"):
        # the converter wrote 0.1 * mscale_all_dim; the released configs have mscale == mscale_all_dim
        mscale = float(meta("rope.scaling.yarn_log_multiplier")) / 0.1
        scaling = dict(scaling, mscale=mscale, mscale_all_dim=mscale)
    layers, num_experts = base["num_hidden_layers"], int(meta("expert_count", 0))
    fields = dict(mla=dims, num_key_value_heads=1, head_dim=rope_dim, rope_scaling=scaling,
                  attention_scale=softmax_scale(key_mla, scaling or {}), dense_mlp_layers=tuple(range(layers)))
    if not num_experts:
        return fields
    if int(meta("expert_gating_func", 0)) != 2:  # llama.cpp's default is softmax (DeepSeek-V2)
        raise ValueError("deepseek2 routing other than sigmoid (expert_gating_func 2) is not supported")
    width, dense = int(meta("expert_feed_forward_length")), int(meta("leading_dense_block_count", 0))
    return dict(fields, num_experts=num_experts, num_experts_per_tok=int(meta("expert_used_count")),
                moe_intermediate_size=width, norm_topk_prob=bool(meta("expert_weights_norm", False)),
                moe_scoring="sigmoid", moe_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
                moe_renorm_eps=1e-20, moe_num_groups=int(meta("expert_group_count", 1) or 1),
                moe_topk_groups=int(meta("expert_group_used_count", 1) or 1),
                routed_scaling_factor=float(meta("expert_weights_scale", 1.0) or 1.0),
                shared_expert_intermediate_size=width * int(meta("expert_shared_count", 0)),
                dense_mlp_layers=tuple(range(min(dense, layers))))


# llama.cpp's names for the latent attention (models/mla.py): kv_b split per head into k_b (transposed) and v_b by
# newer converters (per-head stacks (H, N, K), which the loader reads as one (H * N, K) matrix), kept whole by older
# ones; the choice-only expert bias; the shared experts.
GGUF_TENSORS = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}}

register(Family("deepseek_v3", "conveyor.models.mla:DeepseekV3ForCausalLM", hf_fields, expert_names=EXPERT_NAMES,
                gguf_architectures=("deepseek2",), gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS))
