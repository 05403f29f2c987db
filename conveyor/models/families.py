"""Every model family module, imported once by models/family.py so each registers itself. A new family is a
module that ends with `register(Family(...))` and a name here.

The plain families run the shared decoder unchanged (models/llama.py) and need no module of their own."""

import importlib

from conveyor.models.family import Family, register, register_multimodal_text

FAMILY_MODULES = ("gemma", "phi3", "granite", "olmo2", "smollm3", "ministral3", "glm4", "exaone4", "ernie4_5",
                  "seed_oss", "hunyuan_dense", "apertus", "gemma4", "gemma3n", "mixtral", "qwen3_moe", "olmoe",
                  "llama4", "deepseek_v3", "gpt_oss", "lfm2", "qwen3_5", "qwen3_vl", "qwen3_next", "granite_hybrid",
                  "nemotron_h", "falcon_h1", "mamba2", "bert", "modernbert", "nomic_bert")
# llama.cpp's hybrid architectures whose GGUF files no family loads yet, and what they are (a clearer refusal).
GGUF_NOT_YET = {
    "granitehybrid": "Granite 4.0 hybrid: Mamba2 and attention",
    "nemotron_h": "Nemotron-H: Mamba2, attention and MLP layers",
    "nemotron_h_moe": "Nemotron-H MoE: Mamba2, attention and MoE layers",
    "falcon-h1": "Falcon-H1: Mamba2 and attention in parallel",
    "mamba2": "Mamba2",
    "mamba": "Mamba",
    "jamba": "Jamba: Mamba and attention with MoE",
}


def _llama_gguf_fields(meta, base, tensors) -> dict:
    # convert_hf_to_gguf writes Mixtral as llama with experts (its q/k permuted as Llama's)
    return dict(architecture="mixtral") if base.get("num_experts") else {}


register(Family("llama", "conveyor.models.llama:LlamaForCausalLM", gguf_architectures=("llama",),
                gguf_fields=_llama_gguf_fields, gguf_permuted_qk=True),
         Family("mistral", "conveyor.models.llama:LlamaForCausalLM"),  # a GGUF of it is llama's
         *(Family(architecture, "conveyor.models.llama:LlamaForCausalLM", gguf_architectures=(architecture,))
           for architecture in ("qwen2", "qwen3")))
# Idefics3 / SmolVLM: a Llama (SmolLM2) text model under text_config (the tower: multimodal/idefics3.py)
for _multimodal in ("idefics3", "smolvlm"):
    register_multimodal_text(_multimodal, "llama")
for _name in FAMILY_MODULES:
    importlib.import_module(f"conveyor.models.{_name}")
