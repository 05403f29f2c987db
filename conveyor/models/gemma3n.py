"""Gemma 3n (text): what its config says, and the tensors its checkpoints hold (the model: gemma3n_model.py).

Shared with Gemma 4 (gemma4.py): RMSNorms scaling by w, softmax scale 1 with q/k/v RMS-normed per head (v without a
weight), the last `num_kv_shared_layers` layers reading earlier layers' K/V, per-layer embeddings (PLE). Its own:
AltUp (the hidden state is `altup_num_inputs` streams; each layer runs on one, predicted from all by per-token
coefficients, then corrects all by the layer's output), LAuReL (a low-rank branch beside attention), a per-layer
MLP width, and activation sparsity (a gaussian top-k on the MLP gate of the first layers). Every layer shares one
head dim; sliding and global layers rotate with their own bases.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models import gemma, gemma4
from conveyor.models.family import Family, gguf_layer_types, register
from conveyor.models.kv_sharing import kv_sources


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("attention_bias"):
        raise NotImplementedError("attention_bias")
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    types = raw.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                       for i in range(layers)]
    widths = raw["intermediate_size"]
    widths = tuple(int(w) for w in widths) if isinstance(widths, list) else (int(widths),) * layers
    sparsity = raw.get("activation_sparsity_pattern")
    if sparsity is None:
        sparse = 10 if layers > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (layers - sparse)
    sparsity = tuple(float(s) for s in (sparsity if isinstance(sparsity, list) else [sparsity] * layers))
    sources = kv_sources(list(types), int(raw.get("num_kv_shared_layers", 15) or 0))
    streams = int(raw.get("altup_num_inputs", 4))
    if not 0 <= int(raw.get("altup_active_idx", 0)) < streams:
        raise ValueError(f"altup_active_idx {raw.get('altup_active_idx')} outside {streams} AltUp inputs")
    params = raw.get("rope_parameters") or {}
    if (params.get("sliding_attention") or {}).get("rope_type", "default") != "default":
        raise NotImplementedError(f"sliding-layer rope_type {params['sliding_attention']['rope_type']!r}")
    return dict(
        hidden_act=gemma._activation(raw), norm_layout="sandwich", norm_weight_offset=0.0,
        embedding_multiplier=math.sqrt(hidden), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_scale=1.0, qk_norm=True, v_norm=True,
        sliding_window=int(raw.get("sliding_window") or 512), layer_types=tuple(types),
        final_logit_softcapping=raw.get("final_logit_softcapping", 30.0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        head_dim=int(raw.get("head_dim") or 256), intermediate_size=widths[0],
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (),
        kv_source_layers=sources if sources != tuple(range(layers)) else (),
        hidden_size_per_layer_input=int(raw.get("hidden_size_per_layer_input", 256)),
        vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input", 262_144)),
        altup_num_inputs=streams, altup_active_idx=int(raw.get("altup_active_idx", 0)),
        altup_correct_scale=bool(raw.get("altup_correct_scale", True)), laurel_rank=int(raw.get("laurel_rank", 64)),
        activation_sparsity=sparsity if any(sparsity) else (),
        **gemma._gemma3_rope(raw),
    )


def weight_names(config) -> list[str]:
    """Every tensor a Gemma 3n text model loads, in Hugging Face naming, the token embeddings first."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.embed_tokens_per_layer.weight",
             "model.per_layer_model_projection.weight", "model.per_layer_projection_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for kind in ("altup_projections", "altup_unembed_projections"):
        names += [f"model.{kind}.{i}.weight" for i in range(config.altup_num_inputs - 1)]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight"]
        if config.kv_source(i) == i:
            names += [p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight", p + "self_attn.k_norm.weight"]
        names += [f"{p}mlp.{part}_proj.weight" for part in ("gate", "up", "down")]
        names += [f"{p}{norm}.weight" for norm in config.layer_norm_names]
        names += [p + "altup.correct_output_scale", p + "altup.correction_coefs.weight",
                  p + "altup.prediction_coefs.weight", p + "altup.modality_router.weight",
                  p + "altup.router_norm.weight"]
        names += [p + "laurel.linear_left.weight", p + "laurel.linear_right.weight",
                  p + "laurel.post_laurel_norm.weight"]
        names += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                  p + "post_per_layer_input_norm.weight"]
    return names


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Gemma3NModel: the sliding pattern per layer, MLP widths per layer, shared_kv_layers,
    AltUp's inputs and active stream, the PLE width, each layer's gaussian top-k as its std multiplier (Phi^-1 of
    the share; -inf where dense), LAuReL's rank from its tensor; norms hold w. llama.cpp itself fixes the sharing
    at 20 layers and the sparsity at 0.95 on the first 10: the released E2B and E4B say the same."""
    layers, hidden = base["num_hidden_layers"], base["hidden_size"]
    types = gguf_layer_types(meta("attention.sliding_window_pattern"), layers, 5)
    widths = meta("feed_forward_length")
    widths = tuple(int(n) for n in widths) if isinstance(widths, list) else ()
    sources = kv_sources(list(types), int(meta("attention.shared_kv_layers", 0) or 0))
    scales = meta("activation_sparsity_scale") or []
    shares = tuple(0.5 * (1.0 + math.erf(float(m) / math.sqrt(2.0))) for m in scales)  # the normal CDF: Phi(Phi^-1(s))
    return dict(
        hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden), attention_scale=1.0,
        qk_norm=True, qk_norm_scope="head", v_norm=True, sliding_window=int(meta("attention.sliding_window")),
        layer_types=types, final_logit_softcapping=meta("final_logit_softcapping") or None,
        local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (),
        kv_source_layers=sources if sources != tuple(range(layers)) else (),
        hidden_size_per_layer_input=int(meta("embedding_length_per_layer_input")),
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"][1]),
        altup_num_inputs=int(meta("altup.num_inputs", 4)), altup_active_idx=int(meta("altup.active_idx", 0)),
        laurel_rank=int(tensors["blk.0.laurel_l.weight"][1]),
        activation_sparsity=shares if any(shares) else ())


# llama.cpp's names: Gemma 4's (PLE), plus AltUp's and LAuReL's per-layer tensors (AltUp's output scale a bare
# tensor in HF) and AltUp's (un)embedding projections (one (n - 1, H, H) stack in the file, one HF tensor each)
GGUF_TENSORS = {**gemma4.GGUF_PLE_TENSORS,
                "altup_proj": "model.altup_projections.{}", "altup_unembd_proj": "model.altup_unembed_projections.{}",
                "altup_correct_coef": "altup.correction_coefs", "altup_predict_coef": "altup.prediction_coefs",
                "altup_router": "altup.modality_router", "altup_router_norm": "altup.router_norm",
                "altup_correct_scale.weight": "altup.correct_output_scale",
                "laurel_l": "laurel.linear_left", "laurel_r": "laurel.linear_right",
                "laurel_post_norm": "laurel.post_laurel_norm"}

register(Family("gemma3n_text", "conveyor.models.gemma3n_model:Gemma3nForCausalLM", hf_fields,
                weight_names=weight_names, multimodal_type="gemma3n", gguf_architectures=("gemma3n",),
                gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS))
