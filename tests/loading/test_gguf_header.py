"""GGUF headers read once (loading/gguf_header.py): a load after the read parses nothing and gives what a plain
load gives; the kept header holds no view of the file and no vocabulary arrays; a rewritten file is read again."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor.loading import LoadError, load_checkpoint
from conveyor.loading import gguf_header
from conveyor.loading.gguf_header import HEADERS, read_header
from conveyor.loading.gguf_loader import read_gguf_tokenizer, split_parts
from conveyor.loading.tokenizer_cache import TOKENIZERS
from conveyor.testing import write_tiny_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture
def caches_on():
    TOKENIZERS.enabled = HEADERS.enabled = True
    yield
    TOKENIZERS.enabled = HEADERS.enabled = False
    TOKENIZERS.clear()
    HEADERS.clear()


def _raw(weight) -> torch.Tensor:
    """The bytes (a random F16 file holds NaNs, which torch.equal never calls equal)."""
    return getattr(weight, "raw", weight).contiguous().view(torch.uint8)


def _same(a, b) -> None:
    assert a.config == b.config and a.name == b.name and a.source == b.source
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        assert type(a.weights[name]) is type(b.weights[name]) and torch.equal(_raw(a.weights[name]), _raw(b.weights[name])), name
    assert a.tokenizer.encode("Hello there, tiny model!") == b.tokenizer.encode("Hello there, tiny model!")
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids and a.tokenizer.chat_template == b.tokenizer.chat_template


def _no_parse(*args, **kwargs):
    raise AssertionError("the file was parsed again")


@pytest.mark.parametrize("split_max_tensors", [0, 8])
def test_a_load_after_the_read_parses_nothing_and_equals_a_plain_load(tmp_path, split_max_tensors, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", {"attn_q": Q.Q8_0, "ffn_down": Q.Q4_K, "attn_k": Q.F16},
                           split_max_tensors=split_max_tensors)
    plain = load_checkpoint(path)
    TOKENIZERS.enabled = HEADERS.enabled = True
    try:
        tokenizer = read_gguf_tokenizer(path)  # what the multi-model server does at start
        assert len(HEADERS) == 1
        monkeypatch.setattr(gguf_header._Reader, "__init__", _no_parse)
        for _ in range(2):  # a second load (after an unload) takes the same header
            kept = load_checkpoint(path)
            _same(kept, plain)
            assert kept.tokenizer is tokenizer
    finally:
        TOKENIZERS.enabled = HEADERS.enabled = False
        TOKENIZERS.clear()
        HEADERS.clear()


def _is_file_view(array: np.ndarray) -> bool:
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = array.base
    return False


def test_the_kept_header_holds_no_view_of_the_file_nor_the_vocabulary(tmp_path, caches_on):
    path = write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", Q.Q8_0, split_max_tensors=8)
    header = read_header(split_parts(path))
    assert len(header.parts) == 3
    for part in header.parts:
        arrays = [p for field in (*part.fields.values(), *part.tensor_fields) for p in field.parts
                  if isinstance(p, np.ndarray)]
        assert arrays and not any(_is_file_view(a) for a in arrays)
    first = header.parts[0].fields
    assert "general.architecture" in first and "tokenizer.ggml.bos_token_id" in first
    assert not any(name.startswith("tokenizer.ggml.") and field.types[0] == gguf.GGUFValueType.ARRAY
                   for name, field in first.items())


def test_a_rewritten_file_is_read_again(tmp_path, caches_on):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q8_0, seed=0)
    before = load_checkpoint(path)
    write_tiny_gguf(tmp_path / "tiny.gguf", Q.F16, seed=1)
    after = load_checkpoint(path)
    HEADERS.enabled = TOKENIZERS.enabled = False
    _same(after, load_checkpoint(path))
    assert not torch.equal(_raw(after.weights["model.layers.0.mlp.up_proj.weight"]),
                           _raw(before.weights["model.layers.0.mlp.up_proj.weight"]))
    assert len(HEADERS) == 1  # the older version went


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path, caches_on):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(LoadError, match="not a readable GGUF file"):
        load_checkpoint(tmp_path / "broken.gguf")
    assert len(HEADERS) == 0


def test_off_nothing_is_kept(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q8_0)
    assert read_header(split_parts(path)) is None
    load_checkpoint(path)
    assert len(HEADERS) == 0 and len(TOKENIZERS) == 0
