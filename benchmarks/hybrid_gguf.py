"""Real-shaped hybrid GGUFs with random weights, for benchmarks/quantized.py (conveyor vs llama-server on the
same file): Qwen3.5-2B- and LFM2-1.2B-shaped (`qwen35`, `lfm2`; also 0.8B / 350M), built
by transformers with random weights (norms at 1, decay parameters at their init), written as llama.cpp's
converter writes them (tests/loading/tiny_checkpoints.write_hybrid_gguf, checked byte-identical to the converter
on tiny models) in F16 with SmolLM2's tokenizer, then quantized by llama-quantize.

Usage:
  PYTHONPATH=$PWD python benchmarks/hybrid_gguf.py [--shapes qwen3.5-2b,lfm2-1.2b] [--quants Q4_K_M]
        [--models-dir /work/bench-models] [--llama-quantize /work/llama-native/bin/llama-quantize]
Prints the paths, one per line (pass them to quantized.py --files).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
from pathlib import Path

import gguf
import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "loading"))
from tiny_checkpoints import write_hybrid_gguf  # noqa: E402

from quantized import copy_tokenizer, smollm2_path  # noqa: E402

LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)
# Qwen3.5's small models: 6 x (3 DeltaNet + 1 gated attention) layers, 8 heads / 2 KV of 256; the 0.8B card gives
# hidden 1024 and FFN 3584. The 2B shape (hidden 2048, FFN 6144) and both DeltaNet head counts (16 key and 16
# value heads of 128) are assumptions. Their context is 32k here (the releases: 262k), so a 4k-token prompt fits.
CONFIGS = {
    "lfm2-1.2b": lambda vocab: transformers.Lfm2Config(
        vocab_size=vocab, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12288, max_position_embeddings=4096,
        layer_types=["full_attention" if i in LFM2_ATTENTION else "conv" for i in range(16)]),
    "qwen3.5-2b": lambda vocab: transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True),
    "lfm2-350m": lambda vocab: transformers.Lfm2Config(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=6656, max_position_embeddings=4096,
        layer_types=["full_attention" if i in LFM2_ATTENTION else "conv" for i in range(16)]),
    "qwen3.5-0.8b": lambda vocab: transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True),
}


def write(shape: str, path: Path) -> None:
    donor = gguf.GGUFReader(smollm2_path())
    vocab = len(donor.fields["tokenizer.ggml.tokens"].data)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[shape](vocab)).eval()
    tmp = path.with_suffix(".tmp")
    write_hybrid_gguf(tmp, model, gguf.GGMLQuantizationType.F16, add_vocab=functools.partial(copy_tokenizer,
                                                                                              donor=donor))
    tmp.rename(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3.5-2b,lfm2-1.2b")
    p.add_argument("--quants", default="Q4_K_M")
    p.add_argument("--models-dir", type=Path, default=Path("/work/bench-models"))
    p.add_argument("--llama-quantize", default="/work/llama-native/bin/llama-quantize")
    args = p.parse_args()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        f16 = args.models_dir / f"{shape}-F16.gguf"
        if not f16.exists():
            write(shape, f16)
        for quant in args.quants.split(","):
            out = args.models_dir / f"{shape}-{quant}.gguf"
            if not out.exists():
                subprocess.run([args.llama_quantize, str(f16), str(out), quant], check=True, capture_output=True)
            print(out)


if __name__ == "__main__":
    main()
