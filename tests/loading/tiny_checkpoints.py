"""Tiny random checkpoints for the loader tests: HF models from transformers, GGUF files from gguf's writer."""

from __future__ import annotations

import json
import math
import os
import tempfile

import gguf
import numpy as np
import torch
import transformers
import tokenizers
from safetensors.torch import load_file

from conveyor.loading.gguf_config import llama3_rope_factors
from conveyor.loading.gguf_loader import BLOCK_TENSORS, GLOBAL_TENSORS
from conveyor.testing import add_tiny_bpe_vocab

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
}


def tiny_hf_model(arch: str, tie: bool, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIG_CLASSES[arch](**{**TINY, "tie_word_embeddings": tie, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1.0; randomize so a swapped norm cannot pass
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_()
    return model.eval()


def head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute_for_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    for gguf_base, hf_base in GLOBAL_TENSORS.items():
        if base == hf_base:
            return f"{gguf_base}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    inverse: dict[str, str] = {}
    for gguf_base, hf_base in BLOCK_TENSORS.items():  # the first (llama's) name wins: ffn_norm, not post_attention_norm
        inverse.setdefault(hf_base, gguf_base)
    return f"blk.{layer}.{inverse[rest]}.{suffix}"


def gguf_writer(path, arch: str, cfg, rope_theta: float) -> gguf.GGUFWriter:
    """A GGUFWriter with the shape metadata every llama.cpp-converted decoder carries, from HF config `cfg`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    return writer


def write_gguf(path, arch: str, model: transformers.PreTrainedModel, dtype=gguf.GGMLQuantizationType.F32,
               tokenizer=None, rope_freqs: np.ndarray | None = None) -> None:
    """Write `model` the way llama.cpp's converter does (llama q/k permuted); `tokenizer(writer)` adds vocab."""
    cfg = model.config
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    (tokenizer or add_tiny_bpe_vocab)(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = permute_for_llama_cpp(tensor, heads)
        _add_tensor(writer, gguf_name(name), tensor.float().numpy(), dtype if tensor.dim() == 2 else None)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, dtype) -> None:
    if dtype in (None, gguf.GGMLQuantizationType.F32):
        writer.add_tensor(name, array)
    elif dtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:  # BF16 and the block quantizations go in as raw bytes
        writer.add_tensor(name, gguf.quants.quantize(array, dtype), raw_dtype=dtype)



SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "he", "ll", "llo", "hello", "\u2581hello",
              "\u2581w", "or", "wor", "world", "\u2581world", "ab", "abc", "\u2581abc", "\u2581a"]


def add_tiny_sentencepiece_vocab(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, a user-defined <tool>, then pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<tool>"] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [4] + [1] * len(SPM_PIECES)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}")


def gguf_family_name(hf_name: str, arch: str, num_layers: int) -> str:
    """HF name -> the tensor name convert_hf_to_gguf writes for `arch`: gguf-py's own name map."""
    base, _, suffix = hf_name.rpartition(".")
    name = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], num_layers).get_name(base)
    if name is None:
        raise KeyError(f"gguf-py maps no tensor for {hf_name} in {arch}")
    return f"{name}.{suffix}"


def write_family_gguf(path, arch: str, model: transformers.PreTrainedModel) -> None:
    """`model` (F32) the way convert_hf_to_gguf writes gemma2/gemma3/granite/olmo2/phi3: Gemma norms stored as
    1 + w, Granite q/k permuted (a LlamaModel subclass), Phi-3's longrope factors as tensors."""
    cfg = model.config
    rope = cfg.rope_parameters
    theta = rope.get("full_attention", rope)["rope_theta"]
    if arch == "hunyuan-dense" and rope.get("alpha"):  # HunYuanModel: the NTK-alpha stretch folded into the base
        theta *= rope["alpha"] ** (cfg.head_dim / (cfg.head_dim - 2))
    writer = gguf_writer(path, arch, cfg, theta)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    elif arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    _issue25_metadata(writer, arch, model)
    add_tiny_bpe_vocab(writer)
    for name, tensor in model.state_dict().items():
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or ".act_fn." in name:  # xIELU: metadata
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch in ("granite", "smollm3", "mistral3") and name.endswith(("q_proj.weight", "k_proj.weight",
                                                                          "q_proj.bias", "k_proj.bias")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = permute_for_llama_cpp(tensor, heads)
        writer.add_tensor(gguf_family_name(name, arch, cfg.num_hidden_layers), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _issue25_metadata(writer: gguf.GGUFWriter, arch: str, model: transformers.PreTrainedModel) -> None:
    """What convert_hf_to_gguf adds for SmolLM3, Ministral 3, OLMo 3 (as olmo2), GLM-4, EXAONE 4, Hunyuan dense and
    Apertus beyond the shared keys (their set_gguf_parameters / generate_extra_tensors)."""
    cfg = model.config
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if arch == "mistral3":
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch in ("olmo2", "exaone4") and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "glm4":
        writer.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5)))
    if arch == "apertus":
        for key in ("alpha_n", "alpha_p", "beta", "eps"):
            values = [float(getattr(layer.mlp.act_fn, key)) for layer in model.model.layers]
            getattr(writer, f"add_xielu_{key}")(values)
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(
            full, full["rope_theta"], head_dim(cfg)).astype(np.float32))


# HF model_type -> the GGUF architecture convert_hf_to_gguf writes
HYBRID_GGUF_ARCH = {"lfm2": "lfm2", "qwen3_5_text": "qwen35", "lfm2_moe": "lfm2moe", "qwen3_next": "qwen3next",
                    "qwen3_5_moe_text": "qwen35moe"}
_HYBRID_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
_DELTANET = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=8)
# Widths are multiples of 32 so Q8_0 takes every matrix (the converter falls back to F16 where it cannot).
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_SHARED_EXPERT = dict(**_EXPERTS, shared_expert_intermediate_size=64)


def _hybrid_config(family: str, overrides: dict) -> transformers.PretrainedConfig:
    if family == "lfm2":
        return transformers.Lfm2Config(**{**_HYBRID_COMMON, "intermediate_size": 144,
                                          "layer_types": ["conv", "full_attention", "conv", "conv"], **overrides})
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**{**_HYBRID_COMMON, **_DELTANET, "intermediate_size": 96, **overrides})
    # The MoE variants as llama.cpp runs them: top-k weights renormalised and not scaled (the file says neither).
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**{**_HYBRID_COMMON, **_DELTANET, **_SHARED_EXPERT, "intermediate_size": 96,
                                               "norm_topk_prob": True, **overrides})
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**{**_HYBRID_COMMON, **_DELTANET, **_SHARED_EXPERT, **overrides})
    if family == "lfm2_moe":  # layer 0 dense; sigmoid router with expert bias
        return transformers.Lfm2MoeConfig(**{**_HYBRID_COMMON, **_EXPERTS, "intermediate_size": 96,
                                             "num_dense_layers": 1, "routed_scaling_factor": 1.0,
                                             "layer_types": ["conv", "full_attention", "conv", "conv"], **overrides})
    raise ValueError(family)


def tiny_hf_hybrid(family: str, **overrides) -> transformers.PreTrainedModel:
    """A tiny random LFM2, Qwen3.5 (text), Qwen3-Next, Qwen3.5-MoE (text) or LFM2-MoE model, as tests/models
    builds them: norms, A_log, dt_bias, routers, shared-expert gates and expert biases randomized so a skipped
    or mis-transformed one shows."""
    cfg = _hybrid_config(family, overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("A_log", "dt_bias", "shared_expert_gate.weight", ".gate.weight")):
                p.normal_(0, 0.5)  # routers spread out, so rows pick different experts
            elif name.endswith("expert_bias"):  # sigmoid scores lie in (0, 1): a bias this size changes picks
                p.normal_(0, 0.2)
    return model


def write_hybrid_gguf(path, model: transformers.PreTrainedModel, qtype=gguf.GGMLQuantizationType.F32,
                      fuse_qkv: bool = False, mtp_layers: int = 0, pre: str | None = None,
                      chat_template: str | None = None, legacy_ssm_in: bool = False,
                      add_vocab=add_tiny_bpe_vocab, mtp: dict[str, torch.Tensor] | None = None) -> None:
    """`model` as convert_hf_to_gguf writes it (`lfm2`, `qwen35`, `lfm2moe`, `qwen3next`, `qwen35moe`) from the
    tensors save_pretrained writes: its metadata keys, gguf-py's tensor names and the converter's transforms
    (conv squeezed; Qwen: A_log -> -exp(A_log), dt_bias -> ssm_dt.bias, norms but the DeltaNet's stored as
    1 + w; Qwen3.5 and Qwen3.5-MoE: value heads grouped -> tiled; Qwen3-Next: in_proj_qkvz regrouped into
    attn_qkv and attn_gate; MoE: experts stacked (E, N, K), LFM2-MoE's expert_bias -> exp_probs_b.bias).
    Matrices in `qtype`, the rest F32 as the converter keeps it. `fuse_qkv`: --fuse-qkv; `mtp_layers`: random
    MTP blocks appended; `legacy_ssm_in`: Qwen3-Next's in_proj_qkvz kept whole as ssm_in, as older converters did;
    `mtp`: an MTP head under its HF names (mtp.*), appended as _Qwen35MtpMixin does (one block)."""
    cfg = model.config
    arch = HYBRID_GGUF_ARCH[cfg.model_type]
    layers = cfg.num_hidden_layers
    mtp_layers = 1 if mtp else mtp_layers
    writer = gguf.GGUFWriter(str(path), arch)
    _hybrid_metadata(writer, arch, cfg, layers + mtp_layers, qtype)
    add_vocab(writer)  # benchmarks pass a real tokenizer's (benchmarks/hybrid_gguf.py)
    if pre:
        writer.add_tokenizer_pre(pre)
    if chat_template:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers + mtp_layers)
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for hf_name, tensor in {**_saved_tensors(model), **_mtp_as_layer(cfg, mtp or {})}.items():
        for name, tensor in _converted(cfg, arch, hf_name, tensor, experts, legacy_ssm_in):
            final = name.startswith("blk.")  # named by the converter itself, not through gguf-py's map
            tensors[name if final else names.get_name(name, try_suffixes=(".weight", ".bias"))] = tensor
    if fuse_qkv:
        _fuse_qkv(tensors, cfg)
    for i in range(layers, layers + mtp_layers):
        tensors.update(_random_mtp_block(i, cfg) if not mtp else {})
    for name, tensor in tensors.items():
        _add_tensor(writer, name, tensor.float().numpy(), qtype if _converter_quantizes(name, tensor) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# _Qwen35MtpMixin: the head's own tensors -> the appended block's nextn.* (named here: gguf-py 0.19 has no
# NEXTN names for qwen35 yet; newer ones map model.layers.N.eh_proj etc. to these).
_MTP_HEAD = {"mtp.fc": "eh_proj", "mtp.pre_fc_norm_embedding": "enorm", "mtp.pre_fc_norm_hidden": "hnorm",
             "mtp.norm": "shared_head_norm"}


def _mtp_as_layer(cfg, head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_Qwen35MtpMixin.modify_tensors on an HF MTP head: mtp.layers.0.* -> model.layers.N.*, the rest ->
    blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}; the model's transforms (norms + 1) follow."""
    out, n = {}, cfg.num_hidden_layers
    for name, tensor in head.items():
        if name.startswith("mtp.layers.0."):
            out[f"model.layers.{n}." + name[len("mtp.layers.0."):]] = tensor
        else:
            stem, _, suffix = name.rpartition(".")
            out[f"blk.{n}.nextn.{_MTP_HEAD[stem]}.{suffix}"] = tensor
    return out


def _saved_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """What the converter reads: the checkpoint save_pretrained writes (one tensor per expert, no tied head)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return load_file(f"{folder}/model.safetensors")


def _converted(cfg, arch: str, name: str, tensor: torch.Tensor, experts: dict[int, dict[str, torch.Tensor]],
               legacy_ssm_in: bool) -> list[tuple[str, torch.Tensor]]:
    """The converter's modify_tensors on one HF tensor: (HF-style name for gguf-py's map, tensor) pairs."""
    if ".experts." in name:
        return _stacked_experts(cfg, arch, name, tensor, experts)
    if arch in ("lfm2", "lfm2moe"):
        if name.endswith(".expert_bias"):
            return [(name + ".bias", tensor)]  # LFM2MoeModel.filter_tensors
        return [(name, tensor.squeeze(1) if "conv.conv" in name else tensor)]
    name, tensor = _qwen35_tensor(cfg, name, tensor, reorder_v_heads=arch != "qwen3next")
    if name.endswith("in_proj_qkvz.weight") and not legacy_ssm_in:
        return _regroup_qkvz(cfg, name, tensor)
    return [(name, tensor)]


def _stacked_experts(cfg, arch: str, name: str, tensor: torch.Tensor,
                     experts: dict[int, dict[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Qwen2MoeModel / LFM2MoeModel: a layer's experts, once all are seen, stacked (E, N, K) per part."""
    layer = int(name.split(".")[2])
    cache = experts.setdefault(layer, {})
    cache[name] = tensor
    if len(cache) < cfg.num_experts * 3:
        return []
    del experts[layer]
    if arch == "lfm2moe":  # merged as `layers.N...` (no `model.`), the name gguf-py maps
        block, parts, merged = "feed_forward", ("w1", "w2", "w3"), f"layers.{layer}.feed_forward.experts"
    else:
        block, parts, merged = "mlp", ("down_proj", "gate_proj", "up_proj"), f"model.layers.{layer}.mlp.experts"
    return [(f"{merged}.{part}.weight", torch.stack([cache[f"model.layers.{layer}.{block}.experts.{e}.{part}.weight"]
                                                     for e in range(cfg.num_experts)])) for part in parts]


def _regroup_qkvz(cfg, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Qwen3NextModel: in_proj_qkvz ([q, k, v, z] per key head) -> attn_qkv (all q, all k, all v) and attn_gate."""
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    v_rows = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
    q, k, v, z = tensor.reshape(nk, -1, tensor.shape[1]).split([dk, dk, v_rows, v_rows], dim=1)
    flat = [part.reshape(-1, tensor.shape[1]) for part in (q, k, v, z)]
    layer = name.split(".")[2]
    return [(f"blk.{layer}.attn_qkv.weight", torch.cat(flat[:3])), (f"blk.{layer}.attn_gate.weight", flat[3])]


_FILE_TYPES = {gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
               gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
               gguf.GGMLQuantizationType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
               gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


def _hybrid_metadata(writer: gguf.GGUFWriter, arch: str, cfg, block_count: int, qtype) -> None:
    """The keys TextModel.set_gguf_parameters and LFM2Model / LFM2MoeModel / Qwen2MoeModel / Qwen3NextModel (+
    Qwen3.5's mixins) write."""
    rope = cfg.rope_parameters
    writer.add_block_count(block_count)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(_FILE_TYPES[qtype])
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch in ("lfm2", "lfm2moe"):
        writer.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
        # LFM2-MoE's dense layers keep the configured width (TextModel's intermediate_size)
        writer.add_feed_forward_length(_lfm2_mlp_width(cfg) if arch == "lfm2" else cfg.intermediate_size)
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_shortconv_l_cache(cfg.conv_L_cache)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        if arch == "lfm2moe":
            writer.add_leading_dense_block_count(cfg.num_dense_layers)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        return
    layers = cfg.num_hidden_layers
    if getattr(cfg, "intermediate_size", None):  # Qwen3.5-MoE has none
        writer.add_feed_forward_length(cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # GGUFWriter.add_recurrent_layers, which gguf-py 0.19 does not have yet
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in cfg.layer_types] + [False] * (block_count - layers))
    writer.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    writer.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        # the config's sections, padded to 4 as the converter writes them; else _Qwen35MRopeMixin's default
        sections = list(rope.get("mrope_section") or [11, 11, 10])
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if block_count > layers:
        writer.add_nextn_predict_layers(block_count - layers)


def _lfm2_mlp_width(cfg) -> int:
    """LFM2Model._add_feed_forward_length: the MLP width after LFM2's 2/3 and rounding."""
    width = cfg.intermediate_size
    if cfg.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            width = int(cfg.block_ffn_dim_multiplier * width)
        width = cfg.block_multiple_of * ((width + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return width


def _qwen35_tensor(cfg, name: str, tensor: torch.Tensor, reorder_v_heads: bool) -> tuple[str, torch.Tensor]:
    """_LinearAttentionVReorderBase (Qwen3.5's, with `reorder_v_heads`) then Qwen3NextModel.modify_tensors, on one
    HF tensor (but in_proj_qkvz's split)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if reorder_v_heads and nk != nv and "linear_attn." in name:
        r, dk, dv = nv // nk, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qk = 2 * nk * dk
        if ".in_proj_qkv." in name:
            tensor = torch.cat([tensor[:qk], _tile(tensor[qk:], 0, nk, r, dv)])
        elif ".in_proj_z." in name:
            tensor = _tile(tensor, 0, nk, r, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            tensor = _tile(tensor, 0, nk, r, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            tensor = _tile(tensor.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
        elif ".conv1d" in name:
            tensor = tensor.squeeze()
            tensor = torch.cat([tensor[:qk], _tile(tensor[qk:], 0, nk, r, dv)])
        elif ".out_proj." in name:
            tensor = _tile(tensor, 1, nk, r, dv)
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    return name, tensor


def _tile(tensor: torch.Tensor, dim: int, num_k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = list(tensor.shape)
    split = tensor.reshape(*shape[:dim], num_k_heads, per_k, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).contiguous().reshape(shape)


def _fuse_qkv(tensors: dict[str, torch.Tensor], cfg) -> None:
    """--fuse-qkv: every layer with attn_q, attn_k and attn_v gets one attn_qkv (rows q | k | v)."""
    for i in range(cfg.num_hidden_layers):
        parts = [f"blk.{i}.attn_{p}.weight" for p in "qkv"]
        if all(p in tensors for p in parts):
            tensors[f"blk.{i}.attn_qkv.weight"] = torch.cat([tensors.pop(p) for p in parts])


def _random_mtp_block(layer: int, cfg) -> dict[str, torch.Tensor]:
    """Some of the tensors of a Qwen3.5 / Qwen3-Next MTP block (blk.N with N = num_hidden_layers), random."""
    gen = torch.Generator().manual_seed(layer)
    h, q_rows = cfg.hidden_size, 2 * cfg.num_attention_heads * cfg.head_dim
    shapes = {"nextn.eh_proj.weight": (h, 2 * h), "nextn.enorm.weight": (h,), "nextn.hnorm.weight": (h,),
              "nextn.shared_head_norm.weight": (h,), "attn_norm.weight": (h,), "attn_q.weight": (q_rows, h)}
    if getattr(cfg, "num_experts", None):  # an MoE block: stacked experts too, which must be skipped as well
        experts, width = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update({"ffn_gate_inp.weight": (experts, h), "ffn_up_exps.weight": (experts, width, h),
                       "ffn_gate_inp_shexp.weight": (1, h)})
    else:
        shapes["ffn_up.weight"] = (cfg.intermediate_size, h)
    return {f"blk.{layer}.{name}": torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _converter_quantizes(name: str, tensor: torch.Tensor) -> bool:
    """ModelBase.prepare_tensors: 1-D tensors, norms, conv kernels, routers and names without .weight stay F32."""
    return (tensor.dim() >= 2 and name.endswith(".weight") and not name.endswith("_norm.weight")
            and not name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight", "ffn_gate_inp.weight",
                                   "ffn_gate_inp_shexp.weight")))


def write_gemma4_gguf(path, model: transformers.PreTrainedModel, vocab=None) -> None:
    """`model` (F32) as convert_hf_to_gguf's Gemma4Model writes it: the global layers' head dim as key_length (the
    sliding ones' as key_length_swa), K/V heads and MLP widths per layer where they differ, the sliding pattern per
    layer, shared_kv_layers, the proportional rope as rope_freqs (1, then 1e30), norms as they are (w), the per-layer
    scalar as blk.N.layer_output_scale.weight."""
    cfg = model.config
    raw = cfg.to_dict()  # the saved config (per-layer attributes are not readable off the config object)
    rope, types = cfg.rope_parameters, cfg.layer_types
    per_layer = raw["per_layer_config"]  # the global layers' head dim and K/V heads, by layer
    full_dim = next(c["head_dim"] for i, c in per_layer.items() if types[int(i)] == "full_attention")
    full_kv = next((c.get("num_key_value_heads") for i, c in per_layer.items()
                    if types[int(i)] == "full_attention"), None)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    writer.add_feed_forward_length(
        [cfg.intermediate_size * (2 if i >= first_shared else 1) for i in range(cfg.num_hidden_layers)]
        if cfg.use_double_wide_mlp else cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv([raw["num_key_value_heads"] if t == "sliding_attention" else full_kv for t in types]
                             if full_kv is not None else raw["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(raw["head_dim"])
    writer.add_value_length_swa(raw["head_dim"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(raw["head_dim"])
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    (vocab or add_tiny_bpe_vocab)(writer)
    turning = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.asarray([1.0] * turning + [1e30] * (full_dim // 2 - turning),
                                                      dtype=np.float32))
    if cfg.enable_moe_block:  # 26B-A4B
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k_experts)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma4Model.modify_tensors
            gguf_name = f"blk.{layer}.{'ffn_gate_inp' if name.endswith('router.scale') else 'ffn_down_exps'}.scale"
        else:  # filter_tensors: `.weight` on the bare layer scalar and the stacked experts
            bare = name.endswith("layer_scalar") or name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            gguf_name = gguf_family_name(name + ".weight" if bare else name, "gemma4", cfg.num_hidden_layers)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gemma3n_gguf(path, model: transformers.PreTrainedModel, vocab=None) -> None:
    """`model` (F32) as convert_hf_to_gguf's Gemma3NModel writes it: MLP widths and the sliding pattern per layer,
    shared_kv_layers, AltUp's inputs and active stream, the PLE width, each layer's gaussian top-k as Phi^-1 of its
    share, the AltUp projections stacked, the AltUp output scale as a `.weight`; norms as they are (w)."""
    cfg = model.config
    raw = cfg.to_dict()
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), "gemma3n")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(list(raw["intermediate_size"]))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(raw["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(raw["head_dim"])
    writer.add_value_length(raw["head_dim"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if rope["full_attention"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_altup_active_idx(cfg.altup_active_idx)
    writer.add_altup_num_inputs(cfg.altup_num_inputs)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    normal = torch.distributions.normal.Normal(0, 1)
    writer.add_activation_sparsity_scale([normal.icdf(torch.tensor(s, dtype=torch.float32)).item()
                                          for s in cfg.activation_sparsity_pattern])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    (vocab or add_tiny_bpe_vocab)(writer)
    state = model.state_dict()
    for kind, gguf_base in (("altup_projections", "altup_proj"), ("altup_unembed_projections", "altup_unembd_proj")):
        stack = torch.stack([state.pop(f"model.{kind}.{i}.weight") for i in range(cfg.altup_num_inputs - 1)])
        writer.add_tensor(f"{gguf_base}.weight", stack.float().numpy())
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = name + ".weight" if name.endswith("_scale") else name
        writer.add_tensor(gguf_family_name(name, "gemma3n", cfg.num_hidden_layers), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A tiny vocabulary as convert_hf_to_gguf's Gemma4Model writes one (tokenizer model "gemma4": SentencePiece-style
# pieces with U+2581 for spaces, explicit merges, byte fallback, newline runs as tokens).
GEMMA4_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "\n", "\n\n", "\u2581h", "el", "lo",
                 "\u2581hel", "\u2581hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "ab", "abc"]
GEMMA4_MERGES = ["\u2581 h", "e l", "l o", "\u2581h el", "\u2581hel lo", "\u2581 w", "o r", "l d", "\u2581w or",
                 "\u2581wor ld", "a b", "ab c"]


def add_tiny_gemma4_vocab(writer: gguf.GGUFWriter) -> None:
    """<pad> <eos> <bos> <unk>, a user-defined <|channel>, the pieces, then byte tokens (0x00..) to 256 tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|channel>"] + GEMMA4_PIECES
    types = [3, 3, 3, 2, 4] + [1] * len(GEMMA4_PIECES)
    tokens += [f"<0x{b:02X}>" for b in range(256 - len(tokens))]
    types += [6] * (256 - len(types))
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(GEMMA4_MERGES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)


# sentence-transformers' pooling modes -> llama.cpp's pooling_type, as the converter's _try_set_pooling_type reads them
_GGUF_POOLING = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN, "pooling_mode_cls_token": gguf.PoolingType.CLS,
                 "pooling_mode_lasttoken": gguf.PoolingType.LAST}
_NORMAL, _UNKNOWN, _CONTROL = 1, 2, 3  # llama.cpp token types


def write_encoder_gguf(path, hf_dir: str, qtype=gguf.GGMLQuantizationType.F32,
                       extra: dict[str, np.ndarray] | None = None) -> str:
    """A tiny BERT or XLM-RoBERTa directory (tests/pooling_models.py) as convert_hf_to_gguf's BertModel /
    XLMRobertaModel write it: arch `bert`, the bert./roberta. prefix and the pooler dropped, XLM-R's position table
    cut at its padding offset, matrices in `qtype` (the position and type tables, norms and biases F32), the pooling
    from the sentence-transformers files, and the vocabulary as `bert` (WordPiece) or `t5` (Unigram). A cross-encoder
    with labels of its own (not transformers' default two) has them written and its `classifier` renamed
    `classifier.out_proj` (cls.output); `extra`: more tensors by GGUF name."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    roberta = cfg["model_type"] == "xlm-roberta"
    offset = cfg["pad_token_id"] + 1 if roberta else 0
    labels = cfg.get("id2label")
    if labels and len(labels) == 2 and labels.get("0") == "LABEL_0":  # BertModel.__init__: dummy labels
        labels = None
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"] - offset)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    _add_pooling(writer, hf_dir)
    if labels:
        writer.add_classifier_output_labels([v for _, v in sorted(labels.items())])
    writer.add_token_type_count(cfg["type_vocab_size"])
    (_add_unigram_vocab if roberta else _add_wordpiece_vocab)(writer, hf_dir)
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith("pooler.") or name == "embeddings.position_ids":
            continue
        if name == "embeddings.position_embeddings.weight":
            tensor = tensor[offset:]
        if labels and name in ("classifier.weight", "classifier.bias"):
            name = name.replace("classifier.", "classifier.out_proj.")
        _add_encoder_tensor(writer, "bert", cfg["num_hidden_layers"], name, tensor, qtype)
    return _finish(writer, path, extra)


def write_nomic_bert_gguf(path, hf_dir: str, qtype=gguf.GGMLQuantizationType.F32) -> str:
    """A tiny NomicBERT directory (tests/pooling_models.py) as convert_hf_to_gguf's NomicBertModel writes one from
    nomic's own config (checked against its output): arch `nomic-bert`, the shared keys (rotary_emb_base as
    rope.freq_base; context_length here the config's, where the converter writes the 2048 positions nomic-embed-text
    was trained for), the pooling, a `bert` vocabulary; matrices in `qtype`."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta", cfg.get("rotary_emb_base")))
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    _add_pooling(writer, hf_dir)
    writer.add_token_type_count(cfg["type_vocab_size"])
    _add_wordpiece_vocab(writer, hf_dir)
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        _add_encoder_tensor(writer, "nomic-bert", cfg["num_hidden_layers"], name, tensor, qtype)
    return _finish(writer, path)


def write_modernbert_gguf(path, hf_dir: str, qtype=gguf.GGMLQuantizationType.F32,
                          extra: dict[str, np.ndarray] | None = None) -> str:
    """A tiny ModernBERT directory with a byte-level BPE tokenizer (as ModernBERT's) the way convert_hf_to_gguf's
    ModernBertModel writes it (checked against its output): arch `modern-bert`, norm_eps as layer_norm_rms_epsilon,
    the whole local window as sliding_window and global_attn_every_n_layers as its pattern, both rope bases, a `gpt2`
    vocabulary (pre-tokenizer `modern-bert`) wrapped in [CLS] ... [SEP] by add_bos / add_eos; matrices in `qtype`."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), "modern-bert")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_rope_freq_base(rope.get("full_attention", {}).get("rope_theta", cfg.get("global_rope_theta")))
    writer.add_rope_freq_base_swa(rope.get("sliding_attention", {}).get("rope_theta", cfg.get("local_rope_theta")))
    writer.add_layer_norm_rms_eps(cfg["norm_eps"])
    writer.add_causal_attention(False)
    _add_pooling(writer, hf_dir)
    writer.add_sliding_window(cfg["local_attention"])
    writer.add_sliding_window_pattern(cfg["global_attn_every_n_layers"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_string("modern-bert.hidden_activation", cfg["hidden_activation"])  # (newer gguf-py's add_hidden_act)
    writer.add_uint32("modern-bert.classifier.pooling_type", {"cls": 2, "mean": 1}[cfg["classifier_pooling"]])
    _add_byte_level_vocab(writer, hf_dir)
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        _add_encoder_tensor(writer, "modern-bert", cfg["num_hidden_layers"], name.removeprefix("model."), tensor,
                            qtype)
    return _finish(writer, path, extra)


def _add_pooling(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    pooling_path = os.path.join(hf_dir, "1_Pooling", "config.json")
    if os.path.isfile(pooling_path):
        with open(pooling_path) as f:
            writer.add_pooling_type(next(_GGUF_POOLING[k] for k, on in json.load(f).items() if on is True))


def _add_encoder_tensor(writer: gguf.GGUFWriter, arch: str, num_layers: int, name: str, tensor: torch.Tensor,
                        qtype) -> None:
    gguf_name = gguf_family_name(name, arch, num_layers)
    matrix = tensor.dim() == 2 and not gguf_name.startswith(("position_embd", "token_types"))
    _add_tensor(writer, gguf_name, tensor.float().numpy(), qtype if matrix else None)


def _finish(writer: gguf.GGUFWriter, path, extra: dict[str, np.ndarray] | None = None) -> str:
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _hf_vocab(hf_dir: str) -> tuple[list[str], dict[str, str]]:
    """tokenizer.json's tokens in id order, and tokenizer_config.json's named special tokens."""
    backend = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    vocab = backend.get_vocab()
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        settings = json.load(f)
    specials = {key.removesuffix("_token"): value for key, value in settings.items()
                if key.endswith("_token") and isinstance(value, str)}
    return sorted(vocab, key=vocab.get), specials


def _add_special_ids(writer: gguf.GGUFWriter, tokens: list[str], specials: dict[str, str], add_sep: bool) -> None:
    """gguf-py's SpecialVocab: bos = the CLS token, eos = SEP (the template's first and last), no cls handler."""
    index = tokens.index
    writer.add_bos_token_id(index(specials["cls"]))
    writer.add_eos_token_id(index(specials["sep"]))
    writer.add_unk_token_id(index(specials["unk"]))
    writer.add_sep_token_id(index(specials["sep"]))
    writer.add_pad_token_id(index(specials["pad"]))
    writer.add_mask_token_id(index(specials["mask"]))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(add_sep)


def _add_wordpiece_vocab(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    """BertModel.set_vocab: the special tokens CONTROL and as they are, word starts "\u2581word", "##ing" as "ing"."""
    tokens, specials = _hf_vocab(hf_dir)
    control = set(specials.values())
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in tokens])
    writer.add_token_types([_CONTROL if t in control else _NORMAL for t in tokens])
    _add_special_ids(writer, tokens, specials, add_sep=False)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)  # BertNormalizer's lowercase


def _add_unigram_vocab(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    """XLMRobertaModel's _xlmroberta_set_vocab: the pieces and their scores, <unk> UNKNOWN, the rest CONTROL."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        pieces = json.load(f)["model"]["vocab"]  # [[piece, score], ...] in id order
    tokens, specials = _hf_vocab(hf_dir)
    control = set(specials.values()) - {specials["unk"]}
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece for piece, _ in pieces])
    writer.add_token_scores([float(score) for _, score in pieces])
    writer.add_token_types([_UNKNOWN if p == specials["unk"] else _CONTROL if p in control else _NORMAL
                            for p, _ in pieces])
    writer.add_add_space_prefix(True)
    writer.add_remove_extra_whitespaces(True)
    _add_special_ids(writer, tokens, specials, add_sep=True)


def _add_byte_level_vocab(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    """ModernBertModel.set_vocab (_set_vocab_gpt2): tokenizer.json's tokens and merges, the special ones CONTROL,
    bos / eos the CLS / SEP of config.json, and every text wrapped in them (matched against the converter's output
    on this file's directory)."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        merges = json.load(f)["model"]["merges"]
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tokens, specials = _hf_vocab(hf_dir)
    control = set(specials.values())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("modern-bert")
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in control else _NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_sep_token_id(cfg["sep_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_unk_token_id(tokens.index(specials["unk"]))
    writer.add_mask_token_id(tokens.index(specials["mask"]))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(False)  # set_vocab's True, overridden by gguf-py's SpecialVocab from the post-processor
