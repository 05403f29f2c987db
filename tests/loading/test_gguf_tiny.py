"""Tiny GGUF files written with gguf's own writer, the way llama.cpp's converter lays them out."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_checkpoints import add_tiny_sentencepiece_vocab, head_dim, tiny_hf_model, write_gguf

from conveyor.loading import LoadError, load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.loading.gguf_config import llama3_rope_factors
from tests.oracle import private_name

Q = gguf.GGMLQuantizationType
CASES = [  # (GGUF architecture, tied embeddings, tensor type of the matrices)
    ("llama", True, Q.F32),
    ("llama", False, Q.Q8_0),
    ("qwen2", False, Q.F16),
    ("qwen3", True, Q.BF16),
]
TORCH_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.Q8_0: torch.float32}


@pytest.mark.parametrize(("arch", "tie", "qtype"), CASES)
def test_weights_and_config(tmp_path, arch: str, tie: bool, qtype: Q) -> None:
    model = tiny_hf_model(arch, tie)
    path = tmp_path / f"tiny-{arch}.{qtype.name}.gguf"
    write_gguf(path, arch, model, qtype)
    ck = load_checkpoint(str(path))

    c, hf = ck.config, model.config
    assert ck.name == f"tiny-{arch}"
    assert (c.architecture, c.tie_word_embeddings, c.vocab_size, c.head_dim) == (arch, tie, 256, head_dim(hf))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.intermediate_size, c.max_position_embeddings, c.rms_norm_eps) == (128, 512, 1e-6)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")

    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ck.weights) == set(expected)
    for name, weight in expected.items():
        got = ck.weights[name]
        if weight.dim() == 1:  # norms and biases stay F32, as llama.cpp writes them
            assert got.dtype == torch.float32 and torch.equal(got, weight), name
        elif qtype == Q.Q8_0:  # kept as GGML blocks (un-permuted by rows), dequantized only to compare
            assert isinstance(got, QuantizedTensor) and got.qtype == Q.Q8_0 and got.shape == tuple(weight.shape)
            torch.testing.assert_close(got.dequantize(), weight, atol=weight.abs().max().item() / 100, rtol=0)
        else:  # q/k come back un-permuted, bit for bit
            assert got.dtype == TORCH_DTYPES[qtype] and torch.equal(got, weight.to(got.dtype)), name


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path) -> None:
    model = tiny_hf_model("llama", True, rope_theta=500000.0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    write_gguf(tmp_path / "l3.gguf", "llama", model, rope_freqs=llama3_rope_factors(scaling, 500000.0, 16))
    assert load_checkpoint(str(tmp_path / "l3.gguf")).config.rope_scaling == scaling

    write_gguf(tmp_path / "odd.gguf", "llama", model, rope_freqs=np.linspace(1, 3, 8))
    with pytest.raises(LoadError, match="rope_freqs"):
        load_checkpoint(str(tmp_path / "odd.gguf"))


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    write_gguf(path, "llama", tiny_hf_model("llama", True), tokenizer=add_tiny_sentencepiece_vocab)
    return path


@pytest.mark.parametrize("text", ["hello world", " hello", "abc hello\nworld", "héllo wörld ☃", "<s>hello</s>",
                                  "a<tool>abc", "", "  "])
def test_sentencepiece_tokenizer_matches_transformers(sentencepiece_gguf, text: str) -> None:
    ours = load_checkpoint(str(sentencepiece_gguf)).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == 1 and ids[:1] == [1]  # llama.cpp's default for SentencePiece: add BOS
    messages = [{"role": "user", "content": text}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False)


def test_llama3_rope_factors_match_transformers() -> None:
    ROPE_INIT_FUNCTIONS = private_name("transformers.modeling_rope_utils:ROPE_INIT_FUNCTIONS")

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072,
                                      rope_parameters={**scaling, "rope_theta": 500000.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    np.testing.assert_allclose(llama3_rope_factors(scaling, 500000.0, 64), (plain / inv_freq).numpy(), rtol=1e-5)


def test_a_split_gguf_loads_from_any_part_as_the_whole_file(tmp_path):
    """llama.cpp's gguf-split layout (`NAME-0000i-of-0000n.gguf`, metadata in the first): the same weights as
    the whole file, whichever part is named; a missing or mislabelled part is a one-line LoadError."""
    import shutil

    from conveyor.testing import write_tiny_gguf

    (tmp_path / "whole").mkdir()
    whole = load_checkpoint(write_tiny_gguf(tmp_path / "whole" / "tiny-Q8_0.gguf", Q.Q8_0))
    first = write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", Q.Q8_0, split_max_tensors=8)
    assert first.endswith("tiny-Q8_0-00001-of-00003.gguf")
    for part in (first, first.replace("00001-of", "00003-of")):
        split = load_checkpoint(part)
        assert split.name == "tiny" and split.source == first and set(split.weights) == set(whole.weights)
        assert all(torch.equal(getattr(split.weights[k], "raw", split.weights[k]),
                               getattr(whole.weights[k], "raw", whole.weights[k])) for k in whole.weights)
    second = first.replace("00001-of", "00002-of")
    shutil.move(second, tmp_path / "elsewhere.gguf")
    with pytest.raises(LoadError, match="one of 3 parts of a split GGUF; missing beside it: tiny-Q8_0-00002-of-00003.gguf"):
        load_checkpoint(first)
    shutil.copy(first.replace("00001-of", "00003-of"), second)  # part 3's bytes under part 2's name
    with pytest.raises(LoadError, match="its metadata says part 2 of 3, its name part 1 of 3"):
        load_checkpoint(first)
