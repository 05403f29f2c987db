"""Qwen3.5 (text) and Qwen3.5-MoE (text): gated DeltaNet linear attention, with a full-attention layer
every few layers (models/hybrid.py), HF config -> fields.

Attention layers are Qwen3's with an output gate (q_proj yields q and a gate per head; the output is
times sigmoid(gate)) and rotary on the first quarter of each head. Every RMSNorm scales by (1 + w)
(the 1 added at load), but the DeltaNet's gated norm, which scales by w. GGUF files (`qwen35`, `qwen35moe`, and
Qwen3-Next's `qwen3next`) load through models/hybrid_gguf.py with the names, fields and transforms below; the
draft head (MTP) llama.cpp appends after the last layer is skipped.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from conveyor.kernels.quant_ref import block_shape
from conveyor.models.config import ExpertNames, ModelConfig
from conveyor.models.family import Family, register
from conveyor.models.hybrid_gguf import HybridTensors, attention_fields, first_sparse_layer, need
from conveyor.models.tensors import QuantizedTensor, Weight

logger = logging.getLogger(__name__)
# transformers' Qwen3.5 M-RoPE sections where the config names none (multimodal/qwen3_vl.py's check reads it)
MROPE_SECTION = (11, 11, 10)

# The channel step: the sparse MoE block in MoE layers (Qwen3.5-MoE, Qwen3-Next), the SwiGLU MLP elsewhere.
_CHANNEL = ("post_attention_layernorm", (("experts", "mlp"),))

NAMES = {
    "embed": "model.embed_tokens.weight", "layers": "model.layers.", "final_norm": "model.norm.weight",
    "layout": {"linear_attention": (("input_layernorm", ("gated_deltanet",)), _CHANNEL),
               "full_attention": (("input_layernorm", ("attention",)), _CHANNEL)},
    "attention": {"kind": "attention", "prefix": "self_attn.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"},
    "gated_deltanet": {"kind": "gated_deltanet", "prefix": "linear_attn.", "qkv": "in_proj_qkv", "z": "in_proj_z",
                       "b": "in_proj_b", "a": "in_proj_a", "conv": "conv1d", "out": "out_proj", "norm": "norm"},
    "mlp": {"kind": "mlp", "prefix": "mlp.", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "experts": {"kind": "moe", "prefix": ""},  # MOE_EXPERT_NAMES: mlp.gate, mlp.experts.N.gate_proj, mlp.shared_expert ...
}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if not types:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return dict(
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), qk_norm=True, attn_output_gate=True,
        norm_weight_offset=1.0, layer_types=tuple(types),
        conv_kernel_size=int(raw.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(raw["linear_num_key_heads"]), linear_num_value_heads=int(raw["linear_num_value_heads"]),
        linear_key_head_dim=int(raw["linear_key_head_dim"]), linear_value_head_dim=int(raw["linear_value_head_dim"]),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mrope_section=_mrope_section(raw),
    )


def _mrope_section(raw: dict[str, Any]) -> tuple[int, ...]:
    """The interleaved M-RoPE sections (t, h, w) image prompts rotate by (transformers' default [11, 11, 10])."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return tuple(int(n) for n in rope.get("mrope_section") or MROPE_SECTION)


def shared_expert_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Sparse MoE blocks with a shared expert gated by sigmoid (Qwen3-Next, Qwen3.5-MoE): softmax router."""
    # transformers 5 may save num_experts as num_local_experts (an attribute_map alias).
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                shared_expert_gate=True)


def moe_hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE: every layer's MLP is sparse, its top-k weights always renormalised."""
    moe = shared_expert_moe_fields(raw)
    # No layer is dense and the config names no dense width; the field only has to be valid.
    return {**hf_fields(raw), **moe, "norm_topk_prob": True,
            "intermediate_size": int(raw.get("intermediate_size") or moe["moe_intermediate_size"])}


MOE_EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: the layer kinds, the DeltaNet's widths (ssm.*),
    and the MoE layers' shared expert where they have one."""
    layers, head_dim = base["num_hidden_layers"], base["head_dim"]
    recurrent = meta("attention.recurrent_layers")  # one flag per block, MTP blocks included
    if recurrent is None:  # files converted before the per-layer flags: llama.cpp's default interval is 4
        interval = int(meta("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    value_heads = int(need(meta, "ssm.time_step_rank"))
    types = tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers])
    fields = dict(
        layer_types=types, conv_kernel_size=int(need(meta, "ssm.conv_kernel")),
        linear_num_key_heads=int(need(meta, "ssm.group_count")), linear_num_value_heads=value_heads,
        linear_key_head_dim=int(need(meta, "ssm.state_size")),
        linear_value_head_dim=int(need(meta, "ssm.inner_size")) // value_heads,
        partial_rotary_factor=int(meta("rope.dimension_count") or head_dim) / head_dim,
        # the M-RoPE sections (t, h, w, and a 4th llama.cpp pads with 0): used by image prompts only
        mrope_section=tuple(int(n) for n in (meta("rope.dimension_sections") or MROPE_SECTION)[:3]),
        attn_output_gate=True,
        norm_weight_offset=0.0,  # NOTE: the converter stored 1 + w already (exact; subtracting 1 would not be)
        **attention_fields(types, tensors))
    sparse = first_sparse_layer(base) if base.get("num_experts") else None
    if sparse is None or f"blk.{sparse}.ffn_gate_inp_shexp.weight" not in tensors:
        return fields
    # without the key llama.cpp sizes the shared expert as the dense MLP
    return dict(fields, shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")
                                                            or base["intermediate_size"]), shared_expert_gate=True)


class GGUFTensors(HybridTensors):
    """llama.cpp's names (dt_bias is ssm_dt.bias; the MoE variants' shared expert ffn_*_shexp, its sigmoid gate
    ffn_gate_inp_shexp), and its converter's transforms undone: ssm_a = -exp(A_log); where key heads != value
    heads, value heads reordered from grouped by key head to tiled in in_proj_qkv's v rows, in_proj_z,
    in_proj_a/b, A_log, dt_bias, conv1d's v channels and out_proj's columns. Every RMSNorm but the DeltaNet's is
    stored as 1 + w, and kept so (gguf_fields: norm_weight_offset 0)."""

    GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    BLOCK = {
        "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        # on a linear-attention layer attn_qkv is the DeltaNet's q|k|v projection
        "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_conv1d": "linear_attn.conv1d", "ssm_out": "linear_attn.out_proj", "ssm_norm": "linear_attn.norm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        # the MoE variants' shared expert (routed experts and router: the loader's)
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    }
    PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
    reordered_value_heads = True  # by Qwen3.5's converter where key heads != value heads (not by Qwen3-Next's)

    def __init__(self, config: ModelConfig, release: Callable[[torch.Tensor], None]) -> None:
        super().__init__(config, release)
        self.dequantized: list[str] = []  # quantized tensors whose blocks could not be kept

    def report(self, source: str) -> None:
        if self.dequantized:
            more = f" and {len(self.dequantized) - 1} more" if len(self.dequantized) > 1 else ""
            logger.warning("%s: %s%s dequantized at load: llama.cpp reordered their value-head columns, which "
                           "do not fall on whole quantization blocks", source, self.dequantized[0], more)

    def _undo(self, name: str, weight: Weight, gguf_name: str) -> Weight:
        cfg = self.config
        if name.endswith("A_log"):
            a_log = torch.log(-weight.double()).float()  # NOTE: exp then log: within an ulp, not bit-exact
            self.release(weight)
            weight = a_log
        groups, per_group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if per_group == 1 or not self.reordered_value_heads:
            return weight
        key_size = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        width = cfg.linear_value_head_dim
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return self._regroup_rows(weight, 2 * key_size, groups, per_group, width)
        if name.endswith("in_proj_z.weight"):
            return self._regroup_rows(weight, 0, groups, per_group, width)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return self._regroup_rows(weight, 0, groups, per_group, 1)
        if name.endswith("linear_attn.out_proj.weight"):
            return self._regroup_columns(weight, groups, per_group, width, gguf_name)
        return weight

    def _regroup_rows(self, weight: Weight, start: int, groups: int, per_group: int, width: int) -> Weight:
        """Rows from `start` on, tiled (per_group, groups, width) -> grouped (groups, per_group, width).
        A quantized row is a whole output feature, so raw block rows move the same way."""
        rows = weight.raw if isinstance(weight, QuantizedTensor) else weight
        out = torch.cat([rows[:start], _untile(rows[start:], 0, groups, per_group, width)])
        self.release(rows)
        return QuantizedTensor(weight.qtype, weight.shape, out) if isinstance(weight, QuantizedTensor) else out

    def _regroup_columns(self, weight: Weight, groups: int, per_group: int, width: int, gguf_name: str) -> Weight:
        """out_proj's input columns, tiled -> grouped: whole blocks where a head spans whole blocks, else dense."""
        if isinstance(weight, QuantizedTensor):
            block, block_bytes = block_shape(weight.qtype)
            if width % block == 0:
                raw = _untile(weight.raw, 1, groups, per_group, width // block * block_bytes)
                self.release(weight.raw)
                return QuantizedTensor(weight.qtype, weight.shape, raw)
            self.dequantized.append(gguf_name)
            dense = weight.dequantize()  # (N, K) fp32
            self.release(weight.raw)
            return _untile(dense, 1, groups, per_group, width)
        out = _untile(weight, 1, groups, per_group, width)
        self.release(weight)
        return out


def _untile(x: torch.Tensor, dim: int, groups: int, per_group: int, width: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's _reorder_v_heads along `dim`:

        tiled   [g0v0 g1v0 .. g0v1 g1v1 ..]   (per_group, groups, width)
        grouped [g0v0 g0v1 .. g1v0 g1v1 ..]   (groups, per_group, width)
    """
    shape = x.shape
    split = x.reshape(*shape[:dim], per_group, groups, width, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape).contiguous()


register(Family("qwen3_5_text", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                multimodal_type="qwen3_5", gguf_architectures=("qwen35",), gguf_fields=gguf_fields,
                gguf_weights=GGUFTensors),
         Family("qwen3_5_moe_text", "conveyor.models.hybrid:HybridForCausalLM", moe_hf_fields, hybrid=True,
                multimodal_type="qwen3_5_moe", expert_names=MOE_EXPERT_NAMES, gguf_architectures=("qwen35moe",),
                gguf_fields=gguf_fields, gguf_weights=GGUFTensors))
