"""A tiny random Idefics3ForConditionalGeneration (SmolVLM's architecture) with a tokenizer and processor built
here: 32 px frames in 8 px patches (16 patches) pixel-shuffled by 2 to 4 tokens per frame, images resized to a
64 px longest edge, so a large image splits into up to 2 x 2 tiles plus the global frame."""

from __future__ import annotations

import numpy as np
import tokenizers
import torch
from PIL import Image
from tokenizers import models

ROWS = [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<global-img>",
           "<end_of_utterance>"] + ROWS
IMAGE = SPECIAL.index("<image>")
NEWLINES = ["\n", "\n\n"]
SEQ_LEN = 4


def tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIAL + NEWLINES + [chr(c) for c in range(32, 127)])}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "\n")]))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def hf_processor(transformers, split: bool = True):
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"})
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                   do_image_splitting=split)
    return transformers.Idefics3Processor(images, tok, image_seq_len=SEQ_LEN)


def hf_model(transformers, seed: int = 0):
    cfg = transformers.Idefics3Config(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=IMAGE, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # layer norms start at 1 / 0: randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def write_model_dir(path, transformers, split: bool = True, seed: int = 0):
    """The model, its tokenizer and processor saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed)
    model.save_pretrained(path)
    hf_processor(transformers, split).save_pretrained(path)
    return model


def write_mmproj(path, model, preproc_size: int = 64) -> None:
    """The tower and connector as llama.cpp's converter writes them (convert_hf_to_gguf.py --mmproj, SmolVLMModel):
    `v.*` / `mm.model.fc` names, projector type idefics3, the processor's longest edge as preproc_image_size."""
    import gguf

    cfg = model.config
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "idefics3")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.preproc_image_size", preproc_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    writer.add_uint32("clip.vision.projector.scale_factor", cfg.scale_factor)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        kind = name.rsplit(".", 1)[1]
        if name.startswith("model.vision_model.encoder.layers."):
            index, part = name[len("model.vision_model.encoder.layers."):].split(".", 1)
            writer.add_tensor(f"v.blk.{index}.{layer[part.rsplit('.', 1)[0]]}.{kind}", data)
        elif name.startswith("model.vision_model.embeddings."):
            stem = "v.patch_embd" if "patch_embedding" in name else "v.position_embd"
            writer.add_tensor(f"{stem}.{kind}", data)
        elif name.startswith("model.vision_model.post_layernorm."):
            writer.add_tensor(f"v.post_ln.{kind}", data)
        elif name.startswith("model.connector."):
            writer.add_tensor(f"mm.model.fc.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
