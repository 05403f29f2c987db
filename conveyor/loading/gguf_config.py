"""Read GGUF metadata: plain field values and the model config llama.cpp wrote.

What every file says the same way (shapes, norms, rope scaling, experts) is read here; what a family's converter
leaves to the architecture comes from that family's `gguf_fields` (models/family.py), found by the file's
`general.architecture`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import gguf
import numpy as np

from conveyor.loading.checkpoint import LoadError
from conveyor.models import family as families
from conveyor.models.config import ModelConfig, ModelConfigError


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
    family = families.for_gguf(arch)
    if family is None:
        what = families.gguf_not_yet(arch)
        if what:
            raise LoadError(f"{source}: GGUF architecture {arch!r} ({what}) is not supported yet; hybrids that load: "
                            f"{', '.join(families.gguf_architectures(hybrid_only=True))}")
        raise LoadError(f"{source}: unsupported GGUF architecture {arch!r}; supported: "
                        f"{', '.join(families.gguf_architectures())}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{source}: GGUF file has no token_embd.weight tensor")

    try:
        return _build_config(reader, arch, family, tensors, source)
    except (ModelConfigError, TypeError, ValueError) as exc:  # e.g. per-layer head counts (a list)
        raise LoadError(f"{source}: unusable GGUF metadata ({exc})") from exc


def _build_config(reader: gguf.GGUFReader, arch: str, family: families.Family, tensors: dict,
                  source: str) -> ModelConfig:
    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise LoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    q_norm = tensors.get("blk.0.attn_q_norm.weight")
    # Multi-token-prediction blocks (Qwen3.5's draft head) are counted in block_count, after the last layer.
    num_layers = int(meta("block_count")) - int(meta("nextn_predict_layers", 0))
    expert_width = field_value(reader, f"{arch}.expert_feed_forward_length")
    kv_heads = meta("attention.head_count_kv", heads)
    fields = dict(
        architecture=family.architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are reversed: (hidden, vocab)
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP and no feed_forward_length: the expert width stands in, as in its HF config
        intermediate_size=_first(meta("feed_forward_length", expert_width)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(kv_heads),
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
        **_moe_fields(meta, tensors, num_layers),
    )
    if family.gguf_fields is not None:
        shapes = {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}
        fields.update(family.gguf_fields(_family_meta(reader, arch), fields, shapes))
    if isinstance(kv_heads, list) and not fields.get("layer_kv_heads"):
        counts = {int(n) for n in kv_heads} - {0}
        if len(counts) > 1:  # (Gemma 4's global layers have their own: its layer_kv_heads)
            raise LoadError(f"{source}: per-layer K/V head counts {sorted(counts)} are not supported")
    return ModelConfig(**fields)


def _family_meta(reader: gguf.GGUFReader, arch: str) -> Callable[..., Any]:
    """What a family's gguf_fields reads metadata with: `meta(key, default)`, the file's `{arch}.{key}` (a
    `tokenizer.` or `general.` key whole), `default` when absent."""
    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, key if key.startswith(("tokenizer.", "general.")) else f"{arch}.{key}", default)
    return meta


def _first(value: Any) -> int:
    """A per-layer list's first entry (Gemma 4's sliding layers), or the one number."""
    return int(value[0] if isinstance(value, list) else value)


def _kv_heads(value: Any) -> int:
    """K/V heads: one number, or one per layer, where recurrent layers have 0 (LFM2 and the Mamba hybrids): the
    first layer's that has any."""
    if not isinstance(value, list):
        return int(value)
    return next((int(n) for n in value if int(n)), 0)


def _moe_fields(meta, tensors: dict, num_layers: int) -> dict[str, Any]:
    """Experts, from llama.cpp's metadata; a layer without a router (ffn_gate_inp) keeps a dense MLP. llama.cpp's
    build_moe_ffn renormalises the top-k weights whatever the metadata says; a family's gguf_fields says where not."""
    if not meta("expert_count", 0):  # Gemma 4: only 26B-A4B has experts
        return {}
    width = meta("expert_feed_forward_length", 0) or meta("feed_forward_length")
    return dict(num_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                moe_intermediate_size=int(width), norm_topk_prob=True,
                dense_mlp_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors))


def _rope_scaling(reader: gguf.GGUFReader, arch: str, tensors: dict, source: str) -> dict[str, Any] | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:  # Phi-3's su/longrope: both factor sets are stored
        return _longrope_from_tensors(reader, arch, tensors, source)
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores per-frequency divisors, not the parameters that made them: Llama 3.x's, or 1 for the pairs
        # that turn and 1e30 for those that never do (Gemma 4's "proportional" rope on its global layers).
        tensor = tensors["rope_freqs.weight"]
        factors = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
        frozen = factors > 1e10
        if frozen.any() and np.all(frozen | (factors == 1.0)):
            return {"rope_type": "proportional", "partial_rotary_factor": int((~frozen).sum()) / len(factors)}
        return _llama3_scaling_from_factors(factors, reader, arch, source)
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
