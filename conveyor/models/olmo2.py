"""OLMo 2: norms after attention and after the MLP only (none before), and QK-norm over the whole
q and k projections (one RMSNorm across all heads, before they are split), as transformers' Olmo2."""

from __future__ import annotations

from typing import Any


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(norm_layout="post", qk_norm=True, qk_norm_scope="full",
                attention_bias=bool(raw.get("attention_bias", False)))
