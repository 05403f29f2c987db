"""Shared, session-scoped loads of the default SmolLM2 GGUF: ours and transformers' (the oracle)."""

from __future__ import annotations

import os

import pytest

from conveyor.loading import Checkpoint, default_model_path, load_checkpoint


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(gguf_path: str) -> Checkpoint:
    return load_checkpoint(gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
