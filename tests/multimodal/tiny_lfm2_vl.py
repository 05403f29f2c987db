"""A tiny random Lfm2VlForConditionalGeneration (LFM2 conv + attention text model, SigLIP2 NaFlex tower) with a
tokenizer and processor settings written here: 4 px patches unshuffled 2 x 2 (8 px units), 2..8 tokens per image
(128..512 pixels), 16 px tiles (4 tokens each), 2..4 tiles for an image over twice the budget (> 1024 pixels), a
4 x 4 learned position table resized to every frame.

transformers' LFM2-VL image processor needs torchvision (not installed), so preprocessor_config.json is written by
hand with its field names."""

from __future__ import annotations

import json

import numpy as np
import tokenizers
import torch
from PIL import Image
from tokenizers import models

ROWS = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]
SPECIAL = ["<|pad|>", "<|startoftext|>", "<|im_end|>", "<|im_start|>", "<image>", "<|image_start|>",
           "<|image_end|>", "<|img_thumbnail|>"] + ROWS
IMAGE, IMAGE_START, IMAGE_END, THUMBNAIL = (SPECIAL.index(t) for t in ("<image>", "<|image_start|>", "<|image_end|>",
                                                                      "<|img_thumbnail|>"))
PATCH, FACTOR, TILE = 4, 2, 16
PROCESSOR = dict(downsample_factor=FACTOR, do_image_splitting=True, min_tiles=2, max_tiles=4, use_thumbnail=True,
                 min_image_tokens=2, max_image_tokens=8, encoder_patch_size=PATCH, tile_size=TILE,
                 max_pixels_tolerance=2.0, do_resize=True, resample=2, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_pad=True,
                 image_processor_type="Lfm2VlImageProcessor")


def tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def hf_tokenizer(transformers):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), bos_token="<|startoftext|>",
                                                eos_token="<|im_end|>", pad_token="<|pad|>")


def hf_config(transformers, use_layernorm: bool = True):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, layer_types=["conv", "full_attention", "conv"],
                block_auto_adjust_ff_dim=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_patches=16, patch_size=PATCH, vision_use_head=False)
    return transformers.Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                     projector_hidden_size=48, downsample_factor=FACTOR,
                                     projector_use_layernorm=use_layernorm)


def hf_model(transformers, seed: int = 0, use_layernorm: bool = True):
    torch.manual_seed(seed)
    model = transformers.Lfm2VlForConditionalGeneration(hf_config(transformers, use_layernorm)).eval()
    with torch.no_grad():  # fan-in scaled weights, random norms and biases: at 0.02 init every image looks alike
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias") or "position_embedding" in name:
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:  # tied to the head: std 1 would give logits of ~50 (greedy always one token)
                p.normal_(0.0, 0.25)
            elif p.dim() > 1:
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)
    return model


def write_model_dir(path, transformers, seed: int = 0):
    """The model, its tokenizer and processor settings saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed)
    model.save_pretrained(path)
    hf_tokenizer(transformers).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return model


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def hf_inputs(items) -> dict[str, torch.Tensor]:
    """Our items' frames as transformers takes them: each frame's patches padded to max_num_patches, with the
    patch attention mask and the (rows, cols) patch grid."""
    max_patches = max(PROCESSOR["max_image_tokens"] * FACTOR ** 2, (TILE // PATCH) ** 2)
    pixels, masks, shapes = [], [], []
    for item in items:
        start = 0
        for h, w in item.extras["shapes"]:
            frame = item.pixel_values[start:start + h * w]
            start += h * w
            pixels.append(torch.cat([frame, frame.new_zeros(max_patches - h * w, frame.shape[1])]))
            masks.append(torch.arange(max_patches) < h * w)
            shapes.append([h, w])
    return dict(pixel_values=torch.stack(pixels), pixel_attention_mask=torch.stack(masks).int(),
                spatial_shapes=torch.tensor(shapes))
