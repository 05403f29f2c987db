"""llama.cpp's hybrid architectures (`lfm2`, `qwen35` and their MoE variants): GGUF metadata -> ModelConfig
fields, and GGUF tensors -> the Hugging Face names and values transformers' save_pretrained writes, undoing
what convert_hf_to_gguf did to each tensor.

lfm2       the final norm is `token_embd_norm`; shortconv.conv squeezed (C, 1, K) -> (C, K); a layer is a short
           convolution where the per-layer attention.head_count_kv is 0.
lfm2moe    lfm2 with sparse MoE MLPs after leading_dense_block_count dense ones: sigmoid router
           (expert_gating_func), expert_bias as exp_probs_b.bias; no head tensor (always tied).
qwen35     ssm_a = -exp(A_log); dt_bias renamed ssm_dt.bias; conv1d squeezed; every RMSNorm but the DeltaNet's
           stored as 1 + w (kept so: norm_weight_offset 0, exact); where key heads != value heads, value heads
           reordered from grouped by key head to tiled in in_proj_qkv's v rows, in_proj_z, in_proj_a/b, A_log,
           dt_bias, conv1d's v channels and out_proj's columns; MTP blocks appended after the last layer
           (nextn_predict_layers), which we skip.
qwen35moe  qwen35 with sparse MoE MLPs and a shared expert (ffn_*_shexp, its sigmoid gate ffn_gate_inp_shexp).
qwen3next  qwen35moe's transforms without the value-head reorder; HF's in_proj_qkvz (q|k|v|z per key head) was
           regrouped into attn_qkv (all q, all k, all v) and attn_gate (z), so the DeltaNet loads under
           Qwen3.5's split names; in_proj_ba is ssm_ba, still b|a per key head (split here); older files keep
           in_proj_qkvz whole as ssm_in (split here too).
Experts (stacked ffn_*_exps) are split per expert by gguf_loader, as for the other MoE families; llama.cpp
renormalises their top-k weights and scales them by nothing in all three (LFM2-MoE's routed_scaling_factor and
Qwen3-Next's norm_topk_prob are not in the file). Any may come with q|k|v fused in attn_qkv on attention
layers (convert_hf_to_gguf --fuse-qkv).
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
    "granitehybrid": "Granite 4.0 hybrid: Mamba2 and attention",
    "nemotron_h": "Nemotron-H: Mamba2, attention and MLP layers",
    "nemotron_h_moe": "Nemotron-H MoE: Mamba2, attention and MoE layers",
    "falcon-h1": "Falcon-H1: Mamba2 and attention in parallel",
    "mamba2": "Mamba2",
    "mamba": "Mamba",
    "jamba": "Jamba: Mamba and attention with MoE",
}

# GGUF architecture -> the family whose names and transforms it shares.
_FAMILY = {"lfm2": "lfm2", "lfm2moe": "lfm2", "qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3next": "qwen35"}
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
        # the MoE variants' shared expert (routed experts and router: gguf_loader's EXPERT_TENSORS)
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
}
# Bare parameters (no module, so no .weight in HF): the full llama.cpp name under blk.N.
_PARAMETERS = {"lfm2": {"exp_probs_b.bias": "feed_forward.expert_bias"},
               "qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}}

HYBRID_GGUF_ARCHITECTURES = tuple(_FAMILY)
# expert_gating_func values (gguf.ExpertGatingFuncType) -> ModelConfig.moe_scoring
_GATING = {1: "softmax", 2: "sigmoid"}


def config_fields(arch: str, meta: Callable[[str], Any], tensors: dict, base: dict[str, Any],
                  source: str) -> dict[str, Any]:
    """ModelConfig fields of a hybrid beyond the shared ones in `base`; `meta(key)` reads `{arch}.{key}`, None if
    absent."""
    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise LoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    family = _FAMILY[arch]
    fields = _lfm2_fields(meta, need, tensors, base, source) if family == "lfm2" else _qwen35_fields(meta, need, base)
    attention = _first_layer(fields["layer_types"], ATTENTION_LAYER_TYPES)
    fields.update(qk_norm=True, attention_bias=attention is not None and (
        f"blk.{attention}.attn_q.bias" in tensors or f"blk.{attention}.attn_qkv.bias" in tensors))
    if base.get("num_experts"):
        fields.update(_moe_fields(family, meta, need, tensors, base, source))
    return fields


def _moe_fields(family: str, meta, need, tensors: dict, base: dict[str, Any], source: str) -> dict[str, Any]:
    """Router scoring and the extras beside the routed experts, as llama.cpp's graphs run them."""
    sparse = next((i for i in range(base["num_hidden_layers"]) if i not in base["dense_mlp_layers"]), None)
    if family == "lfm2":  # llama.cpp's lfm2moe reads the gating function; the Qwen graphs hard-code softmax
        gating = int(need("expert_gating_func"))
        if gating not in _GATING:
            raise LoadError(f"{source}: unsupported expert_gating_func {gating} (supported: softmax, sigmoid)")
        # the renormalisation's epsilon is transformers' (the file does not say; 1e-6 is below bf16's resolution)
        return dict(moe_scoring=_GATING[gating], moe_renorm_eps=1e-6,
                    moe_expert_bias=sparse is not None and f"blk.{sparse}.exp_probs_b.bias" in tensors)
    if sparse is None or f"blk.{sparse}.ffn_gate_inp_shexp.weight" not in tensors:
        return {}
    # without the key llama.cpp sizes the shared expert as the dense MLP
    return dict(shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")
                                                    or base["intermediate_size"]), shared_expert_gate=True)


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

    @property
    def family(self) -> str:
        return _FAMILY[self.arch]

    def skip(self, gguf_name: str) -> bool:
        """Whether the tensor belongs to the draft head (MTP) after the last layer, which we do not run."""
        match = re.match(r"blk\.(\d+)\.", gguf_name)
        if match is None or int(match.group(1)) < self.config.num_hidden_layers:
            return False
        self.num_skipped += 1
        return True

    def hf_weights(self, gguf_name: str, weight: Weight) -> dict[str, Weight]:
        """One GGUF tensor -> {HF name: weight}, several where llama.cpp fused them."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL[self.family]:
            return {f"{_GLOBAL[self.family][base]}.{suffix}": weight}
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if match is None:
            raise LoadError(f"{self.source}: unexpected tensor {gguf_name!r} in GGUF file")
        layer, rest = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _PARAMETERS[self.family]:
            name = _PARAMETERS[self.family][rest]
        else:
            base, _, suffix = rest.rpartition(".")
            names = _BLOCK[self.family]
            if base == "attn_qkv" and self.config.layer_kind(layer) in ATTENTION_LAYER_TYPES:
                return self._split_qkv(prefix, suffix, weight)
            if self.arch == "qwen3next" and base in ("ssm_ba", "ssm_in") and suffix == "weight":
                return self._split_key_head_groups(prefix, base, weight)
            if suffix not in ("weight", "bias") or base not in names:
                raise LoadError(f"{self.source}: unexpected tensor {gguf_name!r} in GGUF file")
            name = f"{names[base]}.{suffix}"
        if self.family == "qwen35":
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
        cfg, names = self.config, _BLOCK[self.family]
        q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        parts, start = {}, 0
        for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            parts[f"{prefix}{names[part]}.{suffix}"] = _rows(weight, start, start + rows)
            start += rows
        if start != weight.shape[0]:
            raise LoadError(f"{self.source}: fused attn_qkv of {prefix} has {weight.shape[0]} rows, expected {start}")
        return parts

    def _split_key_head_groups(self, prefix: str, base: str, weight: Weight) -> dict[str, Weight]:
        """Qwen3-Next's projections still packed by key head as in HF: ssm_ba (b | a per key head) and, in files
        converted before attn_qkv / attn_gate, ssm_in (HF's in_proj_qkvz, q | k | v | z per key head) ->
        Qwen3.5's split tensors, value heads in the same (grouped) order."""
        cfg = self.config
        per_group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if base == "ssm_ba":
            sizes, roles = [per_group, per_group], ["in_proj_b", "in_proj_a"]
        else:
            value_rows = per_group * cfg.linear_value_head_dim
            sizes = [cfg.linear_key_head_dim, cfg.linear_key_head_dim, value_rows, value_rows]
            roles = ["in_proj_qkv", "in_proj_qkv", "in_proj_qkv", "in_proj_z"]
        if weight.shape[0] != cfg.linear_num_key_heads * sum(sizes):
            raise LoadError(f"{self.source}: {prefix}{base} has {weight.shape[0]} rows, expected "
                            f"{cfg.linear_num_key_heads * sum(sizes)}")
        parts = _ungroup_rows(weight, cfg.linear_num_key_heads, sizes)
        self.release(weight.raw if isinstance(weight, QuantizedTensor) else weight)
        out: dict[str, list[Weight]] = {}
        for role, part in zip(roles, parts):
            out.setdefault(f"{prefix}linear_attn.{role}.weight", []).append(part)
        return {name: _cat_rows(pieces) for name, pieces in out.items()}

    def _undo_qwen35(self, name: str, weight: Weight, gguf_name: str) -> Weight:
        cfg = self.config
        if name.endswith("A_log"):
            a_log = torch.log(-weight.double()).float()  # NOTE: exp then log: within an ulp, not bit-exact
            self.release(weight)
            weight = a_log
        groups, per_group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if per_group == 1 or self.arch == "qwen3next":  # reordered only by Qwen3.5's converter, where heads differ
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


def _ungroup_rows(weight: Weight, groups: int, sizes: list[int]) -> list[Weight]:
    """Rows grouped by key head g, | x_0 y_0 .. | x_1 y_1 .. | ..., with x_g `sizes[0]` rows and so on ->
    [x_0 x_1 .., y_0 y_1 .., ...] (copies). A quantized row is a whole output feature: raw rows move the same way."""
    rows = weight.raw if isinstance(weight, QuantizedTensor) else weight
    parts = [p.reshape(groups * size, rows.shape[1]).contiguous()
             for p, size in zip(rows.reshape(groups, sum(sizes), rows.shape[1]).split(sizes, dim=1), sizes)]
    if isinstance(weight, QuantizedTensor):
        return [QuantizedTensor(weight.qtype, (p.shape[0], weight.shape[1]), p) for p in parts]
    return parts


def _cat_rows(parts: list[Weight]) -> Weight:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], QuantizedTensor):
        raw = torch.cat([p.raw for p in parts])
        return QuantizedTensor(parts[0].qtype, (raw.shape[0], parts[0].shape[1]), raw)
    return torch.cat(parts)


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (end - start, weight.shape[1]), weight.raw[start:end])
    return weight[start:end]
