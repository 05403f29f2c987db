"""Mamba2 families (Granite 4.0-H dense and with experts, Nemotron-H, Falcon-H1, Mamba2) match transformers
(float32) from the files save_pretrained writes: logits at prefill and over greedy decode steps, the Mamba2
conv window and SSM state carried in a state slot, and greedy tokens equal to hf.generate."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.models.cache_specs import KVSpec, StateSpec
from conveyor.models.config import ModelConfig, ModelConfigError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, max_position_embeddings=256)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2)
# Mamba2 of width 128 (4 heads x 32), 2 groups of B/C with state 16, a conv of width 4
GRANITE_MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4)


def _config(family: str, **overrides):
    if family in ("granite", "granite_moe"):
        experts = dict(num_local_experts=4, num_experts_per_tok=2) if family == "granite_moe" else dict(
            num_local_experts=0)
        return transformers.GraniteMoeHybridConfig(**{
            **SMALL, **ATTENTION, **GRANITE_MAMBA, **experts, "num_hidden_layers": 4, "intermediate_size": 32,
            "shared_intermediate_size": 96, "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "position_embedding_type": "rope" if family == "granite_moe" else None,
            "embedding_multiplier": 3.0, "attention_multiplier": 0.2, "residual_multiplier": 0.7,
            "logits_scaling": 2.5, **overrides})
    if family == "nemotron_h":
        return transformers.NemotronHConfig(**{
            **SMALL, **ATTENTION, "head_dim": 16, "intermediate_size": 96, "hybrid_override_pattern": "M-*E",
            "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5,
            **overrides})
    if family in ("falcon_h1", "falcon_h1_norm"):
        return transformers.FalconH1Config(**{
            **SMALL, **ATTENTION, "num_hidden_layers": 3, "intermediate_size": 96, "mamba_d_ssm": 128,
            "mamba_n_heads": 4, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
            "mamba_rms_norm": family == "falcon_h1_norm", "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
            "ssm_in_multiplier": 1.3, "ssm_multipliers": [0.9, 1.1, 0.8, 1.2, 0.7], "ssm_out_multiplier": 0.6,
            "attention_in_multiplier": 1.2, "key_multiplier": 0.8, "attention_out_multiplier": 0.9,
            "mlp_multipliers": [1.4, 0.75], **overrides})
    if family == "mamba2":
        return transformers.Mamba2Config(**{
            **SMALL, "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16, "expand": 2, "state_size": 16,
            "n_groups": 2, "conv_kernel": 4, **overrides})
    raise ValueError(family)


def hf_mamba2_hybrid(family: str, **overrides):
    """A tiny random-weight transformers model of the family: norms, A_log, dt_bias, D, the conv bias, routers and
    the experts' correction bias randomized, so a term we skipped would show."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("A_log", "dt_bias", "conv1d.bias")):
                p.normal_(0, 0.5)
            elif name.endswith(".D"):
                p.normal_(1, 0.5)
            elif name.endswith(("router.weight", "gate.weight")):  # routing that varies by token
                p.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return model


def _runner(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    return float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))


@pytest.mark.parametrize("family", ["granite", "granite_moe", "nemotron_h", "falcon_h1", "falcon_h1_norm", "mamba2"])
def test_logits_and_greedy_tokens_match_transformers(family, tmp_path):
    hf = hf_mamba2_hybrid(family)
    runner = _runner(hf, tmp_path)
    prompt, tokens = greedy_matches_transformers(runner, hf)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: the prompt holds Mamba2's pad id (1), which generate would mask out
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_dt_limits_clamp_as_the_chunked_scan_does(tmp_path):
    """time_step_limit binds here: every step matches transformers' forward over the whole sequence (its
    chunked scan clamps dt). Its cached one-token branch skips the clamp, so hf.generate is not compared."""
    hf = hf_mamba2_hybrid("mamba2", time_step_limit=(0.2, 0.9))
    greedy_matches_transformers(_runner(hf, tmp_path), hf)


def test_cache_specs_name_what_each_layer_keeps(tmp_path):
    runner = _runner(hf_mamba2_hybrid("falcon_h1"), tmp_path)
    # every Falcon-H1 layer: a Mamba2 state (conv window 128 + 2 x 2 x 16 channels x 3, SSM 4 heads x 32 x 16)
    # beside its attention's K/V
    assert runner.model.cache_specs() == [StateSpec(((192, 3), (4, 32, 16))), KVSpec(2, 16)] * 3
    assert runner.model.config.num_attention_layers == 3
    nemotron = ModelConfig.from_hf_dict(hf_mamba2_hybrid("nemotron_h").config.to_dict())
    assert nemotron.layer_types == ("mamba", "mlp", "full_attention", "moe") and nemotron.num_attention_layers == 1
    assert nemotron.num_hidden_layers == 4 and nemotron.rotary_dim == 0  # no rotary (NoPE)


def test_hub_config_spellings(tmp_path):
    """Granite's legacy layer names, Nemotron-H's pattern string, transformers' JSON infinity."""
    raw = json.loads(_config("granite").to_json_string())
    raw.update(layer_types=["mamba", "attention", "mamba", "mamba"], time_step_limit=[0.0, {"__float__": "Infinity"}])
    granite = ModelConfig.from_hf_dict(raw)
    assert granite.layer_types == ("mamba", "full_attention", "mamba", "mamba") and granite.mamba_dt_max == float("inf")
    raw = {**_config("nemotron_h").to_dict(), "hybrid_override_pattern": "M*M-"}
    raw.pop("layers_block_type")
    assert ModelConfig.from_hf_dict(raw).layer_types == ("mamba", "full_attention", "mamba", "mlp")


@pytest.mark.parametrize("family,change,named", [
    ("nemotron_h", {"moe_latent_size": 16}, "moe_latent_size"),
    ("nemotron_h", {"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ("granite", {"attention_bias": True}, "attention_bias"),
    ("falcon_h1", {"projectors_bias": True}, "projectors_bias"),
    ("mamba2", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_features_we_cannot_match_are_refused_by_name(family, change, named):
    raw = {**json.loads(_config(family).to_json_string()), **change}
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.from_hf_dict(raw)
