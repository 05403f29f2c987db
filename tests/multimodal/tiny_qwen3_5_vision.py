"""A tiny random Qwen3_5ForConditionalGeneration (hybrid text tower + Qwen3.5's ViT) with a tokenizer and processor
built here: 8 px patches merged 2 x 2 (16 px units), images smart-resized to 256..4096 pixels, so up to 16 image
tokens each; a 4 x 4 learned position table resampled to every grid."""

from __future__ import annotations

import numpy as np
import tokenizers
import torch
from PIL import Image
from tokenizers import models

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
IMAGE, START, END, VIDEO = (SPECIAL.index(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                       "<|video_pad|>"))
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 8, 2, 256, 4096
MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]


def tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def hf_image_processor(transformers):
    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                                 patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                                 image_mean=MEAN, image_std=STD)


def hf_tokenizer(transformers):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")


def processor_config() -> dict:
    return {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": PATCH,
            "merge_size": MERGE, "temporal_patch_size": 2, "image_mean": MEAN, "image_std": STD}


def hf_config(transformers, out_hidden: int = 64):
    text = dict(vocab_size=128, hidden_size=out_hidden, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention",
                "full_attention"], linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1024,
                eos_token_id=2, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=2,
                  in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
                  out_hidden_size=out_hidden, num_position_embeddings=16)
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                      video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                                      tie_word_embeddings=False)


def hf_model(transformers, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(hf_config(transformers)).eval()
    make_weights_count(model)
    return model


def make_weights_count(model) -> None:
    """The default init leaves the tower's biases and position table at zero and the text tower's attention uniform
    (initializer_range 0.02: positions change nothing): redraw them so every part of the path shows in the output."""
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if name.endswith("bias") or "pos_embed" in name:
                p.normal_(0, 0.5)
        for name, p in model.named_parameters():  # text: fan-in scaled weights
            if "visual" in name or "A_log" in name or "dt_bias" in name:
                continue
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() > 1:
                fan_in = p.shape[-1] if p.dim() == 3 else p[0].numel()  # stacked experts: (E, out, in)
                p.normal_(0.0, (3.0 if "q_proj" in name or "k_proj" in name else 1.0) / fan_in ** 0.5)


def write_model_dir(path, transformers, seed: int = 0):
    """The model, its tokenizer and image processor saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed)
    model.save_pretrained(path)
    hf_tokenizer(transformers).save_pretrained(path)
    hf_image_processor(transformers).save_pretrained(path)
    return model


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def write_mmproj(path, model) -> None:
    """The tower as llama.cpp's converter writes it (convert_hf_to_gguf.py --mmproj, conversion/qwen3vl.py's
    Qwen3VLVisionModel): `v.*` / `mm.*` names, the Conv3d kernel split into its two frames, projector type
    qwen3vl_merger, the text model's RMSNorm epsilon as the layer norm's; a Qwen3-VL tower's DeepStack mergers as
    `v.deepstack.{block}.*` with clip.vision.is_deepstack_layers flagging their blocks."""
    import gguf

    cfg = model.config
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "qwen3vl_merger")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.image_size", int(vision.num_position_embeddings ** 0.5 * vision.patch_size))
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.depth)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_heads)
    writer.add_array("clip.vision.image_mean", MEAN)
    writer.add_array("clip.vision.image_std", STD)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", cfg.text_config.rms_norm_eps)
    deepstack_blocks = list(getattr(vision, "deepstack_visual_indexes", None) or [])
    if deepstack_blocks:
        writer.add_array("clip.vision.is_deepstack_layers", [i in deepstack_blocks for i in range(vision.depth)])
    deepstack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    layer = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
             "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
    other = {"pos_embed": "v.position_embd", "merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0",
             "merger.linear_fc2": "mm.2", "patch_embed.proj": "v.patch_embd"}
    prefix = "model.visual."
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefix):
            continue
        data = tensor.detach().float().numpy()
        stem, kind = name[len(prefix):].rsplit(".", 1)
        if stem == "patch_embed.proj" and kind == "weight":
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
        elif stem.startswith("blocks."):
            _, index, part = stem.split(".", 2)
            writer.add_tensor(f"v.blk.{index}.{layer[part]}.{kind}", data)
        elif stem.startswith("deepstack_merger_list."):
            _, index, part = stem.split(".", 2)
            block = deepstack_blocks[int(index)]  # the converter names a merger by the block it reads
            writer.add_tensor(f"v.deepstack.{block}.{deepstack[part]}.{kind}", data)
        else:
            writer.add_tensor(f"{other[stem]}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_text_gguf(path, model) -> None:
    """The text tower as llama.cpp's converter writes it (qwen35, F32), with this file's vocabulary (control tokens
    for the specials) so the mmproj finds `<|image_pad|>`."""
    import transformers
    from tests.loading.tiny_checkpoints import write_hybrid_gguf

    causal = transformers.Qwen3_5ForCausalLM(model.config.text_config).eval()
    state = {k.replace("model.language_model.", "model.", 1): v for k, v in model.state_dict().items()
             if not k.startswith("model.visual.")}
    causal.load_state_dict(state, strict=False)

    write_hybrid_gguf(path, causal, add_vocab=lambda writer: write_vocab(writer, model.config.text_config.vocab_size))


def write_vocab(writer, vocab_size: int) -> None:
    """This file's vocabulary as a GGUF token list (control tokens for the specials), so an mmproj finds its markers."""
    tokens = SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_token_merges([])
    writer.add_eos_token_id(SPECIAL.index("<|im_end|>"))
    writer.add_pad_token_id(0)
