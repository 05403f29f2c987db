"""DeepSeek-V3 (multi-head latent attention + grouped sigmoid MoE) matches transformers (float32) from the files
save_pretrained writes: logits at prefill and over greedy decode steps through the paged latent cache."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.mla_dims import softmax_scale
from conveyor.models.mla import MLAAttention
from conveyor.models.moe import SparseMoeBlock

transformers = pytest.importorskip("transformers")

# 3 layers: dense, then two MoE layers of 8 experts in 4 groups (2 eligible), top-2, one shared expert.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32,
            n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    "q_lora": dict(q_lora_rank=48),
    # q_proj straight from the hidden state, YaRN (its softmax mscale), rotate-half rope, no renormalisation
    "no_q_lora_yarn": dict(q_lora_rank=None, rope_parameters=YARN, rope_interleave=False, norm_topk_prob=False),
}


def hf_model(variant: str, **extra):
    cfg = transformers.DeepseekV3Config(**{**TINY, **VARIANTS[variant], **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at 1.0; randomize so a skipped norm cannot pass
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.normal_(0, 0.3)  # sharp attention: a wrong rotary order or scale must show
            elif name.endswith("mlp.gate.weight"):  # rows pick different experts
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # it shifts the choice only: make it matter
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _runner(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    return float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = hf_model(variant)
    runner = _runner(hf, tmp_path)
    layers = runner.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True, True]
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in layers)
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():  # and the greedy tokens are transformers' own
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_cache_holds_the_latent_only(tmp_path):
    """One (blocks, block, 1, kv_lora_rank + rope) tensor per layer, read as both K and V."""
    runner = _runner(hf_model("q_lora"), tmp_path)
    for key_cache, value_cache in runner.kv_layers():
        assert key_cache is value_cache and tuple(key_cache.shape[2:]) == (1, 32 + 16)


def test_config_fields():
    cfg = ModelConfig.from_hf_dict(hf_model("no_q_lora_yarn").config.to_dict())
    assert cfg.mla.q_lora_rank == 0 and cfg.mla.cache_width == 48 and cfg.head_dim == 16
    assert cfg.dense_mlp_layers == (0,) and (cfg.moe_num_groups, cfg.moe_topk_groups) == (4, 2)
    assert cfg.moe_scoring == "sigmoid" and cfg.moe_expert_bias and not cfg.norm_topk_prob
    assert cfg.routed_scaling_factor == 2.5 and cfg.shared_expert_intermediate_size == 32
    # transformers' own scale: qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
    attn = hf_model("no_q_lora_yarn").model.layers[0].self_attn
    assert cfg.attention_scale == pytest.approx(attn.scaling, rel=1e-12) and attn.scaling != 48 ** -0.5
    assert softmax_scale(48, {}) == 48 ** -0.5
    raw = hf_model("q_lora").config.to_dict()
    for bad, what in (({"scoring_func": "softmax"}, "scoring_func"), ({"attention_bias": True}, "attention_bias"),
                      ({"kv_lora_rank": 0}, "malformed"),
                      ({"quantization_config": {"quant_method": "fp8"}}, "fp8")):
        with pytest.raises(ModelConfigError, match=what):
            ModelConfig.from_hf_dict(raw | bad)
