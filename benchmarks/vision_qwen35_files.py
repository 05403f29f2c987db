"""Qwen3.5-2B-shaped vision files for benchmarks/vision.py (issue #42's second shape), random weights.

  qwen3.5-2b-vl-Q4_K_M.gguf    the text tower as benchmarks/hybrid_gguf.py's `qwen3.5-2b` (hidden 2048, 24 layers:
                               6 x (3 Gated DeltaNet + 1 gated attention), FFN 6144, M-RoPE sections [11, 11, 10]),
                               SmolLM2's tokenizer with Qwen's three vision tokens appended (<|vision_start|>,
                               <|vision_end|>, <|image_pad|>) and a ChatML template that writes them for an image part,
                               written F16 by tests/loading/tiny_checkpoints.write_hybrid_gguf (the converter's
                               layout) and quantized by llama-quantize
  mmproj-qwen3.5-2b-vl-f16.gguf  the vision tower + merger, written by llama.cpp's own convert_hf_to_gguf.py --mmproj
                               (projector type qwen3vl_merger) from a transformers Qwen3_5VisionModel saved as a
                               Qwen3_5ForConditionalGeneration directory

The small Qwen3.5 models' vision shape is an assumption (as for Qwen3-VL-2B/4B: 24 layers, width 1024, FFN 4096, 16
heads, patch 16, merge 2, 2304 position embeddings); transformers' Qwen3_5VisionConfig defaults are the larger
models' SigLIP-so400m tower.

    python benchmarks/vision_qwen35_files.py --models-dir /tmp/vision-bench-qwen35 \
        --llama-cpp /path/to/llama.cpp (its convert_hf_to_gguf.py, and build-*/bin/llama-quantize)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import gguf
import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "loading"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tiny_checkpoints import write_hybrid_gguf  # noqa: E402

from hybrid_gguf import CONFIGS  # noqa: E402
from quantized import copy_tokenizer, smollm2_path  # noqa: E402

SHAPE = "qwen3.5-2b"
TEXT_FILE, MMPROJ_FILE = "qwen3.5-2b-vl-Q4_K_M.gguf", "mmproj-qwen3.5-2b-vl-f16.gguf"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=2304)
# ChatML (SmolLM2's) with Qwen's image writing: an image part -> <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def _with_vision_tokens(writer: gguf.GGUFWriter, donor: gguf.GGUFReader) -> None:
    """SmolLM2's tokenizer keys, the vision tokens appended as control tokens, our template."""
    copy_tokenizer(writer, donor)
    fields = writer.kv_data[0]
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    tokens.value = list(tokens.value) + list(VISION_TOKENS)
    types.value = list(types.value) + [gguf.TokenType.CONTROL] * len(VISION_TOKENS)
    fields["tokenizer.chat_template"].value = CHAT_TEMPLATE


def write_text(path: Path, quantize: str) -> None:
    donor = gguf.GGUFReader(smollm2_path())
    base = len(donor.fields["tokenizer.ggml.tokens"].data)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[SHAPE](base + len(VISION_TOKENS))).eval()
    f16 = path.with_name(path.stem.replace("Q4_K_M", "F16") + ".gguf")
    if not f16.exists():
        tmp = f16.with_suffix(".tmp")
        write_hybrid_gguf(tmp, model, gguf.GGMLQuantizationType.F16,
                          add_vocab=lambda writer: _with_vision_tokens(writer, donor))
        tmp.rename(f16)
    del model
    subprocess.run([quantize, str(f16), str(path), "Q4_K_M"], check=True, capture_output=True)


def write_mmproj(path: Path, llama_cpp: Path, text_hidden: int, vocab: int) -> None:
    """A random Qwen3.5 vision tower saved as an HF directory, converted by llama.cpp's converter."""
    hf = path.parent / "qwen3.5-2b-vl-hf"
    hf.mkdir(exist_ok=True)
    config = transformers.Qwen3_5VisionConfig(**VISION, out_hidden_size=text_hidden)
    torch.manual_seed(1)
    tower = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(config).eval()
    save_file({f"model.visual.{k}": v.contiguous() for k, v in tower.state_dict().items()}, hf / "model.safetensors")
    start = vocab
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "vision_start_token_id": start, "vision_end_token_id": start + 1, "image_token_id": start + 2,
        "text_config": {"model_type": "qwen3_5_text", "hidden_size": text_hidden, "rms_norm_eps": 1e-6},
        "vision_config": {**config.to_dict(), "model_type": "qwen3_5"}}))
    (hf / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": VISION["patch_size"],
        "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--mmproj", "--outtype", "f16",
                    "--outfile", str(path)], check=True)


def ensure_files(folder: Path, llama_cpp: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    text, mmproj = folder / TEXT_FILE, folder / MMPROJ_FILE
    quantize = next(iter(sorted(llama_cpp.glob("build*/bin/llama-quantize"))), None)
    if not text.exists():
        if quantize is None:
            raise SystemExit(f"no llama-quantize under {llama_cpp}/build*/bin (cmake --build BUILD --target llama-quantize)")
        write_text(text, str(quantize))
    if not mmproj.exists():
        vocab = len(gguf.GGUFReader(smollm2_path()).fields["tokenizer.ggml.tokens"].data)
        write_mmproj(mmproj, llama_cpp, text_hidden=2048, vocab=vocab)
    return text, mmproj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/vision-bench-qwen35"))
    p.add_argument("--llama-cpp", type=Path, required=True)
    args = p.parse_args()
    for path in ensure_files(args.models_dir, args.llama_cpp):
        print(path)


if __name__ == "__main__":
    main()
