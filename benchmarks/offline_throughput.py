"""Offline decode throughput of the engine on SmolLM2 at several batch sizes.

Usage: python benchmarks/offline_throughput.py [--batches 1,4,8,16,32] [--max-tokens 128] [--out results.md]
Each level runs B short prompts with ignore_eos for max_tokens tokens through LLM.generate
and reports decode tokens/s (generated tokens over the decode phase) and time per step.
Speculative decoding is off unless --speculative-ngram is given, so ms/step is one token per row.
"""

from __future__ import annotations

import argparse
import platform
import time

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, {platform.system()}"


def emit_table(caption: str, header: list[str], rows: list[list[str]], out: str | None) -> None:
    """Print a captioned markdown table and, when asked, append it to a results file."""
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table + "\n\n")


def run_level(llm: LLM, batch: int, max_tokens: int) -> dict:
    prompts = [f"Write a short note about topic number {i}." for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    steps_before = engine.counters.num_steps
    start = time.perf_counter()
    first_token_at = None
    ids = []
    for p in prompts:
        request = engine.make_request(llm.tokenizer.encode(p), params)
        engine.add_request(request)
        ids.append(request)
    generated = 0
    while engine.has_work():
        outs = engine.step()
        generated += sum(len(o.new_token_ids) for o in outs)
        if first_token_at is None and all(r.output_token_ids for r in ids):
            first_token_at = time.perf_counter()
            generated_at_first = generated
    end = time.perf_counter()
    steps = engine.counters.num_steps - steps_before
    decode_tokens = generated - generated_at_first
    decode_time = end - first_token_at
    return dict(batch=batch, tokens=generated, wall_s=end - start, decode_tok_s=decode_tokens / decode_time,
                total_tok_s=generated / (end - start), ms_per_step=1000 * decode_time / max(steps - 1, 1),
                prefill_s=first_token_at - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--no-batch-invariant", action="store_true")
    parser.add_argument("--speculative-ngram", type=int, default=0,
                        help="prompt-lookup drafts per step (off by default here: this script measures raw steps)")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model, parallel=max(batches), dtype=args.dtype, weight_dtype=args.weight_dtype,
              batch_invariant=not args.no_batch_invariant, speculative_ngram=args.speculative_ngram)
    run_level(llm, 2, 8)  # warm-up: kernels, allocator
    rows = [run_level(llm, b, args.max_tokens) for b in batches]
    caption = (f"Machine: {machine()}; dtype {args.dtype}; weights {args.weight_dtype}; "
               f"batch_invariant {not args.no_batch_invariant}; speculative_ngram {args.speculative_ngram}; "
               f"{args.max_tokens} new tokens, short prompts, ignore_eos")
    emit_table(caption, ["batch", "decode tok/s", "ms/step", "prefill s", "total tok/s"],
               [[str(r["batch"]), f"{r['decode_tok_s']:.1f}", f"{r['ms_per_step']:.1f}", f"{r['prefill_s']:.2f}",
                 f"{r['total_tok_s']:.1f}"] for r in rows], args.out)


if __name__ == "__main__":
    main()
