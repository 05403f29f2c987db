"""SmolLM3: Llama with NoPE layers (no rotary on every `no_rope_layer_interval`-th layer, or as `no_rope_layers`
lists: 1 = rotary, 0 = NoPE), tied embeddings by default, and attention_bias covering o_proj too."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    interval = int(raw.get("no_rope_layer_interval") or 4)
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    bias = bool(raw.get("attention_bias", False))
    fields: dict[str, Any] = dict(no_rope_layers=tuple(i for i in range(layers) if not uses_rope[i]),
                                  attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
                                  tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                                  rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)))
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        # transformers slides the NoPE layers only (its layer_types); the rest see everything
        types = raw.get("layer_types") or ["full_attention" if uses_rope[i] else "sliding_attention"
                                           for i in range(layers)]
        fields.update(sliding_window=int(raw["sliding_window"]), layer_types=tuple(types))
    return fields


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    # llama.cpp hard-codes SmolLM3's NoPE step (every 4th layer) and ignores its window
    return dict(no_rope_layers=tuple(range(3, base["num_hidden_layers"], 4)))


register(Family("smollm3", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("smollm3",),
                gguf_fields=gguf_fields, gguf_permuted_qk=True))
