"""A tiny random Mistral3ForConditionalGeneration (a Pixtral tower, Mistral 3's projector) with a tokenizer and
processor built here: 8 px patches merged 2 x 2, so images resized to a 64 px longest edge give up to 4 x 4 image
tokens (plus a break or end token per row). The text model is Mistral, or Ministral 3 (YaRN + attention
temperature) with text="ministral3". kind="llava": Pixtral 12B's architecture (LlavaForConditionalGeneration with a
Pixtral tower: no projector norm or merger, so one token per 8 px patch)."""

from __future__ import annotations

import numpy as np
import tokenizers
import torch
from PIL import Image
from tokenizers import models

SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
IMAGE, BREAK, END = (SPECIAL.index(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
PATCH, MERGE, LONGEST_EDGE = 8, 2, 64
MEAN, STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]


def tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def _pixtral_processor_class():
    """transformers' PixtralProcessor: its module imports the torchvision image processor for one helper (not
    installed here); the PIL processor's identical helper stands in, the processor's own code runs unchanged."""
    import sys
    import types

    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    name = "transformers.models.pixtral.image_processing_pixtral"
    if name not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            stub = types.ModuleType(name)
            stub.get_resize_output_image_size = pil.get_resize_output_image_size
            sys.modules[name] = stub
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


def hf_processor(transformers, merge: int = MERGE):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>")
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                                   patch_size={"height": PATCH, "width": PATCH},
                                                   image_mean=MEAN, image_std=STD)
    return _pixtral_processor_class()(images, tok, patch_size=PATCH, spatial_merge_size=merge)


def text_config(transformers, text: str = "mistral") -> dict:
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
                  pad_token_id=0, rms_norm_eps=1e-5)
    if text == "ministral3":  # YaRN + Llama 4 temperature stepping every 8 positions, inside the prompts
        return transformers.Ministral3Config(**common, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
            "beta_slow": 1.0, "rope_theta": 1e6, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.3}).to_dict()
    return transformers.MistralConfig(**common, sliding_window=None).to_dict()


def hf_config(transformers, text: str = "mistral", bias: bool = False, tie: bool = True, kind: str = "mistral3",
              feature_layer: int = -1):
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, patch_size=PATCH, image_size=LONGEST_EDGE, hidden_act="silu")
    if kind == "llava":
        return transformers.LlavaConfig(text_config=text_config(transformers, text), vision_config=vision,
                                        image_token_index=IMAGE, vision_feature_select_strategy="full",
                                        vision_feature_layer=feature_layer, tie_word_embeddings=tie)
    return transformers.Mistral3Config(
        text_config=text_config(transformers, text), vision_config=vision, vision_feature_layer=feature_layer,
        spatial_merge_size=MERGE, image_token_index=IMAGE, multimodal_projector_bias=bias, tie_word_embeddings=tie)


def hf_model(transformers, seed: int = 0, text: str = "mistral", bias: bool = False, tie: bool = True,
             kind: str = "mistral3", feature_layer: int = -1):
    """tie: the head tied to the embeddings, as Mistral3Config defaults (greedy then mostly repeats the last token)."""
    cfg = hf_config(transformers, text, bias, tie, kind, feature_layer)
    torch.manual_seed(seed)
    classes = {"llava": transformers.LlavaForConditionalGeneration,
               "mistral3": transformers.Mistral3ForConditionalGeneration}
    model = classes[kind](cfg).eval()
    with torch.no_grad():  # norms start at 1: randomize so a skipped or misplaced one cannot pass
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                # NOTE: at initializer_range 0.02 attention is uniform (the tower's rotary changed nothing: 2e-7) and
                # greedy repeats the last token whatever the image: fan-in scale (q, k larger) makes both matter
                fan_in = p[0].numel()
                p.normal_(0.0, (3.0 if "q_proj" in name or "k_proj" in name else 1.0) / fan_in ** 0.5)
    return model


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def write_model_dir(path, transformers, seed: int = 0, text: str = "mistral", tie: bool = True,
                    kind: str = "mistral3", feature_layer: int = -1):
    """The model, its tokenizer and processor saved as a Hub directory; returns the HF model."""
    model = hf_model(transformers, seed, text, tie=tie, kind=kind, feature_layer=feature_layer)
    model.save_pretrained(path)
    hf_processor(transformers, MERGE if kind == "mistral3" else 1).save_pretrained(path)
    return model


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, rotate-half rows -> interleaved pairs."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_mmproj(path, model, img_break: bool = True) -> None:
    """The tower and projector as llama.cpp's converter writes them (convert_hf_to_gguf.py --mmproj,
    LlavaVisionModel for Mistral3ForConditionalGeneration): `v.*` / `mm.*` names, q / k rows permuted, projector
    type pixtral, the [IMG_BREAK] embedding row as v.token_embd.img_break."""
    import gguf

    cfg = model.config
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "pixtral")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    writer.add_array("clip.vision.image_mean", MEAN)
    writer.add_array("clip.vision.image_std", STD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_bool("clip.use_silu", True)
    if hasattr(cfg, "spatial_merge_size"):  # the converter writes it where the config has it (not Llava's)
        writer.add_uint32("clip.vision.spatial_merge_size", cfg.spatial_merge_size)
    layer = {"attention_norm": "ln1", "ffn_norm": "ln2", "attention.q_proj": "attn_q", "attention.k_proj": "attn_k",
             "attention.v_proj": "attn_v", "attention.o_proj": "attn_out", "feed_forward.gate_proj": "ffn_gate",
             "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down"}
    other = {"model.vision_tower.patch_conv": "v.patch_embd", "model.vision_tower.ln_pre": "v.pre_ln",
             "model.multi_modal_projector.norm": "mm.input_norm",
             "model.multi_modal_projector.patch_merger.merging_layer": "mm.patch_merger",
             "model.multi_modal_projector.linear_1": "mm.1", "model.multi_modal_projector.linear_2": "mm.2"}
    prefix = "model.vision_tower.transformer.layers."
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        stem, kind = name.rsplit(".", 1)
        if name.startswith(prefix):
            index, part = stem[len(prefix):].split(".", 1)
            if part in ("attention.q_proj", "attention.k_proj"):
                data = _permute(data, vision.num_attention_heads)
            writer.add_tensor(f"v.blk.{index}.{layer[part]}.{kind}", data)
        elif stem in other:
            writer.add_tensor(f"{other[stem]}.{kind}", data)
        elif img_break and name == "model.language_model.embed_tokens.weight":
            writer.add_tensor("v.token_embd.img_break", np.ascontiguousarray(data[BREAK]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
