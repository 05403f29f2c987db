"""Hugging Face model directories written by transformers' save_pretrained load back unchanged."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import processors
from tiny_checkpoints import head_dim, tiny_hf_model

from conveyor.loading import load_checkpoint
from conveyor.loading.hf_loader import model_name, rename_weights

CASES = [  # (architecture, tied embeddings, dtype)
    ("llama", True, torch.float32),
    ("mistral", False, torch.bfloat16),
    ("qwen2", False, torch.float32),
    ("qwen3", True, torch.float16),
]


@pytest.mark.parametrize(("arch", "tie", "dtype"), CASES)
def test_weights_and_config_round_trip(tmp_path, copy_tokenizer, arch: str, tie: bool, dtype: torch.dtype) -> None:
    model = tiny_hf_model(arch, tie).to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    copy_tokenizer(tmp_path)

    ck = load_checkpoint(str(tmp_path))
    hf = model.config
    c = ck.config
    assert c.architecture == arch and c.tie_word_embeddings == tie
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, head_dim(hf))
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.rms_norm_eps == hf.rms_norm_eps and c.vocab_size == 256
    assert ck.name == tmp_path.name and ck.source == str(tmp_path.resolve())

    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ck.weights) == set(expected)
    for name, weight in expected.items():
        assert ck.weights[name].dtype == dtype and torch.equal(ck.weights[name], weight), name


@pytest.fixture
def tiny_dir(tmp_path, copy_tokenizer):
    tiny_hf_model("llama", tie=True).save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    return tmp_path


def test_tokenizer_matches_transformers(tiny_dir) -> None:
    ours = load_checkpoint(str(tiny_dir)).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    for text in ["Hello world", "<|im_start|>user\n12 + 30<|im_end|>", "  ünï\tcode()"]:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids[0] == theirs.eos_token_id


def test_bos_comes_from_the_tokenizer_json_post_processor(tiny_dir) -> None:
    backend = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    bos = ("<|im_start|>", 1)
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[bos])
    backend.save(str(tiny_dir / "tokenizer.json"))
    ours = load_checkpoint(str(tiny_dir)).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert ours.encode("hi") == theirs.encode("hi") == [1, 6004]
    assert ours.encode("hi", add_special_tokens=False) == [6004]


def test_generation_config_eos_ids_end_generation(tiny_dir) -> None:
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ck = load_checkpoint(str(tiny_dir))
    assert ck.tokenizer.eos_token_ids == [2, 0]
    assert ck.config.eos_token_ids == (2, 0)


def test_model_name() -> None:
    assert model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    snapshot = "/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12ab34"
    assert model_name(snapshot) == "SmolLM2-135M-Instruct"


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILY_CONFIGS = {  # the other dense families: their norms, fused tensors (Phi-3) and config fields load back
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8,
                                                         sliding_window_pattern=2),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL),
    "phi3": lambda: transformers.Phi3Config(**SMALL, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "granite": lambda: transformers.GraniteConfig(**SMALL, embedding_multiplier=12.0, logits_scaling=8.0),
    # issue #25's families (Hunyuan's, Apertus' and GLM-4's norms load under the shared decoder's names)
    **{arch: (lambda cls=cls, extra=extra: cls(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra))
       for arch, cls, extra in [
           ("smollm3", transformers.SmolLM3Config, {}), ("ministral3", transformers.Ministral3Config, {}),
           ("olmo3", transformers.Olmo3Config, {}), ("glm4", transformers.Glm4Config, {"head_dim": 16}),
           ("exaone4", transformers.Exaone4Config, {"head_dim": 16}),
           ("ernie4_5", transformers.Ernie4_5Config, {"head_dim": 16, "use_bias": True}),
           ("seed_oss", transformers.SeedOssConfig, {"head_dim": 16}),
           ("hunyuan_v1_dense", transformers.HunYuanDenseV1Config, {"head_dim": 16}),
           ("apertus", transformers.ApertusConfig, {})]},
}


@pytest.mark.parametrize("arch", sorted(FAMILY_CONFIGS))
def test_family_directories_load(tmp_path, copy_tokenizer, arch: str) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS[arch]())
    model.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    ck = load_checkpoint(str(tmp_path))
    assert ck.config.architecture == arch
    tie = ck.config.tie_word_embeddings
    state = rename_weights(arch, model.state_dict())
    expected = {k: v for k, v in state.items() if not (tie and k == "lm_head.weight")}
    assert set(ck.weights) == set(expected)
    assert all(torch.equal(ck.weights[name], weight) for name, weight in expected.items())


def test_llama4_directories_load(tmp_path, copy_tokenizer) -> None:
    """Llama 4's stacked experts, inputs first (gate|up (E, H, 2I), down (E, I, H)), come back per expert in
    (out, in) order; and the Hub's multimodal layout (language_model.*, the config's text_config) loads the same."""
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**SMALL, head_dim=16, intermediate_size_mlp=80, num_local_experts=3,
                                        interleave_moe_layer_step=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = model.state_dict()
    plain, hub = tmp_path / "plain", tmp_path / "hub"
    model.save_pretrained(plain)
    hub.mkdir()
    save_file({"language_model." + k: v.contiguous() for k, v in state.items()} | {"vision_model.x": torch.zeros(1)},
              hub / "model.safetensors")
    (hub / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": cfg.to_dict(),
                                                 "vision_config": {}}))
    moe = "model.layers.1.feed_forward.experts."
    gate_up, down = state[moe + "gate_up_proj"], state[moe + "down_proj"]
    for folder in (plain, hub):
        copy_tokenizer(folder)
        ck = load_checkpoint(str(folder))
        assert ck.config.architecture == "llama4_text" and ck.config.dense_mlp_layers == (0,)
        w = ck.weights
        assert torch.equal(w["model.layers.1.mlp.experts.2.gate_proj.weight"], gate_up[2, :, :96].T)
        assert torch.equal(w["model.layers.1.mlp.experts.2.up_proj.weight"], gate_up[2, :, 96:].T)
        assert torch.equal(w["model.layers.1.mlp.experts.2.down_proj.weight"], down[2].T)
        assert torch.equal(w["model.layers.1.mlp.shared_expert.up_proj.weight"],
                           state["model.layers.1.feed_forward.shared_expert.up_proj.weight"])
        assert torch.equal(w["model.layers.0.mlp.down_proj.weight"],
                           state["model.layers.0.feed_forward.down_proj.weight"])
        assert torch.equal(w["lm_head.weight"], state["lm_head.weight"])


def test_gemma4_directories_load(tmp_path, copy_tokenizer) -> None:
    """Gemma 4 (text) from save_pretrained, and the Hub's multimodal layout (model.language_model.*, the config's
    text_config; the vision and audio towers are left out): the same tensors, none for the K/V-sharing layers' k/v."""
    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(**{**SMALL, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
                                        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                                        num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=256, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    plain, hub = tmp_path / "plain", tmp_path / "hub"
    model.save_pretrained(plain)
    hub.mkdir()
    towers = {"model.vision_tower.encoder.x": torch.zeros(1), "model.embed_vision.x": torch.zeros(1),
              "model.audio_tower.x": torch.zeros(1)}
    save_file({k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in state.items()} | towers,
              hub / "model.safetensors")
    (hub / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": cfg.to_dict(),
                                                 "vision_config": {}, "tie_word_embeddings": True}))
    for folder in (plain, hub):
        copy_tokenizer(folder)
        ck = load_checkpoint(str(folder))
        assert ck.config.architecture == "gemma4_text" and ck.config.kv_source_layers == (0, 1, 0, 1)
        assert set(ck.weights) == set(state)
        assert "model.layers.2.self_attn.k_proj.weight" not in ck.weights
        assert all(torch.equal(ck.weights[name], weight) for name, weight in state.items())


def test_gemma3n_directories_load(tmp_path, copy_tokenizer) -> None:
    """Gemma 3n (text) from save_pretrained, and the multimodal layout (model.language_model.*, text_config)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3nTextConfig(**{**SMALL, "num_hidden_layers": 4}, head_dim=16, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                                         vocab_size_per_layer_input=200, laurel_rank=8, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    plain, hub = tmp_path / "plain", tmp_path / "hub"
    model.save_pretrained(plain)
    hub.mkdir()
    towers = {"model.vision_tower.timm_model.x": torch.zeros(1), "model.embed_vision.x": torch.zeros(1),
              "model.audio_tower.x": torch.zeros(1), "model.embed_audio.x": torch.zeros(1)}
    save_file({k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in state.items()} | towers,
              hub / "model.safetensors")
    (hub / "config.json").write_text(json.dumps({"model_type": "gemma3n", "text_config": cfg.to_dict(),
                                                 "vision_config": {}, "audio_config": {}}))
    for folder in (plain, hub):
        copy_tokenizer(folder)
        ck = load_checkpoint(str(folder))
        assert ck.config.architecture == "gemma3n_text" and ck.config.altup_num_inputs == 4
        assert ck.config.kv_source_layers == (0, 1, 0, 1)
        assert set(ck.weights) == set(state)
        assert all(torch.equal(ck.weights[name], weight) for name, weight in state.items())


def test_gemma4_expert_directories_load(tmp_path, copy_tokenizer) -> None:
    """26B-A4B's shape: router.* and experts.* come back under moe.*, the stacked gate|up (E, 2I, H) and down
    (E, H, I) per expert, as views."""
    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(**SMALL, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
                                        enable_moe_block=True, num_experts=3, top_k_experts=2,
                                        moe_intermediate_size=40, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    ck = load_checkpoint(str(tmp_path))
    assert (ck.config.num_experts, ck.config.num_experts_per_tok, ck.config.moe_intermediate_size) == (3, 2, 40)
    state, w, p = model.state_dict(), ck.weights, "model.layers.1."
    gate_up, down = state[p + "experts.gate_up_proj"], state[p + "experts.down_proj"]
    assert torch.equal(w[p + "moe.experts.2.gate_proj.weight"], gate_up[2, :40])
    assert torch.equal(w[p + "moe.experts.2.up_proj.weight"], gate_up[2, 40:])
    assert torch.equal(w[p + "moe.experts.2.down_proj.weight"], down[2])
    for name in ("router.proj.weight", "router.scale", "router.per_expert_scale"):
        assert torch.equal(w[p + "moe." + name], state[p + name])
    assert torch.equal(w[p + "post_feedforward_layernorm_2.weight"], state[p + "post_feedforward_layernorm_2.weight"])
