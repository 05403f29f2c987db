"""Which models a multi-model server offers and under which names: --model given twice, --models-dir,
--models-preset (llama-server's INI), each model's own flags, and the refusals at startup."""

from __future__ import annotations

import pytest

from conveyor.config import ConfigError, EngineConfig, ModelsConfig, ServerConfig
from conveyor.server.multimodel.catalog import build_catalog, model_name, scan_models_dir


def _touch(path, data: bytes = b"x") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _catalog(models: ModelsConfig, **engine):
    return build_catalog(models, EngineConfig(**engine), ServerConfig(port=9000))


def test_names_are_llama_server_router_names(tmp_path):
    assert model_name(_touch(tmp_path / "Qwen3-0.6B-Q4_K_M.gguf")) == "Qwen3-0.6B-Q4_K_M"
    (tmp_path / "smol").mkdir()
    assert model_name(str(tmp_path / "smol") + "/") == "smol"
    assert model_name("ggml-org/gemma-3-4b-it-GGUF:Q4_K_M") == "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M"


def test_models_dir_offers_gguf_files_and_model_directories(tmp_path):
    _touch(tmp_path / "b-model.gguf")
    _touch(tmp_path / "mmproj-b-model-f16.gguf")  # a vision projector, not a model
    _touch(tmp_path / "big-Q4_K_M-00001-of-00002.gguf")  # a split GGUF: named by its first part
    _touch(tmp_path / "big-Q4_K_M-00002-of-00002.gguf", b"xx")
    _touch(tmp_path / "hf-dir" / "config.json", b"{}")
    _touch(tmp_path / "wrapped" / "inner-Q8_0.gguf")  # a folder with one GGUF: named as the folder
    _touch(tmp_path / "notes" / "README.md")
    found = scan_models_dir(str(tmp_path))
    assert found == [("b-model", str(tmp_path / "b-model.gguf")),
                     ("big-Q4_K_M", str(tmp_path / "big-Q4_K_M-00001-of-00002.gguf")), ("hf-dir", str(tmp_path / "hf-dir")),
                     ("wrapped", str(tmp_path / "wrapped" / "inner-Q8_0.gguf"))]


def test_a_split_ggufs_size_is_all_its_parts(tmp_path):
    from conveyor.server.multimodel.catalog import source_bytes

    first = _touch(tmp_path / "m-00001-of-00002.gguf", b"abc")
    _touch(tmp_path / "m-00002-of-00002.gguf", b"defgh")
    _touch(tmp_path / "other.gguf", b"z" * 100)
    assert source_bytes(first) == 8


def test_each_model_gets_the_server_flags_its_name_and_nothing_of_another(tmp_path):
    a, b = _touch(tmp_path / "a.gguf"), _touch(tmp_path / "b.gguf")
    specs = _catalog(ModelsConfig(models=(a, b)), parallel=2, ctx_size=1024)
    assert [s.name for s in specs] == ["a", "b"]
    assert [s.engine_config.model for s in specs] == [a, b]
    assert all(s.engine_config.parallel == 2 and s.engine_config.ctx_size == 1024 for s in specs)
    assert [s.server_config.served_model_name for s in specs] == ["a", "b"]
    assert all(s.server_config.port == 9000 for s in specs)


def test_presets_set_each_models_own_flags_over_the_shared_section(tmp_path):
    a, b = _touch(tmp_path / "a.gguf"), _touch(tmp_path / "b.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text(f"""
[*]
ctx-size = 2048

[chat]
model = {a}
parallel = 8
cache-type-k = q8_0
no-prompt-cache = true
reasoning-parser = none
pin = true

[coder]
model = {b}
ctx-size = 4096
contention = fail
load-on-startup = yes
""")
    chat, coder = _catalog(ModelsConfig(models_preset=str(preset)), parallel=4)
    assert (chat.name, chat.engine_config.model, chat.engine_config.parallel) == ("chat", a, 8)
    assert chat.engine_config.ctx_size == 2048 and chat.engine_config.cache_type_k == "q8_0"
    assert chat.engine_config.enable_prefix_caching is False
    assert chat.server_config.reasoning_parser == "none" and chat.pinned and chat.starts_loaded
    assert (coder.engine_config.ctx_size, coder.engine_config.parallel, coder.contention) == (4096, 4, "fail")
    assert not coder.pinned and coder.load_on_startup and coder.starts_loaded


@pytest.mark.parametrize(("section", "message"), [
    ("model = {a}\nport = 9", "'port' is not a flag a model may set"),
    ("model = {a}\nserved-model-name = x", "'served-model-name' is not a flag a model may set"),
    ("parallel = 2", "no `model = PATH or ORG/NAME` line"),
    ("model = {a}\nparallel = many", "parallel"),
    ("model = {a}\ncache-type-k = q4_0", "q4_0 KV is not offered"),
    ("model = {a}\ncontention = evict", "contention must be one of"),
    ("model = {a}\nparallel = 0", "parallel must be at least 1"),
    ("model = /no/such/file.gguf", "model path not found"),
])
def test_a_preset_that_does_not_hold_together_is_refused_naming_file_and_section(tmp_path, section, message):
    a = _touch(tmp_path / "a.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text("[m]\n" + section.format(a=a) + "\n")
    with pytest.raises(ConfigError, match=message) as refused:
        _catalog(ModelsConfig(models_preset=str(preset)))
    assert "[m]" in str(refused.value) or "m:" in str(refused.value)


def test_two_models_with_one_name_are_refused(tmp_path):
    a = _touch(tmp_path / "x" / "same.gguf")
    b = _touch(tmp_path / "y" / "same.gguf")
    with pytest.raises(ConfigError, match="two models are named 'same'"):
        _catalog(ModelsConfig(models=(a, b)))


def test_hf_file_with_several_models_is_refused(tmp_path):
    a, b = _touch(tmp_path / "a.gguf"), _touch(tmp_path / "b.gguf")
    with pytest.raises(ConfigError, match="--hf-file and --revision name one model's file"):
        _catalog(ModelsConfig(models=(a, b)), model="org/name", hf_file="x.gguf")


def test_an_empty_models_dir_and_a_missing_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no models to serve"):
        _catalog(ModelsConfig(models_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="not a directory"):
        _catalog(ModelsConfig(models_dir=str(tmp_path / "nope")))


def test_hub_names_are_accepted_unresolved_and_a_missing_path_is_not(tmp_path):
    specs = _catalog(ModelsConfig(models=("Qwen/Qwen3-0.6B", "ggml-org/x-GGUF:Q8_0")))
    assert [s.name for s in specs] == ["Qwen/Qwen3-0.6B", "ggml-org/x-GGUF:Q8_0"]
    with pytest.raises(ConfigError, match="model path not found: ./missing.gguf"):
        _catalog(ModelsConfig(models=("./missing.gguf", "Qwen/Qwen3-0.6B")))
