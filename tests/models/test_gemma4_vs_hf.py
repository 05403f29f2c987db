"""Gemma 4 (text) matches transformers (float32) from the files save_pretrained writes: logits at prefill and over
greedy decode steps through the paged cache, with sliding windows shorter than the prompt."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.loading.hf_loader import rename_weights
from conveyor.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, sliding_window=5, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
VARIANTS = {
    # every feature on: global layers with wider heads, one K/V head and v = k; the last two layers read layers
    # 2 and 3's K/V (double-wide MLP); per-layer embeddings; final soft-capping; proportional global rope
    "shared_kv_ple": dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                          global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                          num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                          vocab_size_per_layer_input=128, final_logit_softcapping=30.0),
    # the plainest Gemma 4: no PLE, no sharing, own v_proj, global layers 5:1 (the last forced global)
    # 26B-A4B's shape: every layer's dense MLP beside 4 GeGLU experts (top 2, renormalised, scaled per expert)
    "experts": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                    moe_intermediate_size=48),
    "plain": dict(num_hidden_layers=4, global_head_dim=32, hidden_size_per_layer_input=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                      "rope_theta": 1000.0}}),
}


def _hf_model(variant: str):
    cfg = transformers.Gemma4TextConfig(**COMMON, **VARIANTS[variant])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at 1.0 and layer scalars at 1; randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)  # sharp attention: a wrong rotary, window or K/V source shows past 1e-4
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # ones at init
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith(("router.proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.3)  # rows pick different experts; experts not negligible
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


def _runner(hf_model, tmp_path, edit=None):
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf_dict(edit(raw) if edit else raw)
    weights = rename_weights(config.architecture, load_file(tmp_path / "model.safetensors"))
    return float32_runner(config, select_weights(config, weights, str(tmp_path)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = _hf_model(variant)
    runner = _runner(hf, tmp_path)
    greedy_matches_transformers(runner, hf)


def test_kv_shared_layers_keep_no_cache(tmp_path):
    runner = _runner(_hf_model("shared_kv_ple"), tmp_path)
    cfg = runner.model.config
    assert cfg.kv_source_layers == (0, 1, 2, 3, 2, 3)
    assert cfg.layer_intermediate_sizes == (96, 96, 96, 96, 192, 192)
    # four layers own K/V (sliding: 2 heads x 16, global: 1 head x 32); layers 4 and 5 attend over 2's and 3's
    assert [(s.num_kv_heads, s.head_dim, s.window) for s in runner.cache_specs] == [(2, 16, 5), (1, 32, 0)] * 2
    assert runner.model.cache_index == [0, 1, 2, 3, 2, 3]


def test_released_config_keys(tmp_path):
    """A release's config.json names global_head_dim / num_global_key_value_heads and may omit rope_parameters
    (transformers' defaults: proportional rope on a quarter of the global heads) instead of per_layer_config."""
    hf = transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=6, global_head_dim=32, attention_k_eq_v=True,
                                       num_global_key_value_heads=1)
    raw = hf.to_dict()
    del raw["per_layer_config"], raw["rope_parameters"]
    config = ModelConfig.from_hf_dict({**raw, "global_head_dim": 32, "num_global_key_value_heads": 1})
    assert config.layer_head_dims == (16,) * 5 + (32,) and config.layer_kv_heads == (2,) * 5 + (1,)
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.norm_weight_offset == 0.0 and config.attention_scale == 1.0


def test_unsupported_gemma4_options_are_named():
    from conveyor.models.config import ModelConfigError

    raw = transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=2).to_dict()
    for key, value in (("use_bidirectional_attention", "all"), ("attention_bias", True)):
        with pytest.raises(ModelConfigError, match=key):
            ModelConfig.from_hf_dict({**raw, key: value})
