"""Gemma 2/3, Granite, OLMo 2 and Phi-3 GGUF files as llama.cpp's converter writes them: loaded, their
logits equal transformers' on the model the file was written from (float32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_checkpoints import write_family_gguf

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
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
            "long_factor": (2 + torch.rand(8, generator=gen)).tolist()}
    return transformers.Phi3Config(**COMMON, pad_token_id=0, original_max_position_embeddings=8, rope_scaling=rope)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "granite", "olmo2", "phi3"])
def test_gguf_logits_match_transformers(tmp_path, arch: str) -> None:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).eval()
    with torch.no_grad():  # norms start at 0 or 1; randomize so a swapped or skipped norm cannot pass
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_family_gguf(path, arch, hf)
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
