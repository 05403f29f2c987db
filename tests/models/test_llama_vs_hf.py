"""Every family's logits match transformers (same weights) at prefill and over decode steps."""

import pytest
import torch

from hf_compare import float32_runner, greedy_matches_transformers

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
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; randomize so a skipped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _longrope() -> dict:
    gen = torch.Generator().manual_seed(3)
    short, long = (1 + torch.rand(8, generator=gen)).tolist(), (2 + torch.rand(8, generator=gen)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long}


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mistral", "mistral_window", "qwen2", "qwen3",
                                    "gemma3", "gemma2", "olmo2", "granite", "phi3"])
def test_logits_match_transformers(family):
    hf = _hf_model(family)
    runner = float32_runner(ModelConfig.from_hf_dict(hf.config.to_dict()), hf.state_dict())
    greedy_matches_transformers(runner, hf)
