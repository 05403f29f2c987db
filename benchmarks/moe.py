"""Offline decode throughput of mixture-of-experts shapes (random weights): tok/s at C=1 and C=16.

Usage: PYTHONPATH=$PWD python benchmarks/moe.py [--shapes mixtral,qwen3_moe,olmoe,dense] [--max-tokens 64]
       [--weight-dtype auto|q8_0|q4_0] [--check] [--out benchmarks/results.md]

Each shape is a small model of that family (SmolLM2's tokenizer, random weights) built in memory;
`dense` is a Llama whose MLP is as wide as the MoE shapes' active experts (top_k x expert width),
so the MoE rows can be read against the same active FLOPs. --check also runs the 16 prompts one at
a time and reports how many greedy outputs equal the batched ones (16/16 expected).
"""

from __future__ import annotations

import argparse

from offline_throughput import emit_table, machine, run_level

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import tiny_checkpoint, tiny_moe_checkpoint

BASE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=1024)
SHAPES = {  # name -> (architecture, overrides); active MLP width 2 x 512 = 4 x 256 = 8 x 128 = 1024
    "mixtral": ("mixtral", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256)),
    "olmoe": ("olmoe", dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128)),
    "dense": ("llama", {}),
}


def _checkpoint(shape: str):
    architecture, overrides = SHAPES[shape]
    if architecture == "llama":
        return tiny_checkpoint(**BASE)
    return tiny_moe_checkpoint(architecture, **BASE, **overrides)


def _describe(shape: str) -> str:
    architecture, o = SHAPES[shape]
    if not o:
        return f"dense MLP {BASE['intermediate_size']}"
    return f"{o['num_experts']} experts x {o['moe_intermediate_size']}, top {o['num_experts_per_tok']}"


def _consistency(llm: LLM, max_tokens: int) -> str:
    prompts = [f"Write a short note about topic number {i}." for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batched = llm.generate(prompts, params)
    same = sum(llm.generate([p], params)[0].token_ids == b.token_ids for p, b in zip(prompts, batched))
    return f"{same}/16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="mixtral,qwen3_moe,olmoe,dense")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--weight-dtype", default="auto", help="q8_0 / q4_0: experts (and every linear but the "
                                                               "router) quantized at load")
    parser.add_argument("--check", action="store_true", help="C=16 greedy vs one at a time (16 more C=1 runs)")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        llm = LLM(checkpoint=_checkpoint(shape), parallel=16, weight_dtype=args.weight_dtype, speculative_ngram=0,
                  kv_cache_budget="none")
        run_level(llm, 2, 8)  # warm-up: kernels, allocator
        single, sixteen = run_level(llm, 1, args.max_tokens), run_level(llm, 16, args.max_tokens)
        rows.append([shape, _describe(shape), f"{single['decode_tok_s']:.1f}", f"{sixteen['decode_tok_s']:.1f}",
                     f"{sixteen['ms_per_step']:.1f}", _consistency(llm, args.max_tokens) if args.check else "-"])
        del llm  # one model in memory at a time
    caption = (f"Machine: {machine()}; MoE shapes on hidden 512, 8 layers, 8 heads (4 KV); weights "
               f"{args.weight_dtype}; {args.max_tokens} new tokens, short prompts, greedy, ignore_eos, no speculation")
    emit_table(caption, ["shape", "MLP", "C=1 decode tok/s", "C=16 decode tok/s", "C=16 ms/step",
                         "C=16 vs C=1 greedy"], rows, args.out)


if __name__ == "__main__":
    main()
