"""Gemma 2/3, Granite, OLMo 2/3, Phi-3 and issue #25's dense families' GGUF files as llama.cpp's converter writes them: loaded, their
logits equal transformers' on the model the file was written from (float32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_checkpoints import write_family_gguf, write_gemma3n_gguf, write_gemma4_gguf

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import load_checkpoint
from conveyor.models.registry import build_model
from conveyor.runner.model_runner import ModelRunner

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def _hf_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "gemma3":  # six layers: llama.cpp's default pattern makes the sixth global
        return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16, sliding_window=5,
                                             query_pre_attn_scalar=16)
    if arch == "gemma2":
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
    if arch == "granite":
        return transformers.GraniteConfig(**COMMON, embedding_multiplier=3.0, attention_multiplier=0.3,
                                          residual_multiplier=0.5, logits_scaling=4.0)
    if arch == "olmo2":
        return transformers.Olmo2Config(**COMMON)
    if arch in ISSUE25:
        return ISSUE25[arch]()
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
            "long_factor": (2 + torch.rand(8, generator=gen)).tolist()}
    return transformers.Phi3Config(**COMMON, pad_token_id=0, original_max_position_embeddings=8, rope_scaling=rope)


_TOKENS = dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
         "beta_slow": 1.0}
# GGUF architecture -> the HF config it is converted from (as tests/models/test_llama_vs_hf.py builds them).
ISSUE25 = {
    # four layers: llama.cpp's fixed NoPE step makes the fourth NoPE, as transformers' default interval
    "smollm3": lambda: transformers.SmolLM3Config(**{**_TOKENS, "num_hidden_layers": 4}),
    "mistral3": lambda: transformers.Ministral3Config(**_TOKENS, head_dim=16, rope_parameters={
        **_YARN, "rope_theta": 1e6, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}),
    "olmo3": lambda: transformers.Olmo3Config(**_TOKENS, sliding_window=5,
                                              layer_types=["sliding_attention", "full_attention"],
                                              rope_parameters={"full_attention": {**_YARN, "rope_theta": 5e5},
                                                               "sliding_attention": {"rope_type": "default",
                                                                                     "rope_theta": 5e5}}),
    "glm4": lambda: transformers.Glm4Config(**_TOKENS, head_dim=32),
    "exaone4": lambda: transformers.Exaone4Config(**_TOKENS, head_dim=16, sliding_window=5, sliding_window_pattern=2),
    "ernie4_5": lambda: transformers.Ernie4_5Config(**_TOKENS, head_dim=16),
    "seed_oss": lambda: transformers.SeedOssConfig(**_TOKENS, head_dim=16),
    "hunyuan-dense": lambda: transformers.HunYuanDenseV1Config(**_TOKENS, head_dim=16, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0}),
    "apertus": lambda: transformers.ApertusConfig(**_TOKENS),
}


# Gemma 4: global layers with their own head dim, one K/V head and v = k; the last two layers read layers 2 and 3's
# K/V (double-wide MLP); per-layer embeddings; sliding windows shorter than the prompt
GEMMA4 = dict(_TOKENS, num_hidden_layers=6, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=256, sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 3,
              final_logit_softcapping=30.0)
# Gemma 4 26B-A4B's shape: the dense MLP beside 4 GeGLU experts in every layer (router scale, per-expert scale)
GEMMA4_EXPERTS = dict(_TOKENS, num_hidden_layers=3, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                      attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=5, enable_moe_block=True,
                      num_experts=4, top_k_experts=2, moe_intermediate_size=48,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"])
# Gemma 3n: AltUp (4 streams), LAuReL, a sparse gate on the first two layers, per-layer widths, shared K/V, PLE (its
# table as wide as the vocabulary: the converter pads it so, and pads with zeros where transformers reads row 0)
GEMMA3N = dict(_TOKENS, intermediate_size=[96, 96, 128, 96, 96, 128], num_hidden_layers=6, head_dim=16,
               sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, laurel_rank=8,
               activation_sparsity_pattern=[0.95, 0.9, 0.0, 0.0, 0.0, 0.0],
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "granite", "olmo2", "phi3", *ISSUE25, "gemma4", "gemma4_experts",
                                  "gemma3n"])
def test_gguf_logits_match_transformers(tmp_path, arch: str) -> None:
    torch.manual_seed(0)
    config = (transformers.Gemma4TextConfig(**GEMMA4) if arch == "gemma4" else
              transformers.Gemma4TextConfig(**GEMMA4_EXPERTS) if arch == "gemma4_experts" else
              transformers.Gemma3nTextConfig(**GEMMA3N) if arch == "gemma3n" else _hf_config(arch))
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 0 or 1; randomize so a swapped or skipped norm cannot pass
        for name, param in hf.named_parameters():
            if "norm" in name or ".act_fn." in name or name.endswith("correct_output_scale"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(("correction_coefs.weight", "prediction_coefs.weight")):  # Gemma 3n's AltUp
                param.normal_(0, 0.3)
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's experts: ones at init
                param.copy_(0.5 + torch.rand_like(param))
            elif name.endswith(("router.proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # sharp attention: a wrong rotary order or NoPE layer shows
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, 1 at init
                buffer.copy_(0.5 + torch.rand_like(buffer))
    path = tmp_path / f"tiny-{arch}.gguf"
    if arch in ("gemma4", "gemma4_experts", "gemma3n"):
        (write_gemma3n_gguf if arch == "gemma3n" else write_gemma4_gguf)(path, hf)
    else:
        write_family_gguf(path, "olmo2" if arch == "olmo3" else arch, hf)  # OLMo 3 converts as olmo2
    ck = load_checkpoint(str(path))
    model = build_model(ck.config, ck.weights, torch.float32, torch.device("cpu"), batch_invariant=False)
    runner = ModelRunner(model, ck.config, num_blocks=16, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), ops=model.ops)
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    chunk = ScheduledChunk("r", prompt, 0, [3, 1, 7, 5], True, SamplingParams(temperature=0))
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    ours = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, torch.arange(len(prompt)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
