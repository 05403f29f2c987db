"""Hybrid families (LFM2, Qwen3.5) match transformers (float32) from the files save_pretrained writes:
logits at prefill and over greedy decode steps, recurrent state carried in a state slot."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.models.cache_specs import KVSpec, StateSpec
from conveyor.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)


def hf_hybrid(family: str, **overrides):
    """A tiny random-weight transformers model of the family (norms randomized so a skipped one shows)."""
    if family == "lfm2":
        cfg = transformers.Lfm2Config(**{**COMMON, "intermediate_size": 144,
                                         "layer_types": ["conv", "full_attention", "conv", "conv"], **overrides})
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**{**COMMON, "head_dim": 16, "intermediate_size": 96,
                                                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                                "linear_key_head_dim": 8, "linear_value_head_dim": 8, **overrides})
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("A_log", "dt_bias")):
                p.normal_(0, 0.5)
    return model


def _runner(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    return float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_logits_match_transformers(family, tmp_path):
    hf = hf_hybrid(family)
    runner = _runner(hf, tmp_path)
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_cache_specs_name_what_each_layer_keeps(tmp_path):
    runner = _runner(hf_hybrid("qwen3_5"), tmp_path)
    specs = runner.model.cache_specs()
    # three gated DeltaNet layers (conv window 2*16 + 32 channels x 3, state 4 heads x 8 x 8), one attention layer
    assert specs == [StateSpec(((64, 3), (4, 8, 8)))] * 3 + [KVSpec(2, 16)]
    assert runner.model.config.num_attention_layers == 1
    lfm2 = ModelConfig.from_hf_dict(hf_hybrid("lfm2").config.to_dict())
    assert lfm2.layer_types == ("conv", "full_attention", "conv", "conv") and lfm2.conv_kernel_size == 3
    assert lfm2.intermediate_size == 256  # 2/3 of 144, rounded up to a multiple of 256, as transformers sizes it
