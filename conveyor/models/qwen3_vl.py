"""Qwen3-VL's text models: `qwen3_vl_text`, a dense Qwen3 (q / k RMSNorm per head), and `qwen3_vl_moe_text`, a
Qwen3-MoE (every router renormalises its top-k), whose image prompts rotate by interleaved M-RoPE (models/mrope.py,
as Qwen3VLTextRotaryEmbedding) and whose image rows take DeepStack levels.

The vision tower (multimodal/qwen3_vl.py) hands each image's rows as [ main | level 0 | level 1 | ... ] along the
hidden dim. The main part replaces the rows' token embeddings; level i is added to those rows' hidden states after
decoder layer i (Qwen3VLTextModel._deepstack_process). A chunk holds only the rows of the image positions it runs,
so chunked prefill, prefix hits and preemption slice the levels exactly as they slice the main rows.

GGUF: llama.cpp's `qwen3vl` / `qwen3vlmoe` (convert_hf_to_gguf.py's Qwen3VLTextModel / Qwen3VLMoeTextModel): Qwen3's
/ Qwen3-MoE's tensors, rope.dimension_sections the M-RoPE sections.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.kernels import AttentionMetadata
from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register
from conveyor.models.llama import Embeds, KVCache, LlamaForCausalLM
from conveyor.models.moe_llama import MoEForCausalLM
from conveyor.models.mrope import axis_of_columns, mrope_tables
from conveyor.models.qwen3_moe import hf_fields as qwen3_moe_fields

# Qwen3VLTextRotaryEmbedding's M-RoPE sections where the config names none (multimodal/qwen3_vl.py's check reads it)
MROPE_SECTION = (24, 20, 20)


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    section = tuple(int(n) for n in rope.get("mrope_section") or MROPE_SECTION)
    return dict(qk_norm=True, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                mrope_section=_checked(section, raw))


def moe_hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    # Qwen3VLMoeTextTopKRouter always renormalises the top-k weights (its config has no norm_topk_prob)
    return {**qwen3_moe_fields(raw), **hf_fields(raw), "norm_topk_prob": True}


def _checked(section: tuple[int, ...], raw: dict[str, Any]) -> tuple[int, ...]:
    """A load error where the sections do not cover half the head (the first image prompt would fail)."""
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    axis_of_columns(section, head_dim)  # ValueError: a malformed config
    return section


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    sections = meta("rope.dimension_sections")
    section = tuple(int(n) for n in sections[:3]) if sections else MROPE_SECTION
    head_dim = base["head_dim"]
    axis_of_columns(section, head_dim)  # llama.cpp asserts rotary == head_dim for qwen3vl
    levels = meta("n_deepstack_layers")  # checked against the mmproj's levels at load (loading/mmproj.py)
    return dict(mrope_section=section, num_deepstack_levels=None if levels is None else int(levels))


class DeepStackDecoder:
    """Over a LlamaForCausalLM (dense or MoE): M-RoPE positions and DeepStack levels on image rows (`embeds`)."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor, embeds: Embeds | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM's; `embeds` rows (E, hidden * (1 + levels)), `rope_positions` (3, T) or None."""
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices, embeds,
                                                      rope_positions))

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor, embeds: Embeds | None = None,
                      rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = self._layers(input_ids, positions, kv_caches, meta, embeds=embeds,
                                   rope_positions=rope_positions)
        _, x = self.norm.add_and_norm(residual[rows], x[rows])
        return x

    @torch.inference_mode()
    def aux_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                          meta: AttentionMetadata, rows: torch.Tensor, layer_ids: tuple[int, ...],
                          embeds: Embeds | None = None,
                          rope_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaForCausalLM's (an EAGLE3 drafter's input), with M-RoPE positions and DeepStack levels."""
        aux: dict[int, torch.Tensor] = {}
        x, residual = self._layers(input_ids, positions, kv_caches, meta, set(layer_ids), aux, embeds, rope_positions)
        if self.config.num_hidden_layers in layer_ids:
            aux[self.config.num_hidden_layers] = residual + x
        _, out = self.norm.add_and_norm(residual[rows], x[rows])
        return out, torch.cat([aux[i] for i in layer_ids], dim=-1)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, capture: set[int] = frozenset(),
                aux: dict[int, torch.Tensor] | None = None, embeds: Embeds | None = None,
                rope_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        x = self.embed_tokens(input_ids)  # (T, hidden)
        levels: list[torch.Tensor] = []
        if embeds is not None:
            rows, values = embeds  # (E,), (E, hidden * (1 + levels))
            main, *levels = self._split_levels(values.to(x.dtype))
            x = x.index_copy(0, rows, main)
        if rope_positions is not None and cfg.mrope_section:
            rope = mrope_tables(self.rotary, rope_positions, cfg.mrope_section, x.dtype)
        else:
            rope = self.rotary.tables(positions, x.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in capture:
                aux[i] = x if residual is None else residual + x
            x, residual = layer(x, residual, rope, kv_cache, meta)
            if i < len(levels):
                # DeepStack: the stream after layer i (residual + output, as transformers sums it) plus level i at
                # the image rows; a zero delta carries it into the next layer's fused add-and-norm unchanged.
                residual = (residual + x).index_add(0, rows, levels[i])
                x = torch.zeros_like(x)
        return x, residual

    def _split_levels(self, values: torch.Tensor) -> list[torch.Tensor]:
        hidden = self.config.hidden_size
        num_levels = values.shape[1] // hidden - 1
        if values.shape[1] % hidden or not 0 <= num_levels <= self.config.num_hidden_layers:
            raise ValueError(f"qwen3_vl: image rows {values.shape[1]} wide are not the {hidden}-wide main rows and "
                             f"at most {self.config.num_hidden_layers} DeepStack levels")
        return list(values.split(hidden, dim=1))


class Qwen3VLForCausalLM(DeepStackDecoder, LlamaForCausalLM):
    pass


class Qwen3VLMoeForCausalLM(DeepStackDecoder, MoEForCausalLM):
    pass


# Experts stacked one gate|up and one down tensor per layer: (E, hidden, 2 x I) / (E, I, hidden) on the Hub,
# (E, 2 x I, hidden) / (E, hidden, I) as transformers 5 saves them (both load there; told apart by shape)
MOE_EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", stacked_layout_by_shape=True)
_TEXT_DEFAULTS = dict(head_dim=128, rope_theta=500000.0, max_position_embeddings=128000)

register(Family("qwen3_vl_text", "conveyor.models.qwen3_vl:Qwen3VLForCausalLM", hf_fields, multimodal_type="qwen3_vl",
                # Qwen3VLTextConfig's defaults, where a config.json's text_config leaves a field out
                multimodal_text_defaults=_TEXT_DEFAULTS, gguf_architectures=("qwen3vl",), gguf_fields=gguf_fields),
         Family("qwen3_vl_moe_text", "conveyor.models.qwen3_vl:Qwen3VLMoeForCausalLM", moe_hf_fields,
                multimodal_type="qwen3_vl_moe", expert_names=MOE_EXPERT_NAMES,
                multimodal_text_defaults={**_TEXT_DEFAULTS, "head_dim": None},
                gguf_architectures=("qwen3vlmoe",), gguf_fields=gguf_fields))
