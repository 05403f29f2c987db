"""NomicBERT (models/nomic_bert.py) against transformers' NomicBertModel: every row of several sequences run in one
forward matches last_hidden_state, and each sequence's rows are bitwise those of running it alone."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import KernelSettings, resolve_backend
from conveyor.loading.hf_loader import load_hf_dir
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.registry import build_model
from tests.models.encoder_compare import (VOCAB, assert_rows_match_and_stand_alone, hf_rows, random_sequences,
                                          run_rows, write_dir)

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=128)
LENGTHS = (5, 11, 3, 40)


def _hf_model(kind: str, **overrides):
    cfg = transformers.NomicBertConfig(**{**TINY, **overrides}, attn_implementation="eager")
    torch.manual_seed(0)
    model = (transformers.NomicBertForMaskedLM if kind == "masked_lm" else transformers.NomicBertModel)(cfg).eval()
    with torch.no_grad():  # LayerNorms start at (1, 0): randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "token_type" in name:
                p.add_(1.0)  # a missing type-0 row shows
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)  # attention far from uniform: positions (rotary) matter
    return model


@pytest.mark.parametrize("kind", ["model", "masked_lm"])
def test_rows_match_transformers_and_alone(kind, tmp_path):
    hf = _hf_model(kind)
    checkpoint = load_hf_dir(write_dir(hf, tmp_path))
    config = checkpoint.config
    assert config.bidirectional and config.architecture == "nomic_bert" and config.rope_theta == 1000.0
    seqs = random_sequences(LENGTHS)
    encoder = hf.base_model
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        want = hf_rows(encoder.to(dtype), seqs)
        model = build_model(config, checkpoint.weights, dtype, torch.device("cpu"),
                            ops=resolve_backend(torch.device("cpu"), dtype))
        assert_rows_match_and_stand_alone(model, seqs, want, dtype, atol)



def test_torch_fallback_matches_transformers(tmp_path):
    """Without the C++ kernels (torch's paged attention, rotary and activations) the rows still match."""
    hf = _hf_model("model")
    checkpoint = load_hf_dir(write_dir(hf, tmp_path))
    ops = resolve_backend(torch.device("cpu"), torch.float32, settings=KernelSettings(disable=True))
    model = build_model(checkpoint.config, checkpoint.weights, torch.float32, torch.device("cpu"), ops=ops)
    seqs = random_sequences(LENGTHS)
    torch.testing.assert_close(run_rows(model, seqs, 0, torch.float32), hf_rows(hf.base_model, seqs), atol=1e-4,
                               rtol=1e-4)

def test_config_fields():
    """transformers' NomicBertConfig, and nomic's own remote-code config.json (n_embd, activation_function, ...)."""
    config = ModelConfig.from_hf_dict(transformers.NomicBertConfig(**TINY).to_dict())
    assert (config.hidden_act, config.head_dim, config.rope_theta, config.type_vocab_size) == ("silu", 16, 1000.0, 2)
    remote = {"model_type": "nomic_bert", "vocab_size": 30528, "n_embd": 768, "n_head": 12, "n_layer": 12,
              "n_inner": 3072, "n_positions": 8192, "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000,
              "rotary_emb_fraction": 1.0, "activation_function": "swiglu", "type_vocab_size": 2}
    config = ModelConfig.from_hf_dict(remote)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.hidden_act) == (
        768, 12, 3072, "silu")
    assert (config.max_position_embeddings, config.rope_theta, config.layer_norm_eps) == (8192, 1000.0, 1e-12)
    with pytest.raises(ModelConfigError, match="rotary_emb_fraction"):
        ModelConfig.from_hf_dict({**remote, "rotary_emb_fraction": 0.5})
    with pytest.raises(ModelConfigError, match="relu"):
        ModelConfig.from_hf_dict({**remote, "activation_function": "relu"})
    with pytest.raises(ModelConfigError, match="prenorm"):
        ModelConfig.from_hf_dict({**remote, "prenorm": True})
    with pytest.raises(ModelConfigError, match="mixture-of-experts"):
        ModelConfig.from_hf_dict({**remote, "moe_every_n_layers": 2, "num_experts": 8})
