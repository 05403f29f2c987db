"""DFlash (z-lab, arXiv 2602.06036): a block-diffusion drafter that proposes a whole block in one forward.

It reads the target's residual streams after several layers (dflash_config.target_layer_ids; layer L's output is
the stream entering L + 1, as `aux_hidden_states` counts) and fuses them once per target row into a context feature
c = hidden_norm(fc([a_L1 | a_L2 | ...])). NOTE: for the last layer that stream is before the final norm, where
transformers' hidden_states[-1] is after it; published drafters read earlier layers. Each drafter layer keeps K/V
of those features (k_proj / v_proj of c, never of the drafter's own stream), written as the target's rows arrive
(write_context). A draft reads

    block      x_p  MASK  MASK ... MASK            positions p .. p+k (x_p: the token the target has not seen)
    input      embed(block) * input_embedding_scale                    # the target's embedding
    layer      q, k, v from input_layernorm(h); keys = context K/V at 0..p-1 + the block's own K/V, every block
               row seeing the whole block (non-causal: the kernels' key_end), then o_proj, residual, MLP
    out        norm(h); row i (1..k) -> logits = lm_head(out_i) * output_multiplier (softcapped) -> d_i

Q/K are RMS-normed per head (Qwen3's q_norm / k_norm) before the rotary, as the published model does. The
embedding and LM head are the target's (shared, not copied); the rotary tables the drafter's config's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.draft_vocab import DraftVocabHead
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.llama import LlamaAttention, LlamaMLP, Rope
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # the drafter layers' shape (a Qwen3 config: heads, MLP, rope, eps, num_hidden_layers)
    target_layer_ids: tuple[int, ...] | None  # the target layers whose outputs it reads (None: the default)
    block_size: int  # the block it was trained on: at most block_size - 1 drafts per forward
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    num_target_layers: int | None = None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        """From the drafter's config.json: a Qwen3 config with dflash_config (fields there or top-level, as the
        reference's _draft_value reads them)."""
        archs = raw.get("architectures") or [ARCHITECTURE]
        if archs[0] != ARCHITECTURE:  # DFlash2 adds convolutions and a candidate selector
            raise ModelConfigError(f"architecture {archs[0]} is not a DFlash drafter conveyor runs ({ARCHITECTURE})")
        extra = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, raw.get(name, default))

        if value("mask_token_id") is None:
            raise ModelConfigError("config.json has no dflash_config.mask_token_id")
        types = raw.get("layer_types") or ()
        if value("is_causal") or any(t != "full_attention" for t in types):
            raise ModelConfigError("causal or sliding-window DFlash layers are not supported (the block attends "
                                   "both ways over full context)")
        layer_raw = {k: v for k, v in raw.items() if k not in ("architectures", "layer_types", "sliding_window",
                                                               "use_sliding_window")}
        layer_raw.setdefault("model_type", "qwen3")
        layer = replace(ModelConfig.from_hf_dict(layer_raw), qk_norm=True)
        ids = value("target_layer_ids")
        return cls(layer=layer, target_layer_ids=tuple(int(i) for i in ids) if ids is not None else None,
                   block_size=int(value("block_size", 16)), mask_token_id=int(value("mask_token_id")),
                   input_embedding_scale=float(value("input_embedding_scale", 1.0) or 1.0),
                   output_multiplier=float(value("output_multiplier", 1.0) or 1.0),
                   final_logit_softcapping=float(value("final_logit_softcapping", 0.0) or 0.0),
                   num_target_layers=int(raw["num_target_layers"]) if raw.get("num_target_layers") else None)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's pick when the config names none: one per drafter layer, evenly from layer 1 to N - 3 (the
    middle layer for a one-layer drafter)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def checkpoint_names(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """The drafter's tensors without a leading model. (layers.N.*, fc, hidden_norm, norm)."""
    return {name.removeprefix("model."): weight for name, weight in weights.items()}


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.self_attn = LlamaAttention(config, ops, 0)  # over the block: fused qkv, per-head q/k norm, rotary
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.mlp = LlamaMLP(config, ops)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        residual, y = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return residual + self.mlp(y)


class DFlashHead(nn.Module):
    def __init__(self, spec: DFlashConfig, target_layer_ids: tuple[int, ...], target_config: ModelConfig,
                 ops: KernelBackend, target: nn.Module) -> None:
        super().__init__()
        cfg = spec.layer
        if cfg.hidden_size != target_config.hidden_size:
            raise ModelConfigError(f"DFlash drafter hidden size {cfg.hidden_size} does not match the target's "
                                   f"{target_config.hidden_size}")
        if cfg.rotary_dim != cfg.head_dim:
            raise ModelConfigError("DFlash drafter with partial rotary is not supported")
        hidden = cfg.hidden_size
        self.config, self.ops, self.spec = cfg, ops, spec
        # the stream after target layer L is the one entering L + 1 (aux id 0 is the embedding)
        self.aux_layer_ids = tuple(i + 1 for i in target_layer_ids)
        self.vocab_size = target_config.vocab_size
        self.fc = RowInvariantLinear(len(target_layer_ids) * hidden, hidden, False, ops)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.layers = nn.ModuleList(DFlashLayer(cfg, ops) for _ in range(cfg.num_hidden_layers))
        # Every layer's k_proj | v_proj over the context in one GEMM, and their k_norm weights side by side: the
        # context K/V is written for every target row, so its op count is paid on every step.
        self.num_kv_heads, self.kv_size = cfg.num_key_value_heads, cfg.num_key_value_heads * cfg.head_dim
        self.context_kv = RowInvariantLinear(hidden, len(self.layers) * 2 * self.kv_size, cfg.attention_bias, ops)
        self.register_buffer("context_k_norm", torch.ones(len(self.layers) * self.num_kv_heads, cfg.head_dim),
                             persistent=False)  # (L * KVH, D)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max(cfg.max_position_embeddings,
                                                          target_config.max_position_embeddings),
                                      cfg.rope_theta, cfg.rope_scaling)
        self.draft_vocab: DraftVocabHead | None = None  # --draft-vocab: the target head's rows for a subset of ids
        # NOTE: a tuple, not an attribute: the target's modules must not count as this drafter's (weights, meta check).
        self._shared = (target,)

    def cache_specs(self) -> list[CacheSpec]:
        return [KVSpec(self.config.num_key_value_heads, self.config.head_dim, 0) for _ in self.layers]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's streams (T, n * H) -> context features (T, H)."""
        return self.hidden_norm(self.fc(aux))

    @torch.inference_mode()
    def write_context(self, context: torch.Tensor, positions: torch.Tensor, caches: list,
                      slot_mapping: torch.Tensor) -> None:
        """Every layer's K/V of the context features (T, H) at their positions (T,) and cache slots (T,)."""
        num_tokens, num_layers, d = context.shape[0], len(self.layers), self.config.head_dim
        kv = self.context_kv(context).view(num_tokens, num_layers, 2, self.num_kv_heads, d)
        k = kv[:, :, 0].reshape(num_tokens, num_layers * self.num_kv_heads, d)  # (T, L * KVH, D)
        ones = torch.ones(d, dtype=k.dtype, device=k.device)
        k = self.ops.rms_norm(k, ones, self.config.rms_norm_eps) * self.context_k_norm
        k = RotaryEmbedding.apply(k, *self.rotary.tables(positions, context.dtype))
        k = k.view(num_tokens, num_layers, self.num_kv_heads, d)
        for i, cache in enumerate(caches[:num_layers]):
            self.ops.write_kv(cache[0], cache[1], k[:, i].contiguous(), kv[:, i, 1].contiguous(), slot_mapping)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids (T,): blocks [x_p, MASK, ...]; meta.key_end lets each block row see its whole block -> the
        drafter's normed output (T, H). The blocks' K/V land in the cache at their slots (overwritten by the
        context's once the target has verified those positions)."""
        embed = self._shared[0].embed_tokens
        x = embed(input_ids)  # (T, H)
        if self.spec.input_embedding_scale != 1.0:
            x = x * self.spec.input_embedding_scale
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed outputs (R, H) -> float32 logits over the target's vocabulary (R, V), by the target's LM head."""
        return self._scale(self._shared[0].lm_head(hidden).float())

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits (R, N), their target ids (N,)) over the draft vocabulary (--draft-vocab), or the full (R, V)
        logits and None without one."""
        if self.draft_vocab is None:
            return self.compute_logits(hidden), None
        return self._scale(self.draft_vocab(hidden)), self.draft_vocab.token_ids

    def _scale(self, logits: torch.Tensor) -> torch.Tensor:
        if self.spec.output_multiplier != 1.0:
            logits = logits * self.spec.output_multiplier
        if self.spec.final_logit_softcapping > 0:
            logits = self.ops.softcap(logits, self.spec.final_logit_softcapping)
        return logits

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """From checkpoint_names' names: fc, hidden_norm, norm, layers.N.{self_attn,mlp,*_layernorm}.*."""
        get, norm = tensor_getters(weights, loader, 0.0)
        self.hidden_norm.weight = norm("hidden_norm.weight")
        self.norm.weight = norm("norm.weight")
        loader.linear(self.fc, [get("fc.weight")])
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            layer.input_layernorm.weight = norm(f"{p}input_layernorm.weight")
            layer.post_attention_layernorm.weight = norm(f"{p}post_attention_layernorm.weight")
            attn, a = layer.self_attn, f"{p}self_attn."
            attn.q_norm.weight = norm(f"{a}q_norm.weight")
            attn.k_norm.weight = norm(f"{a}k_norm.weight")
            biased = self.config.attention_bias

            def bias(names: str) -> list[Weight] | None:
                return [get(f"{a}{n}_proj.bias") for n in names] if biased else None

            loader.linear(attn.qkv_proj, [get(f"{a}{n}_proj.weight") for n in "qkv"], bias("qkv"))
            attn.o_proj = RowInvariantLinear(attn.q_size, self.config.hidden_size, biased, self.ops)
            loader.linear(attn.o_proj, [get(f"{a}o_proj.weight")], bias("o"))
            loader.linear(layer.mlp.gate_up_proj, [get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")])
            loader.linear(layer.mlp.down_proj, [get(f"{p}mlp.down_proj.weight")])
        names = [f"layers.{i}.self_attn.{n}_proj" for i in range(len(self.layers)) for n in "kv"]
        biases = [get(f"{n}.bias") for n in names] if self.config.attention_bias else None
        loader.linear(self.context_kv, [get(f"{n}.weight") for n in names], biases)
        heads = self.num_kv_heads
        self.context_k_norm = torch.cat([layer.self_attn.k_norm.weight.detach().expand(heads, -1)
                                         for layer in self.layers])