"""EAGLE3: a separate small drafter (one decoder layer) that reads three of the target's hidden states.

At position q the target hands over its residual stream entering three layers (low, mid, high: vLLM's default
2, N/2, N-3, or the checkpoint's eagle_aux_hidden_state_layer_ids); fc fuses them, and the drafter's one layer
reads the embedding of the token after q with that fused state (vLLM's llama_eagle3.py wiring):

    g = fc([a_low | a_mid | a_high])                                       # (T, 3H) -> (T, H), once per row
    residual = g                       (norm_before_residual: hidden_norm(g))
    x = [input_layernorm(embed(x_{q+1})) | hidden_norm(g)]                  # (T, 2H): the attention's input
    residual, y = post_attention_layernorm.add_and_norm(residual, attn(x))   # its own K/V at position q
    out = residual + mlp(y)                                                 # pre-norm: chained drafts read it
    logits = lm_head(norm(out)) over the draft vocabulary, placed at d2t     # other target tokens: -inf

Drafting k tokens chains the layer on its own pre-norm output in place of g (no fc). The embedding is the
target's unless the checkpoint has its own; the rotary tables are the drafter's (its config's rope).
Checkpoints: EAGLE3's (midlayer.*, a Llama config with draft_vocab_size) and the `speculators` format
(layers.0.*, the layer's config under transformer_layer_config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.llama import LlamaAttention, LlamaMLP
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

LAYER = "layers.0."  # the one layer's tensors (midlayer.* in EAGLE3's own checkpoints)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the drafter layer's shape: heads, MLP, rope, eps
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default for the target (default_aux_layer_ids)
    norm_before_residual: bool
    target_hidden_size: int

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "Eagle3Config":
        """From the drafter's config.json: EAGLE3's (a Llama config plus draft_vocab_size) or speculators'."""
        layer_raw = dict(raw.get("transformer_layer_config") or raw)
        layer_raw.pop("architectures", None)
        layer_raw.setdefault("model_type", "llama")
        layer = ModelConfig.from_hf_dict(layer_raw)
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                   aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size))


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's pick when the checkpoint names none: low, mid and high (the stream entering those layers)."""
    return 2, num_layers // 2, num_layers - 3


def checkpoint_names(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """The drafter's tensors under one naming: midlayer.* -> layers.0.*, a leading model. dropped."""
    out = {}
    for name, weight in weights.items():
        name = name.removeprefix("model.")
        out[LAYER + name[len("midlayer."):] if name.startswith("midlayer.") else name] = weight
    return out


class Eagle3Head(nn.Module):
    def __init__(self, spec: Eagle3Config, aux_layer_ids: tuple[int, ...], target_config: ModelConfig,
                 ops: KernelBackend, target: nn.Module) -> None:
        super().__init__()
        cfg = spec.layer
        if cfg.hidden_size != target_config.hidden_size or spec.target_hidden_size != target_config.hidden_size:
            raise ModelConfigError(f"EAGLE3 drafter hidden size {cfg.hidden_size} (target_hidden_size "
                                   f"{spec.target_hidden_size}) does not match the target's "
                                   f"{target_config.hidden_size}")
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config, self.ops, self.spec = cfg, ops, spec
        self.aux_layer_ids = aux_layer_ids
        self.vocab_size = target_config.vocab_size
        self.fc = RowInvariantLinear(len(aux_layer_ids) * hidden, hidden, False, ops)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.norm = RMSNorm(hidden, eps, ops)
        self.self_attn = LlamaAttention(replace(cfg, qk_norm=False), ops, 0)
        attn = self.self_attn
        self.self_attn.qkv_proj = RowInvariantLinear(2 * hidden, attn.q_size + 2 * attn.kv_size, cfg.attention_bias,
                                                     ops)  # reads [embedding | hidden]
        self.mlp = LlamaMLP(cfg, ops)
        self.lm_head = RowInvariantLinear(hidden, spec.draft_vocab_size, False, ops)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max(cfg.max_position_embeddings,
                                                          target_config.max_position_embeddings),
                                      cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens: nn.Module | None = None  # the checkpoint's own, else the target's
        self.register_buffer("draft_to_target", torch.arange(spec.draft_vocab_size), persistent=False)
        # NOTE: a tuple, not an attribute: the target's modules must not count as this drafter's (weights, meta check).
        self._shared = (target,)

    def cache_specs(self) -> list[CacheSpec]:
        return [KVSpec(self.config.num_key_value_heads, self.config.head_dim, 0)]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states (T, 3H) -> the drafter's hidden input g (T, H)."""
        return self.fc(aux)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids (T,): x_{q+1}; hidden (T, H): g_q (fused) or the previous draft's output; positions (T,): q
        -> the layer's pre-norm output (T, H), the next draft's hidden."""
        embed = self.embed_tokens if self.embed_tokens is not None else self._shared[0].embed_tokens
        embedded = self.input_layernorm(embed(input_ids))  # (T, H)
        hidden = hidden.to(embedded.dtype)
        normed = self.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        rope = self.rotary.tables(positions, embedded.dtype)
        attn_out = self.self_attn(torch.cat([embedded, normed], dim=-1), rope, caches[0], meta)  # (T, H)
        residual, y = self.post_attention_layernorm.add_and_norm(residual, attn_out)
        return residual + self.mlp(y)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs (R, H) -> float32 logits over the target's vocabulary (R, V): the draft vocabulary's
        at their target ids (d2t), -inf elsewhere."""
        draft = self.lm_head(self.norm(hidden)).float()  # (R, draft_vocab)
        if draft.shape[1] == self.vocab_size:
            return draft
        logits = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What drafts are picked from: (logits (R, draft_vocab), their target ids (d2t)), or the full (R, V)
        logits and None when the draft vocabulary is the target's (no -inf fill of the ids it never drafts)."""
        draft = self.lm_head(self.norm(hidden)).float()  # (R, draft_vocab)
        return (draft, None) if draft.shape[1] == self.vocab_size else (draft, self.draft_to_target)

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """From checkpoint_names' names: fc, layers.0.*, norm, lm_head, d2t (and embed_tokens, when it has one)."""
        get, norm = tensor_getters(weights, loader, 0.0)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(self, name).weight = norm(f"{LAYER}{name}.weight")
        self.norm.weight = norm("norm.weight")
        loader.linear(self.fc, [get("fc.weight")])
        attn, p = self.self_attn, f"{LAYER}self_attn."
        bias = [get(f"{p}{n}_proj.bias") for n in "qkv"] if self.config.attention_bias else None
        loader.linear(attn.qkv_proj, [get(f"{p}{n}_proj.weight") for n in "qkv"], bias)
        out_bias = [get(f"{p}o_proj.bias")] if f"{p}o_proj.bias" in weights else None  # as vLLM: with q/k/v's
        attn.o_proj = RowInvariantLinear(attn.q_size, self.config.hidden_size, out_bias is not None, self.ops)
        loader.linear(attn.o_proj, [get(f"{p}o_proj.weight")], out_bias)
        p = f"{LAYER}mlp."
        loader.linear(self.mlp.gate_up_proj, [get(f"{p}gate_proj.weight"), get(f"{p}up_proj.weight")])
        loader.linear(self.mlp.down_proj, [get(f"{p}down_proj.weight")])
        loader.linear(self.lm_head, [get("lm_head.weight")])
        if "embed_tokens.weight" in weights:
            self.embed_tokens = loader.embedding(get("embed_tokens.weight"))
        if "d2t" in weights:  # target id = draft id + d2t[draft id]
            d2t = weights["d2t"]
            self.draft_to_target = (torch.arange(d2t.shape[0]) + d2t.long().cpu()).to(loader.device)
        if int(self.draft_to_target.max()) >= self.vocab_size:
            raise ModelConfigError(f"EAGLE3 drafter's d2t maps past the target's vocabulary ({self.vocab_size})")
