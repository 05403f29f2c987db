"""Load a llama.cpp GGUF file: dequantized weights under Hugging Face names, config and tokenizer."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import gguf
import numpy as np
import torch

from conveyor.loading.checkpoint import Checkpoint, LoadError, select_weights
from conveyor.loading.gguf_config import config_from_gguf
from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
from conveyor.models.config import ModelConfig

# llama.cpp tensor name (without the `blk.N.` prefix) -> Hugging Face module name.
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Tensors that only feed the config (rope_freqs -> rope_scaling).
CONFIG_TENSORS = {"rope_freqs.weight"}
# Quantization suffixes in file names, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf" or "model-q4_k_m.gguf".
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class _Reader(gguf.GGUFReader):
    # NOTE: slicing np.memmap costs microseconds per slice and GGUFReader slices once per vocab string;
    # a plain ndarray view of the same mapping opens SmolLM2 in 1 s instead of 4 s.
    def _get(self, *args, **kwargs):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(*args, **kwargs)


def load_gguf(path: str) -> Checkpoint:
    try:
        reader = _Reader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise LoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    config = config_from_gguf(reader, path)
    weights = {}
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, path)
        weights[name] = _unpermute(config, name, _to_torch(tensor, path))
    tokenizer = tokenizer_from_gguf(reader, path)
    if tokenizer.eos_token_ids:
        # The tokenizer knows the end-of-turn tokens the template uses; metadata names only one.
        config = replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    return Checkpoint(config=config, weights=select_weights(config, weights, path), tokenizer=tokenizer,
                      source=path, name=model_name(path))


def hf_name(gguf_name: str, source: str = "") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{BLOCK_TENSORS[match.group(2)]}.{suffix}"
    raise LoadError(f"{source}: unexpected tensor {gguf_name!r} in GGUF file")


def model_name(path: str) -> str:
    stem = os.path.basename(path).removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def _to_torch(tensor: gguf.gguf_reader.ReaderTensor, source: str) -> torch.Tensor:
    """Float tensors keep their dtype; quantized ones become float32. Shape is HF order (reverse of GGUF's)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(tensor.data)).reshape(shape)
    if kind == gguf.GGMLQuantizationType.BF16:
        raw = np.array(tensor.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    try:
        values = gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError as exc:
        raise LoadError(f"{source}: cannot dequantize {tensor.name} ({kind.name})") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _unpermute(config: ModelConfig, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Undo convert_hf_to_gguf's rotary row interleave, which it applies to llama q/k projections only.

    Per head, HF keeps rows [x0..x(d/2-1) | y0..y(d/2-1)] (rotate-half); llama.cpp stores x0 y0 x1 y1 ...
    """
    if config.architecture != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    rows = weight.shape[0]
    # (heads, d/2, 2, in) -> (heads, 2, d/2, in)
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape).contiguous()

