"""ModernBERT (models/modernbert.py) against transformers: every row of several sequences run in one forward matches
last_hidden_state, with sequences longer than the local window (so the window matters) and longer than one query
chunk of local attention, and each sequence's rows are bitwise those of running it alone; a cross-encoder's head
(ModernBertForSequenceClassification) gives transformers' logits."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import KernelSettings, resolve_backend
from conveyor.loading.hf_loader import load_hf_dir
from conveyor.models import encoder_attention
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.pooling import pool_rows
from conveyor.models.registry import build_model
from tests.models.encoder_compare import (VOCAB, assert_rows_match_and_stand_alone, hf_rows, random_sequences,
                                          run_rows, write_dir)

transformers = pytest.importorskip("transformers")

# 4 layers: 0 and 3 global, 1 and 2 local; a local row sees +-8 positions
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
            local_attention=16, global_attn_every_n_layers=3, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
QUERY_CHUNK = 64  # (encoder_attention.CHUNK, made small here so one sequence spans several query chunks)
LENGTHS = (37, 5, QUERY_CHUNK * 2 + 22, 17)  # past the window; under it; three query chunks; one and a bit windows


@pytest.fixture(autouse=True)
def _small_query_chunks(monkeypatch):
    monkeypatch.setattr(encoder_attention, "CHUNK", QUERY_CHUNK)


def _hf_model(kind: str = "model", **overrides):
    cfg = transformers.ModernBertConfig(**{**TINY, **overrides}, attn_implementation="eager")
    torch.manual_seed(0)
    model = {"model": transformers.ModernBertModel, "masked_lm": transformers.ModernBertForMaskedLM,
             "classifier": transformers.ModernBertForSequenceClassification}[kind](cfg).eval()
    with torch.no_grad():  # LayerNorms start at 1 and init is small: randomize so attention is far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "Wqkv" in name:
                p.mul_(8.0)
            elif name.startswith(("head.dense", "classifier")):  # logits far from 0 and far apart
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["model", "masked_lm"])
def test_rows_match_transformers_and_alone(kind, tmp_path):
    hf = _hf_model(kind)
    checkpoint = load_hf_dir(write_dir(hf, tmp_path))
    config = checkpoint.config
    assert config.bidirectional and config.architecture == "modernbert"
    assert config.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    seqs = random_sequences(LENGTHS)
    encoder = hf.base_model
    want = hf_rows(encoder, seqs)
    # the window matters here: the same weights attending globally in every layer give other rows
    unwindowed = _hf_model(local_attention=1024)
    unwindowed.load_state_dict(encoder.state_dict())
    assert (hf_rows(unwindowed, seqs) - want).abs().max() > 0.1
    # bf16 against transformers in bf16 (its attention matmuls round to bf16; ours run in fp32)
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 4e-2)):
        if dtype != torch.float32:
            want = hf_rows(encoder.to(dtype), seqs)
        model = build_model(config, checkpoint.weights, dtype, torch.device("cpu"),
                            ops=resolve_backend(torch.device("cpu"), dtype))
        assert len(model.cache_specs()) == 2  # the global layers' K/V only
        assert not model.has_classifier  # the masked LM's `head.` without `classifier.` scores nothing
        assert_rows_match_and_stand_alone(model, seqs, want, dtype, atol)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cross_encoder_logits_match_transformers(pooling, tmp_path):
    """ModernBertForSequenceClassification (gte-reranker-modernbert): its head on the first row or on the mean of
    every row, as classifier_pooling says, gives transformers' logits; the other pooling would not."""
    hf = _hf_model("classifier", classifier_pooling=pooling, num_labels=1, classifier_bias=pooling == "mean")
    checkpoint = load_hf_dir(write_dir(hf, tmp_path))
    assert checkpoint.config.classifier_pooling == pooling
    model = build_model(checkpoint.config, checkpoint.weights, torch.float32, torch.device("cpu"),
                        ops=resolve_backend(torch.device("cpu"), torch.float32))
    assert model.has_classifier and (model.classifier.dense_bias is not None) == (pooling == "mean")
    seqs = random_sequences(LENGTHS)
    rows = run_rows(model, seqs, 0, torch.float32).split([len(s) for s in seqs])
    with torch.no_grad():
        want = torch.cat([hf(input_ids=torch.tensor([s])).logits for s in seqs])  # (len(seqs), 1)
    ours = model.classify(torch.stack([pool_rows(r, pooling) for r in rows]))
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    other = model.classify(torch.stack([pool_rows(r, "mean" if pooling == "cls" else "cls") for r in rows]))
    assert (other - want).abs().max() > 0.1
    with pytest.raises(ModelConfigError, match="classifier_activation"):
        ModelConfig.from_hf_dict({**hf.config.to_dict(), "classifier_activation": "silu"})


def test_rows_select_the_pooled_rows():
    """hidden_states at a few rows (each sequence's first) is bitwise those rows of every-row output."""
    hf = _hf_model()
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = build_model(config, hf.state_dict(), torch.float32, torch.device("cpu"))
    seqs = random_sequences(LENGTHS)
    firsts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    every = run_rows(model, seqs, 0, torch.float32)
    assert torch.equal(run_rows(model, seqs, 0, torch.float32, firsts), every[firsts])
    with pytest.raises(NotImplementedError, match="encoder"):
        model(torch.tensor([3]), torch.tensor([0]), [], None, torch.tensor([0]))



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
    """transformers 5's layer_types and rope_parameters, and the Hub's older global_* / local_* keys."""
    new = ModelConfig.from_hf_dict(transformers.ModernBertConfig(**{**TINY, "num_hidden_layers": 7}).to_dict())
    assert new.layer_types == tuple("full_attention" if i % 3 == 0 else "sliding_attention" for i in range(7))
    assert (new.sliding_window, new.rope_theta, new.local_rope_theta) == (8, 160_000.0, 10_000.0)
    assert new.window(0) == 0 and new.window(1) == 8 and new.layer_norm_eps == 1e-5
    assert (new.head_dim, new.num_key_value_heads, new.attention_bias, new.mlp_bias) == (16, 4, False, False)
    old = {"model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152,
           "num_hidden_layers": 22, "num_attention_heads": 12, "global_attn_every_n_layers": 3,
           "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128, "norm_eps": 1e-5,
           "norm_bias": False, "hidden_activation": "gelu", "max_position_embeddings": 8192}
    config = ModelConfig.from_hf_dict(old)
    assert (config.sliding_window, config.rope_theta, config.local_rope_theta) == (64, 160_000.0, 10_000.0)
    assert sum(kind == "full_attention" for kind in config.layer_types) == 8 and config.max_position_embeddings == 8192
    with pytest.raises(ModelConfigError, match="norm_bias"):
        ModelConfig.from_hf_dict({**old, "norm_bias": True})
    with pytest.raises(ModelConfigError, match="gelu_new"):
        ModelConfig.from_hf_dict({**old, "hidden_activation": "gelu_new"})
    with pytest.raises(ModelConfigError, match="linear"):
        ModelConfig.from_hf_dict({**old, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert config.classifier_pooling == "cls"  # transformers' default
    with pytest.raises(ModelConfigError, match="classifier_pooling"):
        ModelConfig.from_hf_dict({**old, "classifier_pooling": "max"})
