"""The family registry (models/family.py): each family module registers itself, and the central config and
the loaders find it there without naming it."""

import subprocess
import sys

from conveyor.models import family as families
from conveyor.models.config import ModelConfig


def test_every_registered_family_names_a_class_that_exists():
    assert len(families.architectures()) >= 35
    for architecture in families.architectures():
        cls = families.model_class(architecture)
        assert isinstance(cls, type) and hasattr(cls, "forward"), architecture
    assert families.multimodal_text_types()["qwen3_5"] == "qwen3_5_text"
    assert families.is_hybrid("lfm2") and not families.is_hybrid("llama")


def test_each_gguf_architecture_is_one_familys():
    """llama.cpp's `general.architecture` values: each listed by one family, which the GGUF loader finds by it."""
    listed = [arch for name in families.architectures() for arch in families.get(name).gguf_architectures]
    assert len(listed) == len(set(listed)) and {"llama", "gemma3", "bert", "nomic-bert", "modern-bert"} <= set(listed)
    assert families.for_gguf("hunyuan-dense").architecture == "hunyuan_v1_dense"
    assert families.for_gguf("gpt2") is None


def test_the_config_and_loaders_import_no_family_until_one_is_looked_up():
    code = ("import sys; import conveyor.models.config, conveyor.loading.checkpoint, conveyor.loading.hf_loader, "
            "conveyor.loading.gguf_config; before = set(sys.modules); "
            "from conveyor.models.families import FAMILY_MODULES; "
            "print(sorted(m for m in before if m.removeprefix('conveyor.models.') in FAMILY_MODULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_new_family_is_one_registration(monkeypatch):
    """A family registered from outside the package (as a new module would) is parsed with its own fields."""
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    families.register(families.Family("toyllama", "conveyor.models.llama:LlamaForCausalLM",
                                      hf_fields=lambda raw: {"rms_norm_eps": 1e-3}))
    raw = {"model_type": "toyllama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    config = ModelConfig.from_hf_dict(raw)
    assert config.architecture == "toyllama" and config.rms_norm_eps == 1e-3
    assert families.model_class("toyllama").__name__ == "LlamaForCausalLM"


def test_the_models_lean_on_no_loader():
    """Layering: conveyor.loading builds on conveyor.models (configs, weight types), never the other way."""
    code = ("import sys; import conveyor.models.registry, conveyor.models.families, conveyor.models.hybrid, "
            "conveyor.models.mla, conveyor.models.gemma4_model, conveyor.models.gemma3n_model; "
            "print(sorted(m for m in sys.modules if m.startswith('conveyor.loading')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
