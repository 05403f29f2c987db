"""A tiny random Gemma3ForConditionalGeneration directory (save_pretrained) with a tokenizer and processor built
here: 32 px images in 8 px patches (16 patches) pooled to 4 tokens, a 2-layer text tower whose first layer slides
over 8 positions, so an image placed late in a prompt meets the window."""

from __future__ import annotations

import numpy as np
import tokenizers
import torch
from PIL import Image
from tokenizers import models

SPECIAL = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>"]
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
BOI, EOI, SOFT = 5, 6, 7
NUM_EMBEDS = 4
# Gemma 3's instruction format with image parts, as Google's template writes them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def tiny_tokenizer() -> tokenizers.Tokenizer:
    """Character BPE whose only merges join newlines ("\\n\\n\\n" is one token, as in Gemma's vocabulary)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + NEWLINES + [chr(c) for c in range(32, 127)])}
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def hf_processor(transformers):
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    tok.chat_template = CHAT_TEMPLATE
    images = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(images, tok, image_seq_length=NUM_EMBEDS, chat_template=CHAT_TEMPLATE)


def hf_model(transformers, seed: int = 0):
    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=NUM_EMBEDS, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT,
        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms start at 0 (the 1 + w form): randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0, 0.3)  # zeros at init: the image would not show in the logits
            elif name.endswith(("q_proj.weight", "k_proj.weight")) and "language_model" in name:
                p.mul_(4)
    return model


def write_model_dir(path, transformers, seed: int = 0):
    """The model, its tokenizer and processor saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed)
    model.save_pretrained(path)
    hf_processor(transformers).save_pretrained(path)
    return model


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def write_mmproj(path, model, projection_f16: bool = False, projector_type: str = "gemma3") -> None:
    """The model's tower and projector as llama.cpp's converter writes them (convert_hf_to_gguf.py --mmproj,
    Gemma3VisionModel): `v.*` / `mm.*` names, soft_emb_norm stored as 1 + w, the projection optionally F16."""
    import gguf

    cfg = model.config
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", projector_type)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    per_side = int(cfg.mm_tokens_per_image ** 0.5)
    writer.add_uint32("clip.vision.projector.scale_factor", vision.image_size // vision.patch_size // per_side)
    layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.startswith("model.vision_tower.encoder.layers."):
            index, part = name[len("model.vision_tower.encoder.layers."):].split(".", 1)
            stem, kind = part.rsplit(".", 1)
            writer.add_tensor(f"v.blk.{index}.{layer[stem]}.{kind}", data)
        elif name.startswith("model.vision_tower.embeddings."):
            stem = "v.patch_embd" if "patch_embedding" in name else "v.position_embd"
            writer.add_tensor(f"{stem}.{name.rsplit('.', 1)[1]}", data)
        elif name.startswith("model.vision_tower.post_layernorm."):
            writer.add_tensor(f"v.post_ln.{name.rsplit('.', 1)[1]}", data)
        elif name.endswith("mm_soft_emb_norm.weight"):
            writer.add_tensor("mm.soft_emb_norm.weight", data + 1.0)
        elif name.endswith("mm_input_projection_weight"):
            writer.add_tensor("mm.input_projection.weight", data.astype("float16") if projection_f16 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_mmproj(path, text_hidden: int, seed: int = 0, width: int = 32, layers: int = 2, heads: int = 2,
                        image_size: int = 32, patch: int = 8, tokens: int = 4) -> None:
    """A random Gemma 3 mmproj GGUF for a text model of width `text_hidden` (F16 projection, as llama.cpp writes)."""
    import gguf

    rng = np.random.default_rng(seed)
    rand = lambda *shape, scale=0.2: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (("image_size", image_size), ("patch_size", patch), ("embedding_length", width),
                       ("feed_forward_length", 2 * width), ("block_count", layers), ("projection_dim", text_hidden),
                       ("attention.head_count", heads)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_uint32("clip.vision.projector.scale_factor", image_size // patch // int(tokens ** 0.5))
    writer.add_tensor("v.patch_embd.weight", rand(width, 3, patch, patch))
    writer.add_tensor("v.patch_embd.bias", rand(width))
    writer.add_tensor("v.position_embd.weight", rand((image_size // patch) ** 2, width))
    for i in range(layers):
        for name, shape in (("ln1", (width,)), ("ln2", (width,)), ("attn_q", (width, width)),
                            ("attn_k", (width, width)), ("attn_v", (width, width)), ("attn_out", (width, width)),
                            ("ffn_up", (2 * width, width)), ("ffn_down", (width, 2 * width))):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", rand(*shape) + (1.0 if name.startswith("ln") else 0.0))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", rand(shape[0]))
    writer.add_tensor("v.post_ln.weight", rand(width) + 1.0)
    writer.add_tensor("v.post_ln.bias", rand(width))
    writer.add_tensor("mm.soft_emb_norm.weight", rand(width) + 1.0)
    writer.add_tensor("mm.input_projection.weight", rand(width, text_hidden, scale=1.0).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
