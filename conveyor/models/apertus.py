"""Apertus: Llama with per-head QK-norm, an ungated MLP down(xielu(up(x))) whose xIELU activation learns four
scalars per layer (alpha_p, alpha_n, beta, eps; layers.XIELU), and its two norms under their own names."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register

WEIGHT_RENAMES = {".attention_layernorm.": ".input_layernorm.", ".feedforward_layernorm.": ".post_attention_layernorm."}
# The activation's tensors under each layer's mlp.act_fn (alpha_p / alpha_n before their softplus).
XIELU_PARAMS = ("alpha_p", "alpha_n", "beta", "eps")


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "xielu") != "xielu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r} (supported: xielu)")
    bias = bool(raw.get("attention_bias", False))
    return dict(hidden_act="xielu", qk_norm=True, attention_bias=bias, attention_out_bias=bias)


# GGUF: xIELU's scalars live in the file's metadata (loading/gguf_loader.py reads them for hidden_act xielu); its q/k
# rows are not permuted (the converter sets undo_permute = False)
register(Family("apertus", "conveyor.models.llama:LlamaForCausalLM", hf_fields, WEIGHT_RENAMES,
                gguf_architectures=("apertus",), gguf_fields=lambda meta, base, tensors: dict(hidden_act="xielu")))
