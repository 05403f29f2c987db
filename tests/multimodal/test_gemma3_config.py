"""google/gemma-3-4b-it's config.json as published: a sparse text_config that leans on Gemma3TextConfig's defaults."""

import torch

from conveyor.models.config import ModelConfig

GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_sparse_text_config_gets_transformers_defaults():
    cfg = ModelConfig.from_hf_dict(GEMMA3_4B_IT)
    assert cfg.architecture == "gemma3_text"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (262_208, 2560, 34)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.max_position_embeddings == 131_072 and cfg.sliding_window == 1024
    assert cfg.attention_scale == 256 ** -0.5 and cfg.tie_word_embeddings
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_theta == 1_000_000.0 and cfg.local_rope_theta == 10_000.0
    assert cfg.eos_token_ids == (1, 106)
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)


def test_vision_side_reads_the_same_config():
    from conveyor.multimodal.gemma3 import Gemma3VisionEncoder

    with torch.device("meta"):  # shapes only: 400M parameters
        encoder = Gemma3VisionEncoder(GEMMA3_4B_IT)
    assert len(encoder.layers) == 27 and encoder.patches_per_side == 64 and encoder.pool == 4
    assert encoder.projection.shape == (1152, 2560)
