"""LLM.chat on N conversations in one call (one continuous batch) vs a loop of single chat() calls.

Usage: PYTHONPATH=. python benchmarks/llm_chat_batch.py [--conversations 16] [--max-tokens 64] [--out results.md]
Greedy; both ways must give the same answers (checked), and the speedup is wall time loop / batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import emit_table, machine  # noqa: E402

from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.engine.sampling_params import SamplingParams  # noqa: E402

TOPICS = ["the sea", "a robot", "autumn", "coffee", "a lighthouse", "trains", "the moon", "bees",
          "chess", "rain", "a library", "volcanoes", "music", "bread", "winter", "a garden"]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--note", default="", help="appended to the caption (e.g. 'machine busy')")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # No prefix cache: the batch would otherwise reuse the prompts' blocks the loop computed first.
    llm = LLM(model=args.model, parallel=max(16, args.conversations), enable_prefix_caching=False)
    convs = conversations(args.conversations)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat(convs[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up: kernels, allocator

    start = time.perf_counter()
    looped = [llm.chat(c, params) for c in convs]
    loop_s = time.perf_counter() - start
    start = time.perf_counter()
    batched = llm.chat(convs, params)
    batch_s = time.perf_counter() - start

    same = sum(a.token_ids == b.token_ids for a, b in zip(looped, batched))
    tokens = sum(len(r.token_ids) for r in batched)
    caption = (f"LLM.chat, {args.conversations} conversations, greedy, max_tokens {args.max_tokens} "
               f"({tokens} tokens generated); {machine()}" + (f"; {args.note}" if args.note else ""))
    emit_table(caption, ["way", "wall s", "tok/s", "speedup", "same greedy answers"], [
        ["loop of single chat() calls", f"{loop_s:.2f}", f"{tokens / loop_s:.1f}", "1.00x", "-"],
        ["one chat(list) call", f"{batch_s:.2f}", f"{tokens / batch_s:.1f}", f"{loop_s / batch_s:.2f}x",
         f"{same}/{len(convs)}"],
    ], args.out)
    if same != len(convs):
        sys.exit("batched answers differ from single calls")


if __name__ == "__main__":
    main()
