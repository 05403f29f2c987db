"""llama.cpp's hybrid architectures (`lfm2`, `qwen35`): GGUF metadata -> ModelConfig fields, and GGUF tensors
-> the Hugging Face names and values transformers' save_pretrained writes, undoing what convert_hf_to_gguf
did to each tensor.

lfm2    the final norm is `token_embd_norm`; shortconv.conv squeezed (C, 1, K) -> (C, K); a layer is a short
        convolution where the per-layer attention.head_count_kv is 0.
qwen35  ssm_a = -exp(A_log); dt_bias renamed ssm_dt.bias; conv1d squeezed; every RMSNorm but the DeltaNet's
        stored as 1 + w (kept so: norm_weight_offset 0, exact); where key heads != value heads, value heads
        reordered from grouped by key head to tiled in in_proj_qkv's v rows, in_proj_z, in_proj_a/b, A_log,
        dt_bias, conv1d's v channels and out_proj's columns; MTP blocks appended after the last layer
        (nextn_predict_layers), which we skip.
Both may come with q|k|v fused in attn_qkv on attention layers (convert_hf_to_gguf --fuse-qkv).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from conveyor.kernels.quant_ref import block_shape
from conveyor.loading.checkpoint import LoadError, QuantizedTensor, Weight
from conveyor.models.config import ATTENTION_LAYER_TYPES, ModelConfig

logger = logging.getLogger(__name__)

# GGUF architectures that are hybrids we do not run yet, and what they are.
UNSUPPORTED_HYBRIDS = {
    "qwen3next": "Qwen3-Next: gated DeltaNet and attention with a sparse MoE",
    "qwen35moe": "Qwen3.5 MoE: gated DeltaNet and attention with a sparse MoE",
    "lfm2moe": "LFM2 MoE: short convolutions and attention with a sparse MoE",
    "granitehybrid": "Granite 4.0 hybrid: Mamba2 and attention",
    "nemotron_h": "Nemotron-H: Mamba2, attention and MLP layers",
    "nemotron_h_moe": "Nemotron-H MoE: Mamba2, attention and MoE layers",
    "falcon-h1": "Falcon-H1: Mamba2 and attention in parallel",
    "mamba2": "Mamba2",
    "mamba": "Mamba",
    "jamba": "Jamba: Mamba and attention with MoE",
}

# Global tensors: llama.cpp name -> HF module.
_GLOBAL = {
    "lfm2": {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm", "output": "lm_head"},
    "qwen35": {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
}
# Block tensors: llama.cpp name (under blk.N.) -> HF module (under model.layers.N.).
_BLOCK = {
    "lfm2": {
        "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
        "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
        "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    },
    "qwen35": {
        "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        # on a linear-attention layer attn_qkv is the DeltaNet's q|k|v projection
        "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_conv1d": "linear_attn.conv1d", "ssm_out": "linear_attn.out_proj", "ssm_norm": "linear_attn.norm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    },
}
# Bare parameters (no module, so no .weight in HF): the full llama.cpp name under blk.N.
_PARAMETERS = {"qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}}

HYBRID_GGUF_ARCHITECTURES = tuple(_GLOBAL)


def config_fields(arch: str, meta: Callable[[str], Any], tensors: dict, base: dict[str, Any],
                  source: str) -> dict[str, Any]:
    """ModelConfig fields of a hybrid beyond the shared ones in `base`; `meta(key)` reads `{arch}.{key}`, None if
    absent."""
    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise LoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    fields = _lfm2_fields(meta, need, tensors, base, source) if arch == "lfm2" else _qwen35_fields(meta, need, base)
    attention = _first_layer(fields["layer_types"], ATTENTION_LAYER_TYPES)
    fields.update(qk_norm=True, attention_bias=attention is not None and (
        f"blk.{attention}.attn_q.bias" in tensors or f"blk.{attention}.attn_qkv.bias" in tensors))
    return fields


def _lfm2_fields(meta, need, tensors: dict, base: dict[str, Any], source: str) -> dict[str, Any]:
    kv_heads = need("attention.head_count_kv")  # per layer: 0 on a short-convolution layer
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * base["num_hidden_layers"]
    if meta("attention.sliding_window"):
        raise LoadError(f"{source}: LFM2 with sliding-window attention (LFM2.5's audio detokenizer) is not supported")
    layer_types = tuple("conv" if n == 0 else "full_attention" for n in kv_heads)
    conv = _first_layer(layer_types, ("conv",))
    return dict(layer_types=layer_types, conv_kernel_size=int(need("shortconv.l_cache")),
                conv_bias=conv is not None and f"blk.{conv}.shortconv.conv.bias" in tensors)


def _qwen35_fields(meta, need, base: dict[str, Any]) -> dict[str, Any]:
    layers, head_dim = base["num_hidden_layers"], base["head_dim"]
    recurrent = meta("attention.recurrent_layers")  # one flag per block, MTP blocks included
    if recurrent is None:  # files converted before the per-layer flags: llama.cpp's default interval is 4
        interval = int(meta("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    value_heads = int(need("ssm.time_step_rank"))
    return dict(
        layer_types=tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers]),
        conv_kernel_size=int(need("ssm.conv_kernel")),
        linear_num_key_heads=int(need("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_key_head_dim=int(need("ssm.state_size")),
        linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
        # rope.dimension_sections (multimodal rope) is ignored: text positions rotate as plain rope
        partial_rotary_factor=int(meta("rope.dimension_count") or head_dim) / head_dim,
        attn_output_gate=True,
        norm_weight_offset=0.0)  # NOTE: the converter stored 1 + w already (exact; subtracting 1 would not be)


def _first_layer(layer_types: tuple[str, ...], kinds: tuple[str, ...]) -> int | None:
    return next((i for i, kind in enumerate(layer_types) if kind in kinds), None)


@dataclass
class HybridTensors:
    """Renames one hybrid GGUF's tensors to HF names and undoes the converter's transforms, tensor by tensor.

    `release(tensor)` is called on a file view once a transform has made its own copy of it.
    """

    arch: str
    config: ModelConfig
    source: str
    release: Callable[[torch.Tensor], None]
    dequantized: list[str] = field(default_factory=list)  # quantized tensors whose blocks could not be kept
    num_skipped: int = 0  # MTP tensors

    def hf_weights(self, gguf_name: str, weight: Weight) -> dict[str, Weight]:
        """One GGUF tensor -> {HF name: weight}, several where llama.cpp fused them; {} for an MTP block."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL[self.arch]:
            return {f"{_GLOBAL[self.arch][base]}.{suffix}": weight}
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if match is None:
            raise LoadError(f"{self.source}: unexpected tensor {gguf_name!r} in GGUF file")
        layer, rest = int(match.group(1)), match.group(2)
        if layer >= self.config.num_hidden_layers:  # the draft head (MTP) after the last layer: not run
            self.num_skipped += 1
            return {}
        prefix = f"model.layers.{layer}."
        if rest in _PARAMETERS.get(self.arch, {}):
            name = _PARAMETERS[self.arch][rest]
        else:
            base, _, suffix = rest.rpartition(".")
            names = _BLOCK[self.arch]
            if base == "attn_qkv" and self.config.layer_kind(layer) in ATTENTION_LAYER_TYPES:
                return self._split_qkv(prefix, suffix, weight)
            if suffix not in ("weight", "bias") or base not in names:
                raise LoadError(f"{self.source}: unexpected tensor {gguf_name!r} in GGUF file")
            name = f"{names[base]}.{suffix}"
        if self.arch == "qwen35":
            weight = self._undo_qwen35(name, weight, gguf_name)
        if name.endswith(("conv.conv.weight", "conv1d.weight")) and isinstance(weight, torch.Tensor):
            weight = weight.unsqueeze(1)  # (C, K) -> HF's depthwise (C, 1, K), a view
        return {prefix + name: weight}

    def report(self) -> None:
        if self.num_skipped:
            logger.info("%s: skipped %d tensors of the multi-token-prediction head", self.source, self.num_skipped)
        if self.dequantized:
            more = f" and {len(self.dequantized) - 1} more" if len(self.dequantized) > 1 else ""
            logger.warning("%s: %s%s dequantized at load: llama.cpp reordered their value-head columns, which "
                           "do not fall on whole quantization blocks", self.source, self.dequantized[0], more)

    def _split_qkv(self, prefix: str, suffix: str, weight: Weight) -> dict[str, Weight]:
        """An attention layer's q|k|v fused by the converter (q includes Qwen3.5's per-head gate rows)."""
        cfg, names = self.config, _BLOCK[self.arch]
        q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        parts, start = {}, 0
        for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            parts[f"{prefix}{names[part]}.{suffix}"] = _rows(weight, start, start + rows)
            start += rows
        if start != weight.shape[0]:
            raise LoadError(f"{self.source}: fused attn_qkv of {prefix} has {weight.shape[0]} rows, expected {start}")
        return parts

    def _undo_qwen35(self, name: str, weight: Weight, gguf_name: str) -> Weight:
        cfg = self.config
        if name.endswith("A_log"):
            a_log = torch.log(-weight.double()).float()  # NOTE: exp then log: within an ulp, not bit-exact
            self.release(weight)
            weight = a_log
        groups, per_group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if per_group == 1:  # the converter reorders value heads only when key and value heads differ
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


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (end - start, weight.shape[1]), weight.raw[start:end])
    return weight[start:end]
