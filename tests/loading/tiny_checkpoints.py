"""Tiny random checkpoints for the loader tests: HF models from transformers, GGUF files from gguf's writer."""

from __future__ import annotations

import math

import gguf
import numpy as np
import torch
import transformers

from conveyor.loading.gguf_loader import BLOCK_TENSORS, GLOBAL_TENSORS
from conveyor.testing import add_tiny_bpe_vocab

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
}


def tiny_hf_model(arch: str, tie: bool, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIG_CLASSES[arch](**{**TINY, "tie_word_embeddings": tie, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1.0; randomize so a swapped norm cannot pass
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_()
    return model.eval()


def head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute_for_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    for gguf_base, hf_base in GLOBAL_TENSORS.items():
        if base == hf_base:
            return f"{gguf_base}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    inverse: dict[str, str] = {}
    for gguf_base, hf_base in BLOCK_TENSORS.items():  # the first (llama's) name wins: ffn_norm, not post_attention_norm
        inverse.setdefault(hf_base, gguf_base)
    return f"blk.{layer}.{inverse[rest]}.{suffix}"


def gguf_writer(path, arch: str, cfg, rope_theta: float) -> gguf.GGUFWriter:
    """A GGUFWriter with the shape metadata every llama.cpp-converted decoder carries, from HF config `cfg`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    return writer


def write_gguf(path, arch: str, model: transformers.PreTrainedModel, dtype=gguf.GGMLQuantizationType.F32,
               tokenizer=None, rope_freqs: np.ndarray | None = None) -> None:
    """Write `model` the way llama.cpp's converter does (llama q/k permuted); `tokenizer(writer)` adds vocab."""
    cfg = model.config
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    (tokenizer or add_tiny_bpe_vocab)(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = permute_for_llama_cpp(tensor, heads)
        _add_tensor(writer, gguf_name(name), tensor.float().numpy(), dtype if tensor.dim() == 2 else None)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, dtype) -> None:
    if dtype in (None, gguf.GGMLQuantizationType.F32):
        writer.add_tensor(name, array)
    elif dtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:  # BF16 and the block quantizations go in as raw bytes
        writer.add_tensor(name, gguf.quants.quantize(array, dtype), raw_dtype=dtype)



SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "he", "ll", "llo", "hello", "\u2581hello",
              "\u2581w", "or", "wor", "world", "\u2581world", "ab", "abc", "\u2581abc", "\u2581a"]


def add_tiny_sentencepiece_vocab(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, a user-defined <tool>, then pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<tool>"] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [4] + [1] * len(SPM_PIECES)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}")


def gguf_family_name(hf_name: str, arch: str, num_layers: int) -> str:
    """HF name -> the tensor name convert_hf_to_gguf writes for `arch`: gguf-py's own name map."""
    base, _, suffix = hf_name.rpartition(".")
    name = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers).get_name(base)
    if name is None:
        raise KeyError(f"gguf-py maps no tensor for {hf_name} in {arch}")
    return f"{name}.{suffix}"


def write_family_gguf(path, arch: str, model: transformers.PreTrainedModel) -> None:
    """`model` (F32) the way convert_hf_to_gguf writes gemma2/gemma3/granite/olmo2/phi3: Gemma norms stored as
    1 + w, Granite q/k permuted (a LlamaModel subclass), Phi-3's longrope factors as tensors."""
    cfg = model.config
    rope = cfg.rope_parameters
    writer = gguf_writer(path, arch, cfg, rope.get("full_attention", rope)["rope_theta"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    elif arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    add_tiny_bpe_vocab(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch == "granite" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = permute_for_llama_cpp(tensor, heads)
        writer.add_tensor(gguf_family_name(name, arch, cfg.num_hidden_layers), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
