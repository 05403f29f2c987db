"""Gemma 2 and Gemma 3 (text): what they change in the shared decoder (models/llama.py).

(1 + w) RMSNorms (the 1 added at load), norms before and after attention and MLP ("sandwich"),
GeGLU with tanh-GELU, embeddings scaled by sqrt(hidden), softmax scale from query_pre_attn_scalar,
and sliding-window attention on the local layers. Gemma 3 adds per-head QK-norm and its own rope
base on the local layers; Gemma 2 soft-caps attention scores and final logits. EmbeddingGemma is Gemma 3
run bidirectionally (use_bidirectional_attention; GGUF `gemma-embedding`): a pooling model whose sliding layers
attend a band either side, each text whole in one forward (models/encoder_attention.py).
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models.family import Family, gguf_layer_types, register

# Layers in llama.cpp's Gemma *27B* (scaled by hidden / heads, not head_dim: gemma_pytorch's config).
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# llama.cpp's ffn_norm is Gemma's norm before the MLP (its post_attention_layernorm is post_attention_norm).
GGUF_TENSORS = {"ffn_norm": "pre_feedforward_layernorm"}


def layer_types(raw: dict[str, Any], num_layers: int, default_pattern: int) -> tuple[str, ...]:
    """Per layer sliding/full: `layer_types` when the config lists them, else every `pattern`-th layer is global."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    pattern = int(raw.get("sliding_window_pattern") or default_pattern)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    gemma3 = raw.get("model_type") != "gemma2"
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    fields: dict[str, Any] = dict(
        hidden_act=_activation(raw), norm_layout="sandwich", norm_weight_offset=1.0,
        embedding_multiplier=math.sqrt(hidden), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_scale=float(raw.get("query_pre_attn_scalar") or int(raw.get("head_dim") or hidden // heads)) ** -0.5,
        sliding_window=raw.get("sliding_window"),
        layer_types=layer_types(raw, layers, 6 if gemma3 else 2),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    if gemma3:
        fields.update(qk_norm=True, **_gemma3_rope(raw))
    if gemma3 and raw.get("use_bidirectional_attention"):
        fields.update(_bidirectional(raw))
    return fields


def _bidirectional(raw: dict[str, Any]) -> dict[str, Any]:
    """EmbeddingGemma (Gemma3TextModel, use_bidirectional_attention): every layer attends both ways, a sliding one
    the keys j with |i - j| <= sliding_window // 2 (transformers' config makes the window sliding_window // 2 + 1,
    exclusive; llama.cpp's symmetric one is n_swa / 2 either side). Kept as the half window, as ModernBERT's."""
    if raw.get("attn_logit_softcapping"):
        raise NotImplementedError("attn_logit_softcapping with use_bidirectional_attention")
    window = raw.get("sliding_window")
    if window is not None and int(window) < 2:
        raise NotImplementedError(f"a bidirectional sliding_window of {window}")
    return dict(bidirectional=True, sliding_window=int(window) // 2 if window else None)


def _activation(raw: dict[str, Any]) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma activation {act!r} (supported: gelu_pytorch_tanh)")
    return "gelu_tanh"


def _gemma3_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Global layers: rope_theta (+ scaling); local layers: their own base, never scaled."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one dict per layer type
        full = dict(params["full_attention"] or {})
        local = dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1_000_000.0), local.get("rope_theta", 10_000.0)
    else:
        full = dict(raw.get("rope_scaling") or {})
        theta, local_theta = raw.get("rope_theta", 1_000_000.0), raw.get("rope_local_base_freq", 10_000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    return dict(rope_theta=float(theta), local_rope_theta=float(local_theta),
                rope_scaling=full if kind != "default" else None)


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Gemma2Model / Gemma3Model / EmbeddingGemma (`gemma-embedding`: bidirectional, the
    whole window in sliding_window): what the file leaves to the architecture."""
    gemma3 = base["architecture"] == "gemma3_text"
    embedding = meta("general.architecture") == "gemma-embedding"
    layers, hidden, heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
    per_head = (hidden // heads if layers == _GGUF_27B_LAYERS[base["architecture"]] and not embedding
                else base["head_dim"])
    # NOTE: no norm offset: the converter already stored (1 + w) in the file.
    fields: dict[str, Any] = dict(
        hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden),
        attention_scale=per_head ** -0.5, final_logit_softcapping=meta("final_logit_softcapping") or None,
        attn_logit_softcapping=meta("attn_logit_softcapping") or None)
    window = meta("attention.sliding_window")
    if window:
        fields.update(sliding_window=int(window) // 2 if embedding else int(window), layer_types=gguf_layer_types(
            meta("attention.sliding_window_pattern"), layers, 6 if gemma3 else 2))
    if embedding:
        fields.update(bidirectional=True)
    if gemma3:
        fields.update(local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)))
    return fields


# The instruction format, as in Google's tokenizer_config.json, for GGUF files converted without it: no system role,
# a system message is prepended to the first user turn; the assistant's role is "model"; an image part is
# `<start_of_image>` (the vision processor's marker, multimodal/gemma3.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


# Gemma3TextConfig's defaults (transformers) for the fields we read: google/gemma-3-4b-it's config.json leaves them out.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                            max_position_embeddings=131_072, rms_norm_eps=1e-6, sliding_window=4096,
                            tie_word_embeddings=True)


register(Family("gemma2", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("gemma2",),
                gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS, chat_template=CHAT_TEMPLATE),
         Family("gemma3_text", "conveyor.models.llama:LlamaForCausalLM", hf_fields, multimodal_type="gemma3",
                multimodal_text_defaults=GEMMA3_TEXT_DEFAULTS,
                gguf_architectures=("gemma3", "gemma-embedding"), gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS,
                chat_template=CHAT_TEMPLATE))
