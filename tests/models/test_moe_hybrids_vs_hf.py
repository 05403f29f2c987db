"""Hybrids with sparse MoE MLPs (Qwen3-Next, Qwen3.5-MoE, LFM2-MoE) match transformers (float32) from the
files save_pretrained writes: logits at prefill and over greedy decode steps, and transformers' own greedy
tokens. Multimodal Qwen3.5 / Qwen3.5-MoE directories load their text part."""

import json

import pytest
import tokenizers
import torch
from hf_compare import float32_runner, greedy_matches_transformers
from safetensors.torch import load_file, save_file

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import cpu_backend
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import select_weights
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid import MoEMixer
from conveyor.models.registry import build_model

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
COMMON = dict(**BASE, num_experts=4, num_experts_per_tok=2)
DELTANET = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8)
QWEN3_5_TEXT = dict(**BASE, **DELTANET, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"])
QWEN3_5_MOE = dict(**QWEN3_5_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)


def hf_config(family: str):
    if family == "qwen3_next":  # layer 2 keeps a dense MLP; top-k weights not renormalised (Qwen3.5-MoE's always are)
        return transformers.Qwen3NextConfig(**COMMON, **DELTANET, num_hidden_layers=4, intermediate_size=96,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                            mlp_only_layers=[2], norm_topk_prob=False)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE)
    if family == "lfm2_moe":  # layer 0 dense; sigmoid router with expert bias, weights scaled after renormalising
        return transformers.Lfm2MoeConfig(**COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                                          num_dense_layers=1, routed_scaling_factor=1.5,
                                          layer_types=["conv", "full_attention", "conv"])
    raise ValueError(family)


def randomized(model):
    """Norms, decay parameters, routers, shared-expert gates and expert biases off their initial values, so a
    skipped or misread term shows in the logits."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("A_log", "dt_bias", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
            elif name.endswith(".gate.weight"):  # routers: spread out, so rows pick different experts
                p.normal_(0, 0.5)
            elif name.endswith("expert_bias"):  # sigmoid scores lie in (0, 1): a bias this size changes picks
                p.normal_(0, 0.2)
    return model.eval()


def hf_model(family: str):
    torch.manual_seed(0)
    return randomized(transformers.AutoModelForCausalLM.from_config(hf_config(family)))


def _runner(hf, tmp_path):
    hf.save_pretrained(tmp_path)  # the Hub layout: one tensor per expert
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    return float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))


def _assert_greedy_matches(runner, hf) -> None:
    prompt, tokens = greedy_matches_transformers(runner, hf)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[len(prompt):] == theirs


SPARSE = {"qwen3_next": [True, True, False, True], "qwen3_5_moe": [True] * 3, "lfm2_moe": [False, True, True]}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "lfm2_moe"])
def test_logits_match_transformers(family, tmp_path):
    hf = hf_model(family)
    runner = _runner(hf, tmp_path)
    assert [isinstance(layer.mixers[-1], MoEMixer) for layer in runner.model.layers] == SPARSE[family]
    _assert_greedy_matches(runner, hf)


def test_config_fields():
    nxt = ModelConfig.from_hf_dict(hf_config("qwen3_next").to_dict())
    assert nxt.architecture == "qwen3_next" and nxt.dense_mlp_layers == (2,) and not nxt.norm_topk_prob
    assert (nxt.shared_expert_intermediate_size, nxt.partial_rotary_factor, nxt.norm_weight_offset) == (48, 0.25, 1.0)
    stepped = ModelConfig.from_hf_dict({**hf_config("qwen3_next").to_dict(), "mlp_only_layers": [],
                                        "decoder_sparse_step": 2})
    assert stepped.dense_mlp_layers == (0, 2)  # sparse where (i + 1) % step == 0
    moe = ModelConfig.from_hf_dict(hf_config("qwen3_5_moe").to_dict())
    assert moe.norm_topk_prob and moe.dense_mlp_layers == () and moe.moe_scoring == "softmax"
    lfm = ModelConfig.from_hf_dict(hf_config("lfm2_moe").to_dict())
    assert (lfm.moe_scoring, lfm.moe_expert_bias, lfm.routed_scaling_factor) == ("sigmoid", True, 1.5)
    assert lfm.intermediate_size == 96 and lfm.dense_mlp_layers == (0,)  # the dense width as configured


def test_stacked_experts_load_as_per_expert_tensors(tmp_path):
    """Qwen3.5-MoE ships each layer's experts stacked (transformers' own parameters, (E, 2I, H) and (E, H, I))."""
    hf = hf_model("qwen3_5_moe")
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    stacked = hf.state_dict()
    assert stacked["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    ours = select_weights(config, stacked, "stacked")
    want = select_weights(config, load_file(tmp_path / "model.safetensors"), "per expert")
    assert ours.keys() == want.keys()
    assert all(torch.equal(ours[name], want[name]) for name in want)


def _write_tokenizer(folder) -> None:
    vocab = {f"t{i}": i for i in range(128)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_checkpoint_loads_its_text_part(family, tmp_path):
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    if family == "qwen3_5":
        cfg = transformers.Qwen3_5Config(text_config=dict(**QWEN3_5_TEXT, intermediate_size=96), vision_config=vision)
        cls = "Qwen3_5ForConditionalGeneration"
    else:
        cfg = transformers.Qwen3_5MoeConfig(text_config=QWEN3_5_MOE, vision_config=vision)
        cls = "Qwen3_5MoeForConditionalGeneration"
    torch.manual_seed(0)
    hf = randomized(getattr(transformers, cls)(cfg))
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert "model.language_model.embed_tokens.weight" in weights and "model.visual.pos_embed.weight" in weights
    save_file({**weights, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "model.safetensors")  # a Hub MTP head
    _write_tokenizer(tmp_path)

    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.config.architecture == f"{family}_text"
    assert not any("visual" in name or "mtp" in name for name in checkpoint.weights)
    assert set(checkpoint.mtp_weights) == {"mtp.fc.weight"}  # kept aside, for --draft-kind mtp only
    _assert_greedy_matches(float32_runner(checkpoint.config, checkpoint.weights), hf)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("family", ["qwen3_next", "lfm2_moe"])
def test_moe_mixer_rows_do_not_depend_on_batch_mates(family, tmp_path):
    """bf16 on our kernels: the shared expert's gate and LFM2-MoE's sigmoid scores are batch-invariant too."""
    hf_model(family).save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    weights = select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path))
    model = build_model(config, weights, torch.bfloat16, torch.device("cpu"), True,
                        ops=cpu_backend(kernel_settings_from_env()))
    block = model.layers[1].mixers[-1]
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    batched = block(x)
    assert torch.equal(torch.cat([block(x[i:i + 1]) for i in range(len(x))]), batched)
    assert torch.equal(block(x[5:12]), batched[5:12])
