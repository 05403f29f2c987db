"""Read GGUF metadata: plain field values and the model config llama.cpp wrote."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from conveyor.loading import gguf_hybrid
from conveyor.loading.checkpoint import LoadError
from conveyor.models import family as families
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.kv_sharing import kv_sources
from conveyor.models.mla_dims import MLADims, softmax_scale

# GGUF `general.architecture` values we run, and the HF model_type each one is.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                      "gemma2": "gemma2", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2",
                      "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "lfm2": "lfm2", "qwen35": "qwen3_5_text",
                      "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text", "lfm2moe": "lfm2_moe",
                      # issue #25 (OLMo 3 is written as olmo2, with its sliding-window keys)
                      "smollm3": "smollm3", "mistral3": "ministral3", "glm4": "glm4", "exaone4": "exaone4",
                      "ernie4_5": "ernie4_5", "seed_oss": "seed_oss", "hunyuan-dense": "hunyuan_v1_dense",
                      "apertus": "apertus", "llama4": "llama4_text", "deepseek2": "deepseek_v3",
                      "gpt-oss": "gpt_oss", "gemma4": "gemma4_text", "gemma3n": "gemma3n_text",
                      # the encoders: BERT, and XLM-RoBERTa, which the converter also writes as bert (_bert)
                      "bert": "bert"}
# Layers in llama.cpp's Gemma *27B* (scaled by hidden / heads, not head_dim: gemma_pytorch's config).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's build_moe_ffn renormalises the top-k weights per architecture, whatever the metadata says.
_NORM_TOPK = {"mixtral": True, "qwen3_moe": True, "olmoe": False, "llama4_text": False, "gpt_oss": False,
              "qwen3_next": True, "qwen3_5_moe_text": True, "lfm2_moe": True, "gemma4_text": True}


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list; `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    # Decoded by hand rather than with ReaderField.contents(), which only gguf >= 0.16 has.
    values = [_scalar(field.parts[index], field.types[-1]) for index in field.data]
    return values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]


def _scalar(part: np.ndarray, kind: gguf.GGUFValueType) -> Any:
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.tolist()[0]
    if kind == gguf.GGUFValueType.FLOAT32:
        # Print-and-parse gives back the value the converter started from (1e-05, not 9.99e-06).
        value = float(str(np.float32(value)))
    return value


def config_from_gguf(reader: gguf.GGUFReader, source: str) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch in gguf_hybrid.UNSUPPORTED_HYBRIDS:
        raise LoadError(f"{source}: GGUF architecture {arch!r} ({gguf_hybrid.UNSUPPORTED_HYBRIDS[arch]}) is not "
                        f"supported yet; hybrids that load: {', '.join(gguf_hybrid.HYBRID_GGUF_ARCHITECTURES)}")
    if arch not in GGUF_ARCHITECTURES:
        raise LoadError(f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{source}: GGUF file has no token_embd.weight tensor")

    try:
        return _build_config(reader, arch, tensors, source)
    except (ModelConfigError, TypeError, ValueError) as exc:  # e.g. per-layer head counts (a list)
        raise LoadError(f"{source}: unusable GGUF metadata ({exc})") from exc


def _build_config(reader: gguf.GGUFReader, arch: str, tensors: dict, source: str) -> ModelConfig:
    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise LoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    architecture = GGUF_ARCHITECTURES[arch]
    if architecture == "llama" and int(meta("expert_count", 0)):
        architecture = "mixtral"  # convert_hf_to_gguf writes Mixtral as llama with experts
    q_norm = tensors.get("blk.0.attn_q_norm.weight")
    # Multi-token-prediction blocks (Qwen3.5's draft head) are counted in block_count, after the last layer.
    num_layers = int(meta("block_count")) - int(meta("nextn_predict_layers", 0))
    expert_width = field_value(reader, f"{arch}.expert_feed_forward_length")
    fields = dict(
        architecture=architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are reversed: (hidden, vocab)
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP and no feed_forward_length: the expert width stands in, as in its HF config
        intermediate_size=_first(meta("feed_forward_length", expert_width)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        # Gemma 4 lists K/V heads per layer (global layers differ): its own fields read the list
        num_key_value_heads=(_first(meta("attention.head_count_kv", heads)) if arch == "gemma4"
                             else _kv_heads(meta("attention.head_count_kv", heads), source)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, tensors, source),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        qk_norm=q_norm is not None,
        qk_norm_scope="head" if q_norm is None or int(q_norm.shape[0]) == head_dim else "full",  # OLMoE: full
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(i for i in [field_value(reader, "tokenizer.ggml.eos_token_id")] if i is not None),
        **_moe_fields(architecture, meta, tensors, num_layers),
    )
    fields.update(_family_fields(reader, arch, tensors, fields))
    if arch in gguf_hybrid.HYBRID_GGUF_ARCHITECTURES:
        fields.update(gguf_hybrid.config_fields(arch, lambda key: field_value(reader, f"{arch}.{key}"), tensors,
                                                fields, source))
    return ModelConfig(**fields)


def _first(value: Any) -> int:
    """A per-layer list's first entry (Gemma 4's sliding layers), or the one number."""
    return int(value[0] if isinstance(value, list) else value)


def _kv_heads(value: Any, source: str) -> int:
    """K/V heads: one number, or one per layer where recurrent layers have 0 (LFM2 and the Mamba hybrids)."""
    if not isinstance(value, list):
        return int(value)
    counts = {int(n) for n in value} - {0}
    if len(counts) != 1:
        raise LoadError(f"{source}: per-layer K/V head counts {sorted(counts)} are not supported")
    return counts.pop()


def _family_fields(reader: gguf.GGUFReader, arch: str, tensors: dict, base: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's converter writes for the non-Llama families, as ModelConfig fields."""
    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    fields: dict[str, Any] = {}
    window = meta("attention.sliding_window")
    if arch in ("gemma2", "gemma3"):
        layers, hidden, heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
        per_head = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else base["head_dim"]
        # NOTE: no norm offset: the converter already stored (1 + w) in the file.
        fields.update(hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden),
                      attention_scale=per_head ** -0.5,
                      final_logit_softcapping=meta("final_logit_softcapping") or None,
                      attn_logit_softcapping=meta("attn_logit_softcapping") or None)
        if window:
            fields.update(sliding_window=int(window),
                          layer_types=_layer_types(meta("attention.sliding_window_pattern"), layers,
                                                   6 if arch == "gemma3" else 2))
        if arch == "gemma3":
            fields.update(local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)))
    elif arch == "olmo2":
        full = tuple(tensors["blk.0.attn_q_norm.weight"].shape) != (base["head_dim"],)
        fields.update(norm_layout="post", qk_norm=True, qk_norm_scope="full" if full else "head")
        if window:  # OLMo 3: its sliding layers rotate unscaled (llama.cpp's freq_scale_swa = 1)
            fields.update(sliding_window=int(window), layer_types=_layer_types(
                meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 4))
            local = float(meta("rope.freq_base_swa", base["rope_theta"]))
            if base["rope_scaling"] or local != base["rope_theta"]:
                fields.update(local_rope_theta=local)
    elif arch in DENSE_FAMILY_FIELDS:
        fields.update(DENSE_FAMILY_FIELDS[arch](meta, base))
    elif arch == "granite":
        fields.update(embedding_multiplier=float(meta("embedding_scale", 1.0)),
                      attention_scale=meta("attention.scale"),
                      residual_multiplier=float(meta("residual_scale", 1.0)),
                      logits_scaling=float(meta("logit_scale", 1.0)))
    elif arch == "phi3":
        fields.update(sliding_window=int(window) if window else None)
    elif arch == "llama4":
        fields.update(_llama4(meta, base, window))
    elif arch == "deepseek2":
        fields.update(_deepseek2(meta, base, tensors))
    elif arch == "gpt-oss":
        fields.update(_gpt_oss(meta, base, window))
    elif arch == "gemma4":
        fields.update(_gemma4(meta, base, tensors))
    elif arch == "gemma3n":
        fields.update(_gemma3n(meta, base, tensors))
    elif arch == "bert":
        fields.update(_bert(reader, meta, base, tensors))
    return fields


def _bert(reader: gguf.GGUFReader, meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's BertModel and its subclasses (DistilBERT: no token types; RoBERTa and XLM-RoBERTa: the
    position table already cut at the padding offset, so positions count from 0 here) as transformers' config.

    XLM-RoBERTa (its `t5` vocabulary) or RoBERTa's two-layer classifier head (`cls`, `cls.output`) run as the
    xlm-roberta family, which keeps that head. BERT's one-layer head (`cls.output`, or `cls` where its labels are
    transformers' defaults) is refused: the converter drops the pooler it reads."""
    if meta("attention.causal", False):
        raise ValueError("a causal bert model is not supported")
    head = {"cls.weight", "cls.output.weight"} & tensors.keys()
    if head and len(head) != 2:
        raise ValueError(f"a one-layer classifier head ({', '.join(sorted(head))}: BERT cross-encoders, whose pooler "
                         "the converter drops) is not supported; XLM-RoBERTa's cls + cls.output is")
    types = tensors.get("token_types.weight")
    raw = dict(model_type="bert", hidden_size=base["hidden_size"], num_attention_heads=base["num_attention_heads"],
               max_position_embeddings=base["max_position_embeddings"],
               type_vocab_size=int(types.shape[1]) if types is not None else 0,  # GGUF shapes are reversed
               layer_norm_eps=float(meta("attention.layer_norm_epsilon", 1e-12)))
    roberta = field_value(reader, "tokenizer.ggml.model") == "t5" or bool(head)
    return dict(families.get("bert").hf_fields(raw), architecture="xlm-roberta" if roberta else "bert")


def _gemma3n(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Gemma3NModel: the sliding pattern per layer, MLP widths per layer, shared_kv_layers,
    AltUp's inputs and active stream, the PLE width, each layer's gaussian top-k as its std multiplier (Phi^-1 of
    the share; -inf where dense), LAuReL's rank from its tensor; norms hold w. llama.cpp itself fixes the sharing
    at 20 layers and the sparsity at 0.95 on the first 10: the released E2B and E4B say the same."""
    layers, hidden = base["num_hidden_layers"], base["hidden_size"]
    types = _layer_types(meta("attention.sliding_window_pattern"), layers, 5)
    widths = meta("feed_forward_length")
    widths = tuple(int(n) for n in widths) if isinstance(widths, list) else ()
    sources = kv_sources(list(types), int(meta("attention.shared_kv_layers", 0) or 0))
    scales = meta("activation_sparsity_scale") or []
    shares = tuple(0.5 * (1.0 + math.erf(float(m) / math.sqrt(2.0))) for m in scales)  # the normal CDF: Phi(Phi^-1(s))
    return dict(
        hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden), attention_scale=1.0,
        qk_norm=True, qk_norm_scope="head", v_norm=True, sliding_window=int(meta("attention.sliding_window")),
        layer_types=types, final_logit_softcapping=meta("final_logit_softcapping") or None,
        local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (),
        kv_source_layers=sources if sources != tuple(range(layers)) else (),
        hidden_size_per_layer_input=int(meta("embedding_length_per_layer_input")),
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"].shape[1]),
        altup_num_inputs=int(meta("altup.num_inputs", 4)), altup_active_idx=int(meta("altup.active_idx", 0)),
        laurel_rank=int(tensors["blk.0.laurel_l.weight"].shape[1]),
        activation_sparsity=shares if any(shares) else ())


def _gemma4(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Gemma4Model: key_length is the global layers' head dim (key_length_swa the sliding
    ones'), head_count_kv and feed_forward_length per layer where they differ, the sliding pattern per layer, the
    last shared_kv_layers layers reading earlier K/V, v = k where a global layer has no attn_v, and the
    proportional rope as rope_freqs (1 for the pairs that turn, 1e30 for the rest); norms hold w as HF does."""
    layers, hidden = base["num_hidden_layers"], base["hidden_size"]
    types = _layer_types(meta("attention.sliding_window_pattern"), layers, 6)
    sliding, full = int(meta("attention.key_length_swa", base["head_dim"])), base["head_dim"]
    dims = tuple(sliding if kind == "sliding_attention" else full for kind in types)
    kv = meta("attention.head_count_kv")
    kv_heads = tuple(int(n) for n in kv) if isinstance(kv, list) else (int(kv),) * layers
    widths = meta("feed_forward_length")
    widths = tuple(int(n) for n in widths) if isinstance(widths, list) else ()
    sources = kv_sources(list(types), int(meta("attention.shared_kv_layers", 0) or 0))
    owners_full = [i for i in range(layers) if sources[i] == i and types[i] == "full_attention"]
    ple = int(meta("embedding_length_per_layer_input", 0) or 0)
    fields: dict[str, Any] = dict(
        hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden), attention_scale=1.0,
        qk_norm=True, qk_norm_scope="head", v_norm=True, sliding_window=int(meta("attention.sliding_window")),
        layer_types=types,
        final_logit_softcapping=meta("final_logit_softcapping") or None, head_dim=sliding,
        num_key_value_heads=kv_heads[0], local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
        layer_head_dims=dims if len(set(dims)) > 1 else (), layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else (),
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (), intermediate_size=widths[0] if widths else
        base["intermediate_size"], kv_source_layers=sources if sources != tuple(range(layers)) else (),
        attention_k_eq_v=bool(owners_full) and all(f"blk.{i}.attn_v.weight" not in tensors for i in owners_full),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"].shape[1]) if ple else 0)
    return fields


def _gpt_oss(meta, base: dict[str, Any], window: Any) -> dict[str, Any]:
    """What llama.cpp fixes for `gpt-oss` (src/models/openai-moe.cpp): sinks, biases everywhere, the top-k logits
    softmaxed, the clamped SwiGLU at alpha 1.702 and limit 7, every 2nd layer full attention by default.

    YaRN is kept untruncated, as every gpt-oss config.json says (`truncate: false`, OpenAI's reference); llama.cpp
    rounds the ramp's ends to whole dims (docs/models.md, known differences)."""
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn":
        scaling = dict(scaling, truncate=False)
    fields: dict[str, Any] = dict(rope_scaling=scaling, attention_sinks=True, moe_scoring="topk_softmax",
                                  moe_linear_bias=True, moe_activation="swiglu_oai", swiglu_alpha=1.702,
                                  swiglu_limit=7.0)
    if window:
        fields.update(sliding_window=int(window), layer_types=_layer_types(
            meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 2))
    return fields


def _deepseek2(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """llama.cpp's `deepseek2` (src/models/deepseek2.cpp) as DeepSeek-V3: MLA widths from the lora ranks,
    key_length_mla / value_length_mla (older files: key_length / value_length) and rope.dimension_count; the
    rotary pairs stay interleaved in the file (llama.cpp's NORM rope, no permute); experts after
    leading_dense_block_count layers, routed by sigmoid (expert_gating_func 2) only."""
    rope_dim = int(meta("rope.dimension_count"))
    key_mla = meta("attention.key_length_mla")
    key_mla, value_mla = ((int(key_mla), int(meta("attention.value_length_mla"))) if key_mla is not None
                          else (base["head_dim"], int(meta("attention.value_length"))))
    dims = MLADims(q_lora_rank=int(meta("attention.q_lora_rank", 0)), kv_lora_rank=int(meta("attention.kv_lora_rank")),
                   qk_nope_head_dim=key_mla - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=value_mla)
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn" and meta("rope.scaling.yarn_log_multiplier"):
        # the converter wrote 0.1 * mscale_all_dim; the released configs have mscale == mscale_all_dim
        mscale = float(meta("rope.scaling.yarn_log_multiplier")) / 0.1
        scaling = dict(scaling, mscale=mscale, mscale_all_dim=mscale)
    layers, num_experts = base["num_hidden_layers"], int(meta("expert_count", 0))
    fields = dict(mla=dims, num_key_value_heads=1, head_dim=rope_dim, rope_scaling=scaling,
                  attention_scale=softmax_scale(key_mla, scaling or {}), dense_mlp_layers=tuple(range(layers)))
    if not num_experts:
        return fields
    if int(meta("expert_gating_func", 0)) != 2:  # llama.cpp's default is softmax (DeepSeek-V2)
        raise ValueError("deepseek2 routing other than sigmoid (expert_gating_func 2) is not supported")
    width, dense = int(meta("expert_feed_forward_length")), int(meta("leading_dense_block_count", 0))
    return dict(fields, num_experts=num_experts, num_experts_per_tok=int(meta("expert_used_count")),
                moe_intermediate_size=width, norm_topk_prob=bool(meta("expert_weights_norm", False)),
                moe_scoring="sigmoid", moe_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
                moe_renorm_eps=1e-20, moe_num_groups=int(meta("expert_group_count", 1) or 1),
                moe_topk_groups=int(meta("expert_group_used_count", 1) or 1),
                routed_scaling_factor=float(meta("expert_weights_scale", 1.0) or 1.0),
                shared_expert_intermediate_size=width * int(meta("expert_shared_count", 0)),
                dense_mlp_layers=tuple(range(min(dense, layers))))


def _llama4(meta, base: dict[str, Any], window: Any) -> dict[str, Any]:
    """What llama.cpp fixes for `llama4` (src/models/llama4.cpp): unless the file says sliding_window 0 (every
    layer rotary, unchunked), every 4th layer is NoPE with temperature 0.1 by floor 8192 and offset 1, and the
    rotary layers attend in 8192-token chunks; q/k L2-norm except with 128 experts (Maverick); q/k not permuted."""
    layers, width = base["num_hidden_layers"], base["moe_intermediate_size"]
    fields: dict[str, Any] = dict(rope_interleaved=True, qk_l2_norm=base["num_experts"] != 128,
                                  shared_expert_intermediate_size=width, moe_scoring="sigmoid", moe_weight_input=True)
    if window is not None and int(window) == 0:
        return fields
    step = int(meta("attention.sliding_window_pattern", 4))
    return dict(fields, no_rope_layers=tuple(i for i in range(layers) if (i + 1) % step == 0),
                attn_temperature_beta=0.1, attn_temperature_length=8192, attn_temperature_offset=1,
                attn_temperature_nope_only=True, attention_chunk=8192)


def _smollm3(meta, base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp hard-codes SmolLM3's NoPE step (every 4th layer) and ignores its window
    return dict(no_rope_layers=tuple(range(3, base["num_hidden_layers"], 4)))


def _ministral3(meta, base: dict[str, Any]) -> dict[str, Any]:
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn" and meta("rope.scaling.yarn_log_multiplier"):
        # llama.cpp's attention factor: mscale 1 over mscale_all_dim = the log multiplier
        scaling = dict(scaling, mscale=1.0, mscale_all_dim=float(meta("rope.scaling.yarn_log_multiplier")))
    beta = float(meta("attention.temperature_scale", 0.0) or 0.0)
    original = (scaling or {}).get("original_max_position_embeddings", 0)
    if beta and not original:
        raise ValueError("attention.temperature_scale without rope.scaling.original_context_length")
    return dict(rope_scaling=scaling, attn_temperature_beta=beta, attn_temperature_length=int(original))


def _glm4(meta, base: dict[str, Any]) -> dict[str, Any]:
    rotary = int(meta("rope.dimension_count", base["head_dim"] // 2))
    return dict(norm_layout="sandwich", rope_interleaved=True, partial_rotary_factor=rotary / base["head_dim"])


def _exaone4(meta, base: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = dict(norm_layout="post")
    window = meta("attention.sliding_window")
    if window:  # the global layers are NoPE
        types = _layer_types(meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 4)
        fields.update(sliding_window=int(window), layer_types=types,
                      no_rope_layers=tuple(i for i, kind in enumerate(types) if kind != "sliding_attention"))
    return fields


# GGUF architecture -> (meta, the fields read so far) -> what that family adds (issue #25's families).
DENSE_FAMILY_FIELDS = {
    "smollm3": _smollm3, "mistral3": _ministral3, "glm4": _glm4, "exaone4": _exaone4,
    "ernie4_5": lambda meta, base: dict(rope_interleaved=True),  # rotated as HF does: no permute to undo
    "seed_oss": lambda meta, base: {},
    # the file's rope base already holds the NTK-alpha stretch
    "hunyuan-dense": lambda meta, base: dict(qk_norm_after_rope=True),
    "apertus": lambda meta, base: dict(hidden_act="xielu"),
}


def _layer_types(pattern: Any, num_layers: int, default: int) -> tuple[str, ...]:
    """llama.cpp's sliding-window pattern (a bool per layer, or every n-th layer global) as HF layer types."""
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern or default)
        sliding = [(i + 1) % n != 0 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _moe_fields(architecture: str, meta, tensors: dict, num_layers: int) -> dict[str, Any]:
    """Experts, from llama.cpp's metadata; a layer without a router (ffn_gate_inp) keeps a dense MLP."""
    if architecture not in _NORM_TOPK or not meta("expert_count", 0):  # Gemma 4: only 26B-A4B has experts
        return {}
    width = meta("expert_feed_forward_length", 0) or meta("feed_forward_length")
    return dict(num_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                moe_intermediate_size=int(width),
                norm_topk_prob=_NORM_TOPK[architecture],
                dense_mlp_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors))


def _rope_scaling(reader: gguf.GGUFReader, arch: str, tensors: dict, source: str) -> dict[str, Any] | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:  # Phi-3's su/longrope: both factor sets are stored
        return _longrope_from_tensors(reader, arch, tensors, source)
    if arch == "gemma4":
        return _gemma4_rope(reader, tensors)
    if "rope_freqs.weight" in tensors:
        # Llama 3.x: llama.cpp stores the per-frequency factors, not the parameters that made them.
        freqs = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        return _llama3_scaling_from_factors(np.asarray(freqs, dtype=np.float64).reshape(-1), reader, arch, source)
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn") or factor is None:
        raise LoadError(f"{source}: unsupported rope scaling {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key in ("beta_fast", "beta_slow"):  # YaRN's ramp ends, where the converter wrote them
        value = field_value(reader, f"{arch}.rope.scaling.yarn_{key}")
        if value is not None:
            scaling[key] = float(value)
    return scaling


def _gemma4_rope(reader: gguf.GGUFReader, tensors: dict) -> dict[str, Any] | None:
    """Gemma 4's global layers: "proportional" rope, the pairs that turn marked 1 in rope_freqs (the rest 1e30)."""
    if "rope_freqs.weight" not in tensors:
        return None
    tensor = tensors["rope_freqs.weight"]
    factors = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    turning = int((factors < 1e10).sum())
    return {"rope_type": "proportional", "partial_rotary_factor": turning / len(factors)}


def _longrope_from_tensors(reader: gguf.GGUFReader, arch: str, tensors: dict, source: str) -> dict[str, Any]:
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise LoadError(f"{source}: longrope factors without {arch}.rope.scaling.original_context_length")

    def factors(name: str) -> list[float]:
        tensor = tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float64).reshape(-1).tolist()

    scaling = {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
               "short_factor": factors("rope_factors_short.weight"), "original_max_position_embeddings": int(original)}
    attn_factor = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def _llama3_scaling_from_factors(factors: np.ndarray, reader: gguf.GGUFReader, arch: str,
                                 source: str) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling dict; every Llama 3.x release uses low=1, high=4, original=8192."""
    theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * len(factors)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = llama3_rope_factors(scaling, theta, dim)
    if not np.allclose(expected, factors, rtol=1e-3):
        raise LoadError(f"{source}: rope_freqs tensor does not match any Llama 3 rope scaling we know")
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The divisor llama.cpp (and HF's llama3 rope) applies to each rotary frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # 2*pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, out)
    return np.where(wavelen > original / low, factor, out)
