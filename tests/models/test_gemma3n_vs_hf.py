"""Gemma 3n (text) matches transformers (float32) from the files save_pretrained writes: logits at prefill and over
greedy decode steps through the paged cache, with sliding windows shorter than the prompt."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

# Six layers (sliding, global) x 3: the last two read layers 2 and 3's K/V; per-layer MLP widths; the first two
# layers' gates sparse (gaussian top-k); AltUp with 4 streams, LAuReL of rank 8; PLE with a table smaller than the
# vocabulary (ids past it read row 0); a window of 5 inside the 13-token prompt.
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=[96, 96, 128, 96, 96, 128], num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
              layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=100, laurel_rank=8, altup_num_inputs=4,
              activation_sparsity_pattern=[0.95, 0.9, 0.0, 0.0, 0.0, 0.0], max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})


def _hf_model(**overrides):
    cfg = transformers.Gemma3nTextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at 1 and AltUp's scales at 0; randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("correct_output_scale"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("correction_coefs.weight", "prediction_coefs.weight")):
                p.normal_(0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)  # sharp attention: a wrong rotary, window or K/V source shows past 1e-4
    return model


def _runner(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    weights = load_file(tmp_path / "model.safetensors")
    return float32_runner(config, select_weights(config, weights, str(tmp_path)))


@pytest.mark.parametrize("overrides", [{}, {"altup_correct_scale": False, "altup_active_idx": 1,
                                            "num_kv_shared_layers": 0}], ids=["shared_kv", "plain_kv"])
def test_logits_match_transformers(overrides, tmp_path):
    hf = _hf_model(**overrides)
    runner = _runner(hf, tmp_path)
    greedy_matches_transformers(runner, hf)


def test_config_fields(tmp_path):
    runner = _runner(_hf_model(), tmp_path)
    cfg = runner.model.config
    assert cfg.kv_source_layers == (0, 1, 2, 3, 2, 3) and len(runner.cache_specs) == 4
    assert cfg.layer_intermediate_sizes == (96, 96, 128, 96, 96, 128)
    assert cfg.activation_sparsity == (0.95, 0.9, 0.0, 0.0, 0.0, 0.0)
    assert (cfg.altup_num_inputs, cfg.laurel_rank, cfg.vocab_size_per_layer_input) == (4, 8, 100)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["rope_type"]) == (1000.0, 100.0, "linear")
