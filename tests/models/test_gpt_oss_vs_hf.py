"""GPT-OSS matches transformers (float32) from the directory save_pretrained writes: logits at prefill and over
greedy decode steps through the paged cache, with sliding and full layers (a window shorter than the prompt),
attention sinks, YaRN, biased router and experts, and the clamped SwiGLU actually clamping."""

import json

import pytest
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import select_weights
from conveyor.loading.hf_loader import rename_weights
from conveyor.models.config import ModelConfig
from conveyor.models.moe import SparseMoeBlock
from tests.oracle import private_name

transformers = pytest.importorskip("transformers")

WINDOW = 5  # shorter than the 13-token test prompt


def hf_gpt_oss(**overrides):
    cfg = transformers.GptOssConfig(**{**dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, swiglu_limit=1.0,  # small, so that the clamps bite in the test
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
        **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * (1.0 if "sinks" in name else 0.1))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: windows and sinks matter
                p.normal_(0, 0.3)
            elif "router" in name:
                p.normal_(0, 0.5)
            elif "experts" in name or name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def _runner(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # the Hub layout: stacked experts, gate/up interleaved
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    weights = rename_weights(config.architecture, load_file(tmp_path / "model.safetensors"))
    return float32_runner(config, select_weights(config, weights, str(tmp_path)))


def test_logits_match_transformers(tmp_path):
    hf = hf_gpt_oss()
    runner = _runner(hf, tmp_path)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.layers)
    assert [layer.self_attn.window for layer in runner.model.layers] == [WINDOW, 0, WINDOW, 0]
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():  # and the greedy tokens are transformers' own
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


def test_sinks_and_clamps_change_the_output(tmp_path):
    """Guards the test above: without sinks, or without the clamp, the logits are clearly different."""
    hf = hf_gpt_oss()
    prompt = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(prompt).logits
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (hf(prompt).logits - want).abs().max() > 1e-2
    unclamped = hf_gpt_oss(swiglu_limit=100.0)
    with torch.no_grad():
        assert (unclamped(prompt).logits - want).abs().max() > 1e-2


def test_config_fields():
    cfg = ModelConfig.from_hf_dict(hf_gpt_oss().config.to_dict())
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == WINDOW
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 48)
    assert cfg.moe_scoring == "topk_softmax" and cfg.moe_linear_bias and cfg.moe_activation == "swiglu_oai"
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.0)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.rope_theta == 150000.0


def test_mxfp4_hub_experts_load_as_ggml_blocks(tmp_path):
    """The released checkpoints keep experts as MXFP4 `*_blocks` / `*_scales`: they load as GGML MXFP4 blocks holding
    exactly transformers' dequantized values, and the model then matches transformers run on those values."""
    from safetensors.torch import save_file
    convert_moe_packed_tensors = private_name("transformers.integrations.mxfp4:convert_moe_packed_tensors")

    from conveyor.loading.checkpoint import QuantizedTensor

    hf = hf_gpt_oss(intermediate_size=64)  # MXFP4 rows are whole 32-blocks
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    want = {}
    for i, layer in enumerate(hf.model.layers):
        for part, (rows, cols) in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64))):
            name = f"model.layers.{i}.mlp.experts.{part}"
            blocks = torch.randint(0, 256, (4, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(121, 127, (4, rows, cols // 32), generator=gen, dtype=torch.uint8)
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, cols, rows): inputs first
            with torch.no_grad():
                getattr(layer.mlp.experts, part).copy_(dense)
            want[name] = dense.transpose(1, 2)  # (E, rows, cols)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    weights = select_weights(config, rename_weights(config.architecture, load_file(tmp_path / "model.safetensors")),
                             str(tmp_path))
    gate = weights["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert isinstance(gate, QuantizedTensor) and gate.type_name == "MXFP4" and gate.shape == (64, 64)
    assert torch.equal(gate.dequantize(), want["model.layers.1.mlp.experts.gate_up_proj"][3, 0::2])
    up, down = (weights[f"model.layers.0.mlp.experts.2.{p}_proj.weight"].dequantize() for p in ("up", "down"))
    assert torch.equal(up, want["model.layers.0.mlp.experts.gate_up_proj"][2, 1::2])
    assert torch.equal(down, want["model.layers.0.mlp.experts.down_proj"][2])
    greedy_matches_transformers(float32_runner(config, weights), hf)


def test_the_released_20b_config():
    """gpt-oss-20b's config.json as published (rope in the older top-level keys, MXFP4 quantization_config)."""
    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts) == (64, 8, 64, 32)
    assert [cfg.window(i) for i in range(4)] == [128, 0, 128, 0] and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                "original_max_position_embeddings": 4096, "truncate": False}
    assert (cfg.moe_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit) == (2880, 1.702, 7.0)
