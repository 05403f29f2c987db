"""Every family's logits match transformers (same weights) at prefill and over decode steps."""

import pytest
import torch

from hf_compare import float32_runner, greedy_matches_transformers

from conveyor.loading.hf_loader import rename_weights
from conveyor.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _hf_model(family: str):
    if family == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 64})
    elif family == "llama_tied":
        cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**COMMON, sliding_window=None)
    elif family == "mistral_window":
        cfg = transformers.MistralConfig(**COMMON, sliding_window=5)  # shorter than the prompt on purpose
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=32)
    elif family == "gemma3":  # windows shorter than the prompt; global layers with scaled rope
        cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=32, sliding_window=5,
                                            sliding_window_pattern=2, query_pre_attn_scalar=24,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=4,
                                        attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
    elif family == "olmo2":
        cfg = transformers.Olmo2Config(**COMMON)
    elif family == "granite":
        cfg = transformers.GraniteConfig(**COMMON, embedding_multiplier=3.0, attention_multiplier=0.3,
                                         residual_multiplier=0.5, logits_scaling=4.0)
    elif family == "phi3":
        # The prompt outgrows the original context: transformers takes the long factors, as we do (fixed).
        cfg = transformers.Phi3Config(**COMMON, pad_token_id=0, original_max_position_embeddings=8,
                                      rope_scaling=_longrope())
    else:
        cfg = _new_family_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; randomize so a skipped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or ".act_fn." in name:  # act_fn: Apertus' xIELU scalars
                p.add_(torch.randn_like(p) * 0.1)
            elif family in NEW_FAMILIES and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)  # sharp attention: a wrong rotary (NoPE, interleaving, temperature) shows past 1e-4
    return model


# Special token ids inside the tiny vocabulary (these families' defaults lie past it).
TOKENS = dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _new_family_config(family: str):
    """The dense families of issue #25, each with what it changes switched on (biases where optional)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
            "beta_slow": 1.0}
    if family == "smollm3":  # layer 1 NoPE; every bias on
        return transformers.SmolLM3Config(**TOKENS, no_rope_layer_interval=2, attention_bias=True, mlp_bias=True)
    if family == "smollm3_window":  # the NoPE layer slides (transformers' layer_types), window < prompt
        return transformers.SmolLM3Config(**TOKENS, no_rope_layer_interval=2, use_sliding_window=True,
                                          sliding_window=5)
    if family == "ministral3":  # YaRN + Llama 4 temperature: floor(pos / 8) steps inside the test's 19 tokens
        return transformers.Ministral3Config(**TOKENS, head_dim=16, rope_parameters={
            **yarn, "rope_theta": 1e6, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3})
    if family == "olmo3":  # sliding layer (unscaled rope) + full layer with YaRN
        return transformers.Olmo3Config(**TOKENS, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"full_attention": {**yarn, "rope_theta": 5e5},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 5e5}})
    if family == "glm4":  # interleaved rotary on half of each head, sandwich norms, fused gate_up
        return transformers.Glm4Config(**TOKENS, head_dim=32)
    if family == "exaone4":  # local layer (rope, window < prompt) + global NoPE layer; post norms, QK-norm
        return transformers.Exaone4Config(**TOKENS, head_dim=16, sliding_window=5, sliding_window_pattern=2)
    if family == "ernie4_5":
        return transformers.Ernie4_5Config(**TOKENS, head_dim=16, use_bias=True)
    if family == "seed_oss":
        return transformers.SeedOssConfig(**TOKENS, head_dim=16, attention_out_bias=True, mlp_bias=True)
    if family == "hunyuan_v1_dense":  # QK-norm after rotary; NTK-alpha base
        return transformers.HunYuanDenseV1Config(**TOKENS, head_dim=16, attention_bias=True, rope_parameters={
            "rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0})
    if family == "apertus":  # xIELU MLP, QK-norm, llama3 rope
        return transformers.ApertusConfig(**COMMON)
    raise ValueError(family)


def _longrope() -> dict:
    gen = torch.Generator().manual_seed(3)
    short, long = (1 + torch.rand(8, generator=gen)).tolist(), (2 + torch.rand(8, generator=gen)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long}


NEW_FAMILIES = ["smollm3", "smollm3_window", "ministral3", "olmo3", "glm4", "exaone4", "ernie4_5", "seed_oss",
                "hunyuan_v1_dense", "apertus"]


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mistral", "mistral_window", "qwen2", "qwen3",
                                    "gemma3", "gemma2", "olmo2", "granite", "phi3", *NEW_FAMILIES])
def test_logits_match_transformers(family):
    hf = _hf_model(family)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    runner = float32_runner(config, rename_weights(config.architecture, hf.state_dict()))
    greedy_matches_transformers(runner, hf)
