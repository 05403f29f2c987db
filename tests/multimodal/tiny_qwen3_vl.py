"""A tiny random Qwen3VLForConditionalGeneration (dense Qwen3 text tower, 3 layers; Qwen3-VL's ViT, 3 blocks, with
DeepStack mergers after blocks 2 and 0: listed out of order, so level k is the k-th block in block order, not the
k-th merger). Tokenizer, image processor and image sizes as tiny_qwen3_5_vision's (8 px patches merged 2 x 2)."""

from __future__ import annotations

import numpy as np
import torch
from tiny_qwen3_5_vision import (END, IMAGE, START, VIDEO, hf_image_processor, hf_tokenizer, make_weights_count,
                                 processor_config, random_image, write_mmproj, write_vocab)

__all__ = ["END", "IMAGE", "START", "hf_config", "hf_image_processor", "hf_model", "hf_tokenizer", "processor_config",
           "random_image", "write_mmproj", "write_model_dir", "write_text_gguf"]

DEEPSTACK = [2, 0]
SECTION = [3, 3, 2]  # head_dim 16: 8 rotary pairs


def hf_config(transformers, out_hidden: int = 64, moe: bool = False):
    """`moe`: Qwen3-VL-MoE (4 experts, 2 per token, the middle layer's MLP dense)."""
    text = dict(vocab_size=128, hidden_size=out_hidden, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION,
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=2,
                  in_channels=3, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=out_hidden, num_position_embeddings=16, deepstack_visual_indexes=DEEPSTACK)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                    mlp_only_layers=[1])
    config = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    return config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                  vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)


def hf_model(transformers, seed: int = 0, moe: bool = False):
    torch.manual_seed(seed)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    model = cls(hf_config(transformers, moe=moe)).eval()
    make_weights_count(model)
    return model


def write_model_dir(path, transformers, seed: int = 0, moe: bool = False):
    """The model, its tokenizer and image processor saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed, moe)
    model.save_pretrained(path)
    hf_tokenizer(transformers).save_pretrained(path)
    hf_image_processor(transformers).save_pretrained(path)
    return model


def write_text_gguf(path, model, deepstack_levels: int = len(DEEPSTACK)) -> None:
    """The text tower as llama.cpp's converter writes it (qwen3vl / qwen3vlmoe, F32: Qwen3's / Qwen3-MoE's tensors,
    experts stacked (E, N, K) per part, the M-RoPE sections padded to 4, n_deepstack_layers: `deepstack_levels`),
    with the tiny vocabulary (control tokens for the specials)."""
    from tests.loading.tiny_checkpoints import gguf_name, gguf_writer

    cfg = model.config.text_config
    moe = bool(getattr(cfg, "num_experts", 0))
    arch = "qwen3vlmoe" if moe else "qwen3vl"
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_sections(SECTION + [0])
    writer.add_uint32(f"{arch}.n_deepstack_layers", deepstack_levels)
    if moe:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    write_vocab(writer, cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name.startswith("model.visual."):
            continue
        hf = name.replace("model.language_model.", "model.", 1)
        array = tensor.detach().float().numpy()
        layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
        if hf.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H) as transformers holds it
            gate, up = np.split(array, 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
        elif hf.endswith("mlp.experts.down_proj"):
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", array)
        elif moe and hf.endswith("mlp.gate.weight"):
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", array)
        else:
            writer.add_tensor(gguf_name(hf), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
