"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the shared decoder with q/k/v/o biases, YaRN rotary, sliding-window
(128) and full attention layers alternating by `layer_types`, a learnt attention sink per head (one more logit
in each softmax's denominator, with no value: in the attention kernel), and a sparse MoE in every layer whose
router has a bias, picks the top k logits and softmaxes over those k only, and whose experts have biases and
run OpenAI's clamped SwiGLU (`clamped_swiglu`).

Hugging Face keeps the experts stacked, inputs first, gate and up interleaved (gate = [..., ::2],
up = [..., 1::2]); checkpoint.unstack_experts splits them into per-expert views in our gate|up layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, gguf_layer_types, register

# transformers' GptOssConfig default when a config.json carries no rope parameters (every release has them).
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    # transformers' default: even layers slide, odd ones attend to everything
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = bool(raw.get("attention_bias", True))
    fields: dict[str, Any] = dict(
        attention_bias=bias, attention_out_bias=bias, attention_sinks=True,
        sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
        layer_types=tuple(types),
        num_experts=int(raw.get("num_local_experts", raw.get("num_experts", 128))),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(raw["intermediate_size"]),
        moe_scoring="topk_softmax", norm_topk_prob=False, moe_linear_bias=True,
        moe_activation="swiglu_oai", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        fields.update(rope_theta=float(raw.get("rope_theta", 150000.0)), rope_scaling=dict(DEFAULT_ROPE))
    return fields


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float,
                   sigmoid: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(M, 2I) gate|up halves -> (M, I): (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l).

    transformers' op order, each op rounded to the dtype as there; `sigmoid` is the backend's scalar-per-element
    one (torch's vector body and scalar tail may differ in the last bit, which would tie a row to its batch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * sigmoid(gate * alpha))


# stacked inputs first with gate and up interleaved, each with a stacked bias (`..._bias`)
EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", router_name="router", stacked_transposed=True,
                           stacked_interleaved=True)


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """What llama.cpp fixes for `gpt-oss` (src/models/openai-moe.cpp): sinks, biases everywhere, the top-k logits
    softmaxed (never renormalised), the clamped SwiGLU at alpha 1.702 and limit 7, every 2nd layer full attention by
    default.

    YaRN is kept untruncated, as every gpt-oss config.json says (`truncate: false`, OpenAI's reference); llama.cpp
    rounds the ramp's ends to whole dims (docs/models.md, known differences)."""
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn":
        scaling = dict(scaling, truncate=False)
    fields: dict[str, Any] = dict(rope_scaling=scaling, attention_sinks=True, moe_scoring="topk_softmax",
                                  moe_linear_bias=True, moe_activation="swiglu_oai", swiglu_alpha=1.702,
                                  swiglu_limit=7.0, norm_topk_prob=False)
    window = meta("attention.sliding_window")
    if window:
        fields.update(sliding_window=int(window), layer_types=gguf_layer_types(
            meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 2))
    return fields


# llama.cpp's sinks are a `.weight` tensor; HF's a bare parameter
register(Family("gpt_oss", "conveyor.models.moe_llama:MoEForCausalLM", hf_fields, expert_names=EXPERT_NAMES,
                gguf_architectures=("gpt-oss",), gguf_fields=gguf_fields,
                gguf_tensors={"attn_sinks.weight": "self_attn.sinks"}))
