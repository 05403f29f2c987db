"""Shared, session-scoped loads of the default SmolLM2 GGUF: ours and transformers' (the oracle)."""

from __future__ import annotations

import os
import shutil

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


@pytest.fixture(scope="session")
def tokenizer_files(hf_gguf_tokenizer, tmp_path_factory) -> list[str]:
    """The SmolLM2 tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_gguf_tokenizer.save_pretrained(folder)
    return sorted(str(p) for p in folder.iterdir())


@pytest.fixture
def copy_tokenizer(tokenizer_files: list[str]):
    def copy(folder) -> None:
        for file in tokenizer_files:
            shutil.copy(file, folder)
    return copy
