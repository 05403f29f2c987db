"""Mixtral, Qwen3-MoE, OLMoE and Llama 4 (text) match transformers (float32) from the files save_pretrained writes:
logits at prefill and over greedy decode steps through the paged cache."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.loading.hf_loader import rename_weights
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.moe import SparseMoeBlock

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_experts_per_tok=2)


def _hf_model(family: str, **overrides):
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4)
    elif family == "qwen3_moe":  # layer 1 keeps a dense MLP; top-k weights not renormalised
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=48,
                                          num_experts=4, norm_topk_prob=False, mlp_only_layers=[1])
    elif family == "olmoe":  # renormalised here (OLMoE's default is not): both branches get checked
        cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=48, num_experts=5, norm_topk_prob=True)
    elif family == "llama4_text":
        # 4 layers: rotary+dense, rotary+MoE, rotary+dense, NoPE+MoE; floor_scale 4 so the NoPE layer's
        # temperature changes every 4 positions within the test; one chunk covers the whole test
        cfg = transformers.Llama4TextConfig(**{**COMMON, "num_experts_per_tok": 1, "num_hidden_layers": 4},
                                            head_dim=16, intermediate_size=48, intermediate_size_mlp=80,
                                            num_local_experts=4, interleave_moe_layer_step=2, floor_scale=4,
                                            attn_scale=0.5, attention_chunk_size=overrides.pop("attention_chunk_size", 256),
                                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                             "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 64},
                                            **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; randomize so a skipped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("mlp.gate.weight", "feed_forward.router.weight")):  # rows pick different experts
                p.normal_(0, 0.5)
            elif name.endswith(("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")):  # init 0.02
                p.normal_(0, 0.2)
    return model


def _runner(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # the Hub layout: one tensor per expert
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    weights = rename_weights(config.architecture, load_file(tmp_path / "model.safetensors"))
    return float32_runner(config, select_weights(config, weights, str(tmp_path)))


SPARSE_LAYERS = {"qwen3_moe": [True, False], "llama4_text": [False, True, False, True]}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "llama4_text"])
def test_logits_match_transformers(family, tmp_path):
    hf = _hf_model(family)
    runner = _runner(hf, tmp_path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.layers]
    assert sparse == SPARSE_LAYERS.get(family, [True, True])
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():  # and the greedy tokens are transformers' own
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_llama4_chunked_attention_across_chunks_matches_transformers(tmp_path):
    """Chunks of 4 positions: the 13-token prompt and its 6 greedy steps span five chunks, so every rotary
    layer's query attends only within its own chunk while the NoPE layer attends to everything."""
    hf = _hf_model("llama4_text", attention_chunk_size=4)
    runner = _runner(hf, tmp_path)
    assert runner.model.layers[0].self_attn.attend_window == -4 and runner.model.layers[3].self_attn.attend_window == 0
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_config_fields():
    qwen = ModelConfig.from_hf_dict(_hf_model("qwen3_moe").config.to_dict())
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (4, 2, 48)
    assert qwen.dense_mlp_layers == (1,) and not qwen.norm_topk_prob and qwen.qk_norm and qwen.qk_norm_scope == "head"
    stepped = ModelConfig.from_hf_dict({**qwen_raw(), "decoder_sparse_step": 2, "num_hidden_layers": 4})
    assert stepped.dense_mlp_layers == (0, 2)  # sparse where (i + 1) % step == 0
    olmoe = ModelConfig.from_hf_dict(_hf_model("olmoe").config.to_dict())
    assert olmoe.qk_norm and olmoe.qk_norm_scope == "full" and olmoe.moe_intermediate_size == 48
    mixtral = ModelConfig.from_hf_dict(_hf_model("mixtral").config.to_dict())
    assert mixtral.norm_topk_prob and mixtral.num_experts == 4 and not mixtral.qk_norm
    for raw, what in ((qwen_raw() | {"use_sliding_window": True}, "use_sliding_window"),
                      (_hf_model("olmoe").config.to_dict() | {"clip_qkv": 8.0}, "clip_qkv")):
        with pytest.raises(ModelConfigError, match=what):  # refused, never run differently
            ModelConfig.from_hf_dict(raw)


def qwen_raw() -> dict:
    return _hf_model("qwen3_moe").config.to_dict() | {"mlp_only_layers": []}


def test_llama4_config_fields():
    raw = _hf_model("llama4_text").config.to_dict()
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.no_rope_layers == (3,) and cfg.dense_mlp_layers == (0, 2) and cfg.rope_interleaved
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (80, 48, 48)
    assert cfg.moe_scoring == "sigmoid" and cfg.moe_weight_input and not cfg.norm_topk_prob and cfg.qk_l2_norm
    assert (cfg.attn_temperature_beta, cfg.attn_temperature_length, cfg.attn_temperature_offset) == (0.5, 4, 1)
    assert cfg.attention_chunk == 256 and cfg.rope_scaling["rope_type"] == "llama3"
    # Scout's layout: MoE every layer, NoPE every 4th; Maverick's moe_layers; no chunking, no cap
    scout = ModelConfig.from_hf_dict(raw | {"num_hidden_layers": 8, "interleave_moe_layer_step": 1, "moe_layers": None,
                                            "no_rope_layers": None, "layer_types": None})
    assert scout.no_rope_layers == (3, 7) and scout.dense_mlp_layers == ()
    maverick = ModelConfig.from_hf_dict(raw | {"moe_layers": [1], "attention_chunk_size": None,
                                               "attn_temperature_tuning": False})
    assert maverick.dense_mlp_layers == (0, 2, 3) and maverick.attention_chunk == 0
    assert maverick.attn_temperature_beta == 0.0
    # the Hub's multimodal config: its text_config is run
    wrapped = ModelConfig.from_hf_dict({"model_type": "llama4", "text_config": raw, "vision_config": {}})
    assert wrapped.architecture == "llama4_text" and wrapped.dense_mlp_layers == (0, 2)
