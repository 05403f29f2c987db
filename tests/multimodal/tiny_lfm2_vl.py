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


# What an mmproj implies (clip.cpp's 64..256 tokens, the HF processor's other defaults) with this tower's patch
MMPROJ_PROCESSOR = dict(encoder_patch_size=PATCH, downsample_factor=FACTOR, image_mean=[0.5, 0.5, 0.5],
                        image_std=[0.5, 0.5, 0.5], image_processor_type="Lfm2VlImageProcessor")


def write_model_dir(path, transformers, seed: int = 0, processor: dict | None = None):
    """The model, its tokenizer and processor settings saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed)
    model.save_pretrained(path)
    hf_tokenizer(transformers).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(processor or PROCESSOR))
    return model


def write_mmproj(path, model) -> None:
    """The tower and projector as llama.cpp's converter writes them (convert_hf_to_gguf.py --mmproj,
    conversion/lfm2.py's LFM2VLModel): `v.*` / `mm.*` names, the linear patch embedding as a (out, 3, p, p) conv
    kernel, projector type lfm2, image_size 256 (the converter's dummy)."""
    import gguf

    cfg = model.config
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "lfm2")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.image_size", 256)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    writer.add_uint32("clip.vision.projector.scale_factor", cfg.downsample_factor)
    writer.add_bool("clip.use_gelu", True)
    layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    other = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
             "post_layernorm": "v.post_ln"}
    projector = {"layer_norm": "mm.input_norm", "linear_1": "mm.1", "linear_2": "mm.2"}
    # transformers 5 saves the tower as model.vision_tower.*; Hub checkpoints as model.vision_tower.vision_model.*
    tower, mm = "model.vision_tower.", "model.multi_modal_projector."
    p = vision.patch_size
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float()
        if name.startswith(tower):
            stem, kind = name[len(tower):].removeprefix("vision_model.").rsplit(".", 1)
            if stem == "embeddings.patch_embedding" and kind == "weight":  # the converter's view + permute
                data = data.view(data.shape[0], p, p, 3).permute(0, 3, 1, 2)
            if stem.startswith("encoder.layers."):
                index, part = stem[len("encoder.layers."):].split(".", 1)
                out = f"v.blk.{index}.{layer[part]}.{kind}"
            else:
                out = f"{other[stem]}.{kind}"
        elif name.startswith(mm):
            stem, kind = name[len(mm):].rsplit(".", 1)
            out = f"{projector[stem]}.{kind}"
        else:
            continue
        writer.add_tensor(out, data.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_text_gguf(path, model) -> None:
    """The text model as llama.cpp's converter writes it (lfm2, F32), with this file's vocabulary (control tokens
    for the specials) so the mmproj finds `<image>`."""
    import transformers
    from tests.loading.tiny_checkpoints import write_hybrid_gguf

    causal = transformers.Lfm2ForCausalLM(model.config.text_config).eval()
    state = {k.replace("model.language_model.", "model.", 1): v for k, v in model.state_dict().items()
             if k.startswith("model.language_model.")}
    causal.load_state_dict(state, strict=False)
    causal.tie_weights()

    def vocab(writer) -> None:
        tokens = SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"]
        tokens += [f"<unused{i}>" for i in range(model.config.text_config.vocab_size - len(tokens))]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
        writer.add_token_merges([])
        writer.add_bos_token_id(SPECIAL.index("<|startoftext|>"))
        writer.add_eos_token_id(SPECIAL.index("<|im_end|>"))
        writer.add_pad_token_id(0)

    write_hybrid_gguf(path, causal, add_vocab=vocab)


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


def transformers_layout_code():
    """transformers' own layout code for LFM2-VL: (Lfm2VlImageProcessor, Lfm2VlProcessor) instances made without
    __init__, for their torchvision-free methods (_get_split_layout, _build_image_tokens, token counts). The image
    processor's module imports torchvision at the top: it is imported here with stub modules in sys.modules (and
    transformers' own image modules imported first, so their torchvision checks stay False), then they are removed."""
    import importlib
    import importlib.machinery
    import sys
    import types

    import transformers.image_processing_backends  # noqa: F401  (decide is_torchvision_available before the stub)
    import transformers.image_transforms  # noqa: F401
    import transformers.processing_utils  # noqa: F401

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
    stubs = [types.ModuleType(name) for name in names]
    for parent, child in zip(stubs, stubs[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for stub in stubs:
            stub.__spec__ = importlib.machinery.ModuleSpec(stub.__name__, None)
            sys.modules[stub.__name__] = stub
        module = importlib.import_module("transformers.models.lfm2_vl.image_processing_lfm2_vl")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    images = object.__new__(module.Lfm2VlImageProcessor)
    text = object.__new__(Lfm2VlProcessor)
    text.image_token, text.image_start_token, text.image_end_token = "<image>", "<|image_start|>", "<|image_end|>"
    text.image_thumbnail_token = "<|img_thumbnail|>"
    return images, text
